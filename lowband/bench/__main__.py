"""``python -m lowband.bench SUITE --world N --out FILE.json [suite options]``.

Spawns N gloo ranks (CPU) — or uses the ranks of an enclosing ``torchrun`` — runs the suite's
contenders side by side, and writes FILE.json (DESIGN.md's shape) and FILE.md (a Markdown table).

``python -m lowband.bench --help`` lists the suites, one line each (the first line of each suite
module's docstring); ``python -m lowband.bench SUITE --help`` shows the common options and the suite's
own options (its ``add_arguments``) with their defaults. Both are one parser per suite: a suite option
with the name of a common one replaces it for that suite (``link --warmup`` is its LR warm-up).

``--quick`` turns every size knob down (the suite module's ``QUICK`` dict, plus one repeat and no
warm-up) for the options not given explicitly: the default contenders run in seconds on CPU, as a
smoke test of the suite's default invocation (tests/unit/test_bench_defaults.py).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from lowband.bench import SUITES
from lowband.bench.harness import markdown_table, write_outputs
from lowband.bench.runner import rank_main

PROG = "python -m lowband.bench"


def suite_summary(name: str) -> str:
    """The first sentence-line of a suite module's docstring, without its ````name`` suite:`` prefix."""
    doc = (importlib.import_module(SUITES[name]).__doc__ or "").strip()
    first = doc.split("\n\n", 1)[0].replace("\n", " ")
    prefix = f"``{name}`` suite:"
    return first[len(prefix):].strip() if first.startswith(prefix) else first


def _add_common(p: argparse._ActionsContainer) -> None:
    p.add_argument("--world", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--out", default=None, help="output JSON path (default bench_out/SUITE-wN.json)")
    p.add_argument("--repeats", type=int, default=10, help="timed samples per contender")
    p.add_argument("--warmup", type=int, default=2, help="untimed samples per contender first")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: every size knob turned down (the suite's QUICK settings, 1 repeat, no warm-up) "
                        "unless given explicitly; the same contenders as without it; its numbers mean nothing")


COMMON_QUICK = {"repeats": 1, "warmup": 0}
"""``--quick`` settings of the common options (each suite adds its own ``QUICK`` dict)."""


def apply_quick(suite: str, opts: dict, parser: argparse.ArgumentParser) -> dict:
    """``opts`` with the ``--quick`` settings of ``suite`` for every option left at its default."""
    mod = importlib.import_module(SUITES[suite])
    quick = {**COMMON_QUICK, **getattr(mod, "QUICK", {})}  # a suite's own value wins (link's --warmup)
    return {k: (quick[k] if k in quick and v == parser.get_default(k) else v) for k, v in opts.items()}


def top_parser() -> argparse.ArgumentParser:
    """``python -m lowband.bench [--help]``: the suite name, and the list of suites in the help."""
    lines = [f"  {name:<8} {suite_summary(name)}" for name in sorted(SUITES)]
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Side-by-side benchmarks: contenders alternate in one invocation, repeated; medians "
                    "of the slowest rank; JSON + Markdown out.",
        epilog="suites:\n" + "\n".join(lines) + f"\n\n'{PROG} SUITE --help' shows a suite's options.")
    p.add_argument("suite", choices=sorted(SUITES), help="which suite to run")
    return p


def suite_parser(suite: str) -> argparse.ArgumentParser:
    """One parser for ``python -m lowband.bench SUITE``: common options, then the suite's own."""
    mod = importlib.import_module(SUITES[suite])
    p = argparse.ArgumentParser(prog=f"{PROG} {suite}", formatter_class=argparse.RawDescriptionHelpFormatter,
                                conflict_handler="resolve", description=suite_summary(suite))
    p.add_argument("suite", choices=[suite], help=argparse.SUPPRESS)
    _add_common(p.add_argument_group("common options"))
    if hasattr(mod, "add_arguments"):
        mod.add_arguments(p.add_argument_group(f"{suite} options"))
    for action in p._actions:  # every option shows its default, documented or not
        if action.option_strings and action.default not in (None, argparse.SUPPRESS) \
                and "%(default)" not in (action.help or ""):
            action.help = f"{action.help} (default: %(default)s)" if action.help else "default: %(default)s"
    return p


def _suite_name(argv: list[str]) -> str | None:
    """The first argument that names a suite (options may come first), else None."""
    pre = argparse.ArgumentParser(add_help=False)
    _add_common(pre)
    pre.add_argument("suite", nargs="?")
    known, _ = pre.parse_known_args([a for a in argv if a not in ("-h", "--help")])
    return known.suite


def launcher_main(suite: str, mod: object, opts: dict) -> dict:
    """A suite that starts its own processes (``LAUNCHER = True``: ``link``, ``goodput``) runs in this process, so
    that SIGINT / SIGTERM reach its clean-up (namespaces, processes) instead of killing a spawned rank."""
    from lowband.bench.harness import launcher_doc

    body = mod.run(_LauncherEnv(), opts)  # type: ignore[attr-defined]
    return launcher_doc(suite, int(opts.get("groups") or opts["world"]), body)


class _LauncherEnv:
    """What a launcher suite's ``run(env, opts)`` reads of the rank environment: it is rank 0."""

    rank = 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        suite = _suite_name(argv)
        if suite is None or suite not in SUITES:
            top_parser().parse_args(argv)  # prints the help (exit 0) or the error (exit 2)
            return 2
        parser = suite_parser(suite)
        opts = vars(parser.parse_args(argv))
        if opts.get("quick"):
            opts = apply_quick(suite, opts, parser)
    except SystemExit as e:
        return 0 if e.code in (0, None) else int(e.code) if isinstance(e.code, int) else 2
    if opts["world"] < 1 or opts["repeats"] < 1 or opts["warmup"] < 0:
        print(f"{PROG}: error: --world and --repeats must be positive, --warmup >= 0", file=sys.stderr)
        return 2
    mod = importlib.import_module(SUITES[suite])
    try:  # a suite's own option checks, before any rank starts
        getattr(mod, "validate_options", lambda _opts: None)(opts)
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    out = opts["out"] or getattr(mod, "DEFAULT_OUT", None) or f"bench_out/{suite}-w{opts['world']}.json"
    if getattr(mod, "LAUNCHER", False):
        doc = launcher_main(suite, mod, {**opts, "out": out})
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        doc = rank_main(suite, opts)
    else:
        from lowband.testing import DistributedTimeout, own_pools, run_ranks

        try:
            with own_pools():  # the ranks this call started stop with it; a caller's pools are kept
                doc = run_ranks(rank_main, opts["world"], suite, opts, timeout=opts["timeout"])[0]
        except DistributedTimeout:
            print(f"{PROG}: {suite} did not finish within --timeout {opts['timeout']:g} s on {opts['world']} ranks "
                  "(nothing written); longer runs need a larger --timeout", file=sys.stderr)
            return 1
    if doc is not None:
        path, md = write_outputs(doc, out)
        print(markdown_table(doc))
        print(f"lowband.bench: wrote {path} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
