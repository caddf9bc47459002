"""``python -m lowband.bench SUITE --world N --out FILE.json [suite options]``.

Spawns N gloo ranks (CPU) — or uses the ranks of an enclosing ``torchrun`` — runs the suite's
contenders side by side, and writes FILE.json (DESIGN.md's shape) and FILE.md (a Markdown table).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from lowband.bench import SUITES
from lowband.bench.harness import markdown_table, write_outputs
from lowband.bench.runner import rank_main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m lowband.bench")
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("--world", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    parser.add_argument("--out", default=None, help="output JSON path (default bench_out/SUITE-wN.json)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--timeout", type=float, default=1800.0)
    known, rest = parser.parse_known_args(argv)
    mod = importlib.import_module(SUITES[known.suite])
    sub = argparse.ArgumentParser(prog=f"python -m lowband.bench {known.suite}")
    if hasattr(mod, "add_arguments"):
        mod.add_arguments(sub)
    try:
        suite_args = sub.parse_args(rest)
    except SystemExit as e:
        return int(e.code or 2)
    if known.world < 1 or known.repeats < 1 or known.warmup < 0:
        print("lowband.bench: error: --world and --repeats must be positive, --warmup >= 0", file=sys.stderr)
        return 2
    opts = {**vars(known), **vars(suite_args)}
    out = known.out or f"bench_out/{known.suite}-w{known.world}.json"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        doc = rank_main(known.suite, opts)
    else:
        from lowband.testing import run_ranks, shutdown_pools

        try:
            doc = run_ranks(rank_main, known.world, known.suite, opts, timeout=known.timeout)[0]
        finally:
            shutdown_pools()
    if doc is not None:
        path, md = write_outputs(doc, out)
        print(markdown_table(doc))
        print(f"lowband.bench: wrote {path} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
