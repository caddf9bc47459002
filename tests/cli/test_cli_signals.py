"""Item 5 of issue 16: signals reach every rank, and no rank outlives its launcher.

Each test starts the self-launcher with 2 CPU ranks on a long tiny run, waits until training logs a
step, then signals or kills. Checks: the exit code, the exact first line of stderr, the final
checkpoint, and that no rank process is left (within ``run.timeout_s``, the process-group timeout).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from tests.cli.cli_util import (
    RUN_TIMEOUT_S,
    alive,
    children_of,
    cli_args,
    cli_env,
    is_rank,
    wait_for_line,
)

PG_TIMEOUT_S = 20  # run.timeout_s in tiny.toml


def _start(cwd: Path, *overrides: str) -> tuple[subprocess.Popen, list[int]]:
    """The launcher (leader of a new process group, as a shell job) and its rank pids, once step 1 logged."""
    proc = subprocess.Popen(cli_args("--run.world_size=2", "--run.steps=100000", *overrides), cwd=cwd,
                            env=cli_env(), stdout=(cwd / "out.txt").open("w"), stderr=(cwd / "err.txt").open("w"),
                            start_new_session=True)
    try:
        wait_for_line(cwd / "out.txt", "step     1/100000", proc)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    ranks = [p for p in children_of(proc.pid) if is_rank(p)]
    assert len(ranks) == 2, ranks
    return proc, ranks


def _assert_gone(pids: list[int], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"rank processes {left} outlived the launcher"


def _err_lines(cwd: Path) -> list[str]:
    return [ln for ln in (cwd / "err.txt").read_text().splitlines() if ln.strip()]


def _assert_no_report(cwd: Path) -> None:
    err = (cwd / "err.txt").read_text()
    for word in ("ChildFailedError", "torch.distributed.elastic", "Traceback", "KeyboardInterrupt"):
        assert word not in err, err


def _stopped_cleanly(tiny: Path, proc: subprocess.Popen, ranks: list[int], sig: int) -> None:
    code = proc.wait(timeout=PG_TIMEOUT_S + 60)
    _assert_gone(ranks, 5)
    name = signal.Signals(sig).name
    assert code == 128 + sig, (tiny / "err.txt").read_text()
    lines = _err_lines(tiny)
    assert len(lines) == 1, lines
    m = re.fullmatch(rf"lowband\.train: stopped by {name} after step (\d+) of 100000 \(final checkpoint "
                     rf"step-(\d+) saved; the same command resumes\)", lines[0])
    assert m and m.group(1) == m.group(2), lines
    step = int(m.group(1))
    assert (tiny / "runs" / "t" / "checkpoint" / f"step-{step}" / "lowband_checkpoint.json").is_file()
    assert f"step {step:>5}/100000" in (tiny / "out.txt").read_text()
    _assert_no_report(tiny)
    assert not (tiny / "runs" / "t" / ".lowband.lock").exists()  # released


def test_ctrl_c_stops_every_rank_at_the_same_step_with_a_final_checkpoint(tiny: Path) -> None:
    proc, ranks = _start(tiny, "--checkpoint.every=100000")
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the terminal's foreground process group
    _stopped_cleanly(tiny, proc, ranks, signal.SIGINT)


def test_sigterm_of_the_launcher_is_forwarded(tiny: Path) -> None:
    proc, ranks = _start(tiny, "--checkpoint.every=100000")
    os.kill(proc.pid, signal.SIGTERM)
    _stopped_cleanly(tiny, proc, ranks, signal.SIGTERM)


def _launch_folder(rank_pid: int) -> Path:
    """The launcher's temporary folder, from a rank's environment (its FileStore rendezvous lives there)."""
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{rank_pid}/environ").read_text().split("\0") if "=" in kv)
    return Path(env["LOWBAND_INIT_METHOD"].removeprefix("file://")).parent


def test_sigkill_of_the_launchers_process_group_leaves_no_rank(tiny: Path) -> None:
    """Nor the launcher's temporary folder: its janitor (own session) removes it once the launcher is gone."""
    proc, ranks = _start(tiny)
    work = _launch_folder(ranks[0])
    assert work.is_dir() and work.name.startswith("lowband-launch-")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    _assert_gone(ranks, PG_TIMEOUT_S)
    deadline = time.monotonic() + 60
    while work.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not work.exists(), f"{work} outlived the killed launcher"


def test_a_clean_run_leaves_no_launch_folder_and_no_janitor(tiny: Path) -> None:
    proc, ranks = _start(tiny, "--checkpoint.every=100000")
    work = _launch_folder(ranks[0])
    janitors = [p for p in children_of(proc.pid) if p not in ranks]
    assert len(janitors) == 1, janitors
    os.kill(proc.pid, signal.SIGTERM)
    _stopped_cleanly(tiny, proc, ranks, signal.SIGTERM)
    assert not work.exists()
    _assert_gone(janitors, 10)  # told "done" and reaped by the launcher


def test_a_rank_that_dies_is_named_first_then_its_peer(tiny: Path) -> None:
    proc, ranks = _start(tiny)
    victim = ranks[1]
    env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{victim}/environ").read_bytes().split(b"\0") if b"=" in kv)
    rank_of_victim = int(env[b"RANK"])
    os.kill(victim, signal.SIGKILL)
    code = proc.wait(timeout=RUN_TIMEOUT_S)
    _assert_gone(ranks, 5)
    assert code == 1
    lines = _err_lines(tiny)
    other = 1 - rank_of_victim
    assert lines[0] == (f"lowband.train: error: rank {rank_of_victim} of 2: the rank process was killed by SIGKILL "
                        "without reporting an error (out of memory? see dmesg); its log: "
                        f"runs/t/logs/rank{rank_of_victim}.log")
    assert lines[1].startswith(f"lowband.train: error: rank {other} of 2: a collective failed because a peer "
                               "process died or stopped responding (process-group timeout run.timeout_s = 20 s); "
                               "this rank stops. Backend error: ")
    assert len(lines) == 2
    _assert_no_report(tiny)
