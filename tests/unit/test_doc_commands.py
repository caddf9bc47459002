"""The commands in README.md and docs/*.md work (issue 21, point 9).

Every command line of a fenced shell block that starts lowband (``python -m lowband.X``) is collected,
and every inline ```python -m lowband.train ...``` in the prose.
Those that run on CPU in seconds (``--help`` and ``--help-strategy``) are run and must exit 0. The others
are checked as far as is possible in seconds, without running them:

* ``lowband.train``: the config file and overrides load and validate (``load_config`` + ``validate``),
  but the run takes minutes (the demo: 300 steps on 2 ranks);
* ``lowband.bench SUITE ...``: the options parse with the suite's own parser; the suites' default
  invocations run in tests/unit/test_bench_defaults.py (``--quick``); the documented sizes take minutes;
* ``lowband.sample``: the options parse; it needs a trained ``runs/NAME`` (minutes of training);
* ``lowband.bench.diloco_report`` and ``lowband.bench.diloco_sweep``: read JSON files that bench runs write
  (minutes);
* ``lowband.lighthouse``: the options parse; it serves until stopped (tests/cli/test_lighthouse.py runs it).

Not checked at all (:data:`NOT_CHECKED`, with the reason): ``make`` targets (create a venv / run the whole
suite), ``torchrun`` lines (the same config as a checked ``lowband.train`` line), ``sudo`` lines (the link
suite: root and network namespaces, tests/link), ``python -c`` one-liners that load a trained run, and
lines using shell variables (``$C``).
"""

from __future__ import annotations

import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_CHECKED = {
    "make": "creates .venv / runs the whole suite",
    "torchrun": "needs a torchrun launch; the same config is checked on its lowband.train line",
    "sudo": "the link suite needs root and network namespaces (tests/link)",
    "python -c": "loads a trained run (runs/demo) that takes minutes to train",
    "$": "uses a shell variable defined in prose",
}


def doc_commands() -> list[tuple[str, str]]:
    """``(file:line, command)`` of every command line in a fenced block (continuations joined)."""
    out: list[tuple[str, str]] = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        inside = shell = False
        pending, start = "", 0
        for i, line in enumerate(lines, 1):
            if line.lstrip().startswith("```"):
                lang = line.strip()[3:].strip()
                inside, pending = (not inside and lang in ("", "bash", "sh", "shell", "console")), ""
                shell = inside
                continue
            if not inside or not shell:
                continue
            text = (pending + " " + line.strip()) if pending else line.strip()
            if text.endswith("\\"):
                pending, start = text[:-1].strip(), start if pending else i
                continue
            pending = ""
            cmd = re.sub(r"\s+#.*$", "", text).strip()
            if re.match(r"(\.venv/bin/)?python3? |torchrun |make |sudo ", cmd) and "lowband" in cmd + " make":
                out.append((f"{path.relative_to(ROOT)}:{i}", cmd))
        for m in re.finditer(r"`((?:\.venv/bin/)?python -m lowband\.train [^`]*)`", path.read_text()):
            if re.search(r"\[|\.\.\.|\b[A-Z]{3,}\b", m.group(1)):  # a synopsis with placeholders
                continue
            line = path.read_text()[: m.start()].count("\n") + 1  # inline trainer commands in prose, too
            out.append((f"{path.relative_to(ROOT)}:{line}", " ".join(m.group(1).split())))
    return out


COMMANDS = doc_commands()


def kind(cmd: str) -> str:
    for prefix in ("make", "torchrun", "sudo"):
        if cmd.startswith(prefix):
            return prefix
    if "$" in cmd:
        return "$"
    if " -c " in cmd:
        return "python -c"
    return "lowband"


def argv_of(cmd: str) -> tuple[str, list[str]]:
    """(module, args) of ``[.venv/bin/]python -m MODULE ARGS``."""
    words = shlex.split(cmd)
    m = words.index("-m")
    return words[m + 1], words[m + 2:]


def test_the_docs_hold_commands_of_every_kind() -> None:
    kinds = {kind(c) for _, c in COMMANDS}
    modules = {argv_of(c)[0] for _, c in COMMANDS if kind(c) == "lowband"}
    assert {"lowband.train", "lowband.bench", "lowband.sample"} <= modules, modules
    assert kinds <= {"lowband", *NOT_CHECKED}, kinds


def _help_commands() -> list[tuple[str, str]]:
    """The ``--help`` commands, each distinct ``python -m MODULE ARGS`` once (first place it appears)."""
    seen: dict[tuple[str, ...], tuple[str, str]] = {}
    for where, cmd in COMMANDS:
        if kind(cmd) == "lowband" and "--help" in cmd:
            module, args = argv_of(cmd)
            seen.setdefault((module, *args), (where, cmd))
    return list(seen.values())


@pytest.mark.filterwarnings("ignore:'lowband.*' found in sys.modules:RuntimeWarning")  # runpy, module imported
@pytest.mark.parametrize(("where", "cmd"), _help_commands(), ids=lambda v: v if ":" in str(v) else "")
def test_help_commands_run(where: str, cmd: str, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Run as ``python -m`` runs it (``runpy``, ``__name__ == "__main__"``), in this process: a fresh
    interpreter per command cost seconds each; one command is also run as a real subprocess below."""
    module, args = argv_of(cmd)
    monkeypatch.setattr(sys, "argv", [module, *args])
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    out = capsys.readouterr()
    assert exit_.value.code in (0, None) and out.out.strip(), (where, out.err[-2000:])


def test_a_help_command_runs_as_its_own_process() -> None:
    proc = subprocess.run([sys.executable, "-m", "lowband.train", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "--section.key=value" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.parametrize(("where", "cmd"), [(w, c) for w, c in COMMANDS if kind(c) == "lowband"
                                            and "--help" not in c], ids=lambda v: v if ":" in str(v) else "")
def test_other_commands_parse_and_validate(where: str, cmd: str) -> None:
    module, args = argv_of(cmd)
    if module == "lowband.train":
        from lowband.train.__main__ import _parse
        from lowband.train.config import load_config, validate

        config, _, overrides = _parse(args)
        cfg = load_config(ROOT / config if config else None, overrides)
        validate(cfg, world_size=cfg.run.world_size)
    elif module == "lowband.bench":
        from lowband.bench.__main__ import suite_parser

        suite_parser(args[0]).parse_args(args)
    elif module == "lowband.sample":
        from lowband.sample import _parser, check_args

        check_args(_parser().parse_args(args))
    elif module == "lowband.lighthouse":
        from lowband.lighthouse import parser

        parser().parse_args(args)
    elif module == "lowband.bench.diloco_report":
        from lowband.bench import diloco_report

        assert hasattr(diloco_report, "main"), where
    elif module == "lowband.bench.diloco_sweep":
        from lowband.bench import diloco_sweep

        assert hasattr(diloco_sweep, "main"), where
    else:
        raise AssertionError(f"{where}: no check for python -m {module}; add one here")
