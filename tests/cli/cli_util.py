"""Helpers for the CLI tests: run ``python -m lowband.train`` as a person would, in a temporary folder."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A tiny run: one block, 32 wide, 3 steps of 2 sequences of 32 tokens per rank on the built-in corpus; no
# loss.png (matplotlib costs each run about a second; tests/distributed/test_trainer.py checks the plot).
TINY_TOML = """\
[run]
name = "t"
steps = 3
log_every = 1
val_every = 0
val_batches = 1
world_size = 1
timeout_s = 20
plot = false
[model]
n_layer = 1
n_embd = 32
n_head = 2
seq_len = 32
[data]
batch_size = 2
[strategy]
name = "ddp"
"""

# Spawning a rank imports torch: tens of seconds on a loaded 2-core machine.
RUN_TIMEOUT_S = 300


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOWBAND_DEBUG")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def cli_args(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "lowband.train", "--config", "tiny.toml", *overrides]


def run_cli(cwd: Path, *overrides: str, env: dict[str, str] | None = None,
            preexec_fn: Callable[[], None] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cli_args(*overrides), cwd=cwd, env=cli_env(env), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, preexec_fn=preexec_fn)


def stderr_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.strip()]


def assert_no_elastic_report(proc: subprocess.CompletedProcess) -> None:
    """No torch elastic report and no traceback on stderr (the default, without --debug)."""
    assert "ChildFailedError" not in proc.stderr, proc.stderr
    assert "torch.distributed.elastic" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux ``/proc/<pid>/task/*/children``)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def is_rank(pid: int) -> bool:
    """``pid`` runs ``python -m lowband.train`` (a rank of the self-launcher, not its janitor)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"-m" in argv and b"lowband.train" in argv


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def wait_for_line(path: Path, needle: str, proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and needle in path.read_text():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (code {proc.returncode}) before printing {needle!r}")
        time.sleep(0.2)
    raise AssertionError(f"no {needle!r} within {timeout} s")
