"""Nothing lost, nothing misleading: run and checkpoint locks, checkpoint ownership, data fingerprints.

A run that must stay alive while another starts is held by a model factory that waits for a file
(``release``) after announcing itself (``holding-<pid>``): nothing here depends on timing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lowband.train.lock import LockError, acquire
from tests.cli.cli_util import RUN_TIMEOUT_S, cli_args, cli_env, run_cli, stderr_lines

E = "lowband.train: error: "
W = "lowband.train: warning: "

HOLD_FACTORY = """\
import os
import time
from pathlib import Path

from lowband.train.models import gpt_factory


def held(cfg):
    Path(f"holding-{os.getpid()}").touch()
    while not Path("release").exists():
        time.sleep(0.05)
    return gpt_factory(cfg)
"""


def _start(cwd: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(cli_args(*overrides), cwd=cwd, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_until(cond, procs: list[subprocess.Popen]) -> None:
    """Poll ``cond()`` (no timing in the verdict: the deadline only turns a hang into a failure)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("the runs neither ended nor reached the model factory")
        time.sleep(0.1)


@contextlib.contextmanager
def _held_runs(cwd: Path) -> Iterator[list[subprocess.Popen]]:
    """Started runs (appended by the test) that a ``release`` file lets go; killed if the test fails."""
    (cwd / "holdfactory.py").write_text(HOLD_FACTORY)
    procs: list[subprocess.Popen] = []
    try:
        yield procs
    finally:
        (cwd / "release").touch()
        for p in procs:
            if p.returncode is not None:
                continue  # already collected by the test
            try:
                p.communicate(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:  # a process that exits at once: its pid is dead (and not reused this quickly)
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


# -------------------------------------------------------------------------------------------------
# 1. The checkpoint folder is always locked, also inside a run directory.

def test_checkpoint_dir_of_a_live_run_is_refused(tiny: Path) -> None:
    with _held_runs(tiny) as procs:
        a = _start(tiny, "--run.name=a", "--checkpoint.every=1", "--model.factory=holdfactory:held")
        procs.append(a)
        _wait_until(lambda: any(tiny.glob("holding-*")) or a.poll() is not None, procs)
        assert a.poll() is None, a.communicate()
        ck = (tiny / "runs" / "a" / "checkpoint").resolve()
        proc = run_cli(tiny, "--run.name=b", "--checkpoint.every=1", "--checkpoint.dir=runs/a/checkpoint")
        assert proc.returncode == 2, proc.stderr
        assert stderr_lines(proc) == [
            E + f"checkpoint directory {str(ck)!r} is in use by pid {a.pid} on host {socket.gethostname()} "
                f"(started {json.loads((ck / '.lowband.lock').read_text())['started_at']}; lock file "
                f"{ck / '.lowband.lock'}); wait for that run to end, or choose another run.name / run.out_dir / "
                "checkpoint.dir"]
        assert not (tiny / "runs" / "b").exists() or not any((tiny / "runs" / "b").glob("metrics.jsonl"))
        (tiny / "release").touch()
        _, err = a.communicate(timeout=RUN_TIMEOUT_S)
        assert a.returncode == 0, err
    assert sorted(p.name for p in ck.iterdir()) == ["step-2", "step-3"]  # a's own saves; its locks released


# -------------------------------------------------------------------------------------------------
# 2. A run never deletes checkpoints it did not write.

def _markers(ck: Path) -> dict[str, dict]:
    return {p.name: json.loads((p / "lowband_checkpoint.json").read_text()) for p in sorted(ck.glob("step-*"))}


def test_a_run_never_deletes_checkpoints_it_did_not_write(tiny: Path) -> None:
    ck = tiny / "runs" / "t" / "checkpoint"
    proc = run_cli(tiny, "--run.steps=4", "--checkpoint.every=1")
    assert proc.returncode == 0, proc.stderr
    longer = _markers(ck)
    assert sorted(longer) == ["step-3", "step-4"]

    # a fresh run (resume = none) into that folder: refused before it saves anything, the folder as it was
    # (run.overwrite = true lets it replace the run directory's other outputs: the checkpoints' own rule decides)
    proc = run_cli(tiny, "--run.steps=2", "--checkpoint.every=1", "--checkpoint.resume=none", "--run.overwrite=true")
    assert proc.returncode == 2, proc.stderr
    assert stderr_lines(proc) == [
        E + "checkpoint.dir 'runs/t/checkpoint' holds checkpoints this run would not continue: step-3, step-4 "
            "(written by another run); resume from them (checkpoint.resume = latest), choose another "
            "checkpoint.dir, or set checkpoint.overwrite = true to replace them (deleted after this run's first "
            "save)"]
    assert _markers(ck) == longer
    assert len({m["lineage"] for m in longer.values()}) == 1

    # resuming from an older checkpoint than the folder's newest: its saves would land below step-4
    proc = run_cli(tiny, "--run.steps=4", "--checkpoint.every=1", "--checkpoint.resume=runs/t/checkpoint/step-3")
    assert proc.returncode == 2, proc.stderr
    assert stderr_lines(proc) == [
        E + "checkpoint.dir 'runs/t/checkpoint' holds checkpoints this run would not continue: step-4 (newer than "
            "the resumed step 3); choose another checkpoint.dir, or set checkpoint.overwrite = true to replace "
            "them (deleted after this run's first save)"]
    assert _markers(ck) == longer

    # asked to replace them: they go after this run's first save; what it reports is on disk
    proc = run_cli(tiny, "--run.steps=2", "--checkpoint.every=1", "--checkpoint.resume=none",
                   "--checkpoint.overwrite=true", "--run.overwrite=true")
    assert proc.returncode == 0, proc.stderr
    assert stderr_lines(proc) == [
        W + "checkpoint.dir 'runs/t/checkpoint' holds checkpoints this run would not continue: step-3, step-4 "
            "(written by another run); checkpoint.overwrite = true: this run's first save deletes them"]
    fresh = _markers(ck)
    assert sorted(fresh) == ["step-1", "step-2"]
    (lineage,) = {m["lineage"] for m in fresh.values()}
    assert lineage != next(iter(longer.values()))["lineage"]
    summary = json.loads((tiny / "runs" / "t" / "summary.json").read_text())
    assert summary["checkpoint"] == "runs/t/checkpoint/step-2" and (tiny / summary["checkpoint"]).is_dir()



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_run_never_overwrites_another_runs_outputs(tiny: Path) -> None:
    """The run directory's outputs (model, metrics, config, summary) belong to the run that wrote them: a run with
    another config that does not resume is refused before it writes anything, with the self-launcher and as a
    torchrun rank; the same command again (a restart) and ``run.overwrite = true`` go ahead (a resume from the
    run's checkpoints: the two tests below)."""
    from lowband.train.preflight import RUN_OUTPUTS

    rd = tiny / "runs" / "t"
    proc = run_cli(tiny, "--run.steps=2")
    assert proc.returncode == 0, proc.stderr
    before = {n: (rd / n).read_bytes() for n in RUN_OUTPUTS if (rd / n).is_file()}
    assert {"model.safetensors", "metrics.jsonl", "config.toml", "summary.json"} <= set(before)
    listed = ", ".join(n for n in RUN_OUTPUTS if n in before)
    refused = [E + f"run directory 'runs/t' holds another run's outputs ({listed}; its config.toml is another "
               "config), which this run would overwrite; choose another run.name / "
               "run.out_dir, resume that run from its checkpoints, or set run.overwrite = true to replace them"]
    torchrun = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    for env in (None, torchrun):
        proc = run_cli(tiny, "--run.steps=2", "--run.seed=1", env=env)
        assert proc.returncode == 2 and stderr_lines(proc) == refused, proc.stderr
        assert {n: (rd / n).read_bytes() for n in before} == before  # nothing written
    proc = run_cli(tiny, "--run.steps=2")  # the same command again: a restart of that run
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(tiny, "--run.steps=2", "--run.seed=1", "--run.overwrite=true")
    assert proc.returncode == 0, proc.stderr
    assert (rd / "model.safetensors").read_bytes() != before["model.safetensors"]
    assert json.loads((rd / "config.toml").read_text().split("seed = ")[1].split("\n")[0]) == 1


def test_a_resume_continues_its_own_run_and_never_another_runs_outputs(tiny: Path) -> None:
    """A run that saves checkpoints, then one with more steps resuming from them: it continues that run (its
    outputs are its own). Another run directory with outputs of its own resuming that checkpoint is refused."""
    rd = tiny / "runs" / "t"
    proc = run_cli(tiny, "--run.steps=2", "--checkpoint.every=1")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(tiny, "--run.steps=3", "--checkpoint.every=1")
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(ln)["step"] for ln in (rd / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(ln)][-1] == 3
    # another run directory with outputs of its own, resuming run t's checkpoint: not its history, refused
    proc = run_cli(tiny, "--run.name=u", "--run.steps=2", "--run.seed=3")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(tiny, "--run.name=u", "--run.steps=3", "--checkpoint.resume=runs/t/checkpoint/step-2")
    assert proc.returncode == 2 and "run directory 'runs/u' holds another run's outputs" in proc.stderr, proc.stderr


def test_a_checkpoint_dir_outside_the_run_directory_belongs_to_the_run_that_wrote_it(tiny: Path) -> None:
    """checkpoint.dir outside the run directory: the marker names the run directory whose run wrote it, so run v
    continues with more steps, while run u (outputs of its own) taking v's checkpoints from there is refused."""
    proc = run_cli(tiny, "--run.name=u", "--run.steps=2", "--run.seed=3")
    assert proc.returncode == 0, proc.stderr
    ext = ["--checkpoint.every=1", "--checkpoint.dir=shared/ckpt"]
    proc = run_cli(tiny, "--run.name=v", "--run.steps=2", *ext)
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(tiny, "--run.name=v", "--run.steps=3", *ext)
    assert proc.returncode == 0, proc.stderr
    u_before = {n: (tiny / "runs" / "u" / n).read_bytes() for n in ("metrics.jsonl", "model.safetensors")}
    proc = run_cli(tiny, "--run.name=u", "--run.steps=4", *ext)
    assert proc.returncode == 2 and "run directory 'runs/u' holds another run's outputs" in proc.stderr, proc.stderr
    assert {n: (tiny / "runs" / "u" / n).read_bytes() for n in u_before} == u_before


# -------------------------------------------------------------------------------------------------
# 3. Taking the lock is atomic: many contenders on one stale lock, exactly one wins.

CONTENDER = """\
import importlib.util
import os
import sys
import time

spec = importlib.util.spec_from_file_location("lock", sys.argv[1])  # the lock module alone: no torch to import
lock = sys.modules["lock"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)
go = sys.argv[3]


def yielding(frame, event, arg):  # give up the CPU at every line of the lock code: interleave the contenders
    if frame.f_globals is lock.__dict__ or event != "call":
        os.sched_yield()
    return yielding


while not os.path.exists(go):  # start together
    time.sleep(0.001)
sys.settrace(yielding)
try:
    held = lock.acquire(sys.argv[2])
    sys.settrace(None)
except lock.LockError as e:
    print(f"lowband.train: error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
print("won", flush=True)
sys.stdin.read()  # hold the lock until every contender has answered
held.release()
"""


def test_many_contenders_on_one_stale_lock_exactly_one_wins(tmp_path: Path) -> None:
    import lowband.train.lock as lock_mod

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = _dead_pid()
    (run_dir / ".lowband.lock").write_text(json.dumps({"pid": dead, "host": socket.gethostname(), "start": None,
                                                        "started_at": "2026-01-01T00:00:00Z"}))
    (tmp_path / "contender.py").write_text(CONTENDER)
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "contender.py"), lock_mod.__file__, str(run_dir),
                               str(go)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(16)]
    try:
        go.touch()
        # each contender either exits (refused) or prints "won" and holds the lock until its stdin closes
        answers = [p.stdout.readline().strip() for p in procs]
        winners = [p for p, a in zip(procs, answers, strict=True) if a == "won"]
        assert len(winners) == 1, answers
        (winner,) = winners
        for p in procs:
            if p is winner:
                continue
            _, err = p.communicate(timeout=RUN_TIMEOUT_S)
            lines = [ln for ln in err.splitlines() if ln.strip()]
            assert p.returncode == 2 and len(lines) == 1, err
            assert lines[0].startswith(E + f"run directory {str(run_dir)!r} is in use by "), err
            if "is in use by pid" in lines[0]:
                assert f"is in use by pid {winner.pid} on host" in lines[0], err
        winner.communicate(input="", timeout=RUN_TIMEOUT_S)
        assert winner.returncode == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert not (run_dir / ".lowband.lock").exists()  # the winner released it


def test_a_lock_whose_holder_was_killed_by_sigkill_is_taken_over(tmp_path: Path) -> None:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the holder: take the lock, say so, wait to be killed
        os.close(r)
        try:
            acquire(tmp_path)
            os.write(w, b"1")
        finally:
            os.write(w, b"0")
        signal.pause()
        os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"1"
        with pytest.raises(LockError, match=f"is in use by pid {pid} on host"):
            acquire(tmp_path)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
    again = acquire(tmp_path)
    try:
        assert again.warnings and f"removed a stale run lock of pid {pid}" in again.warnings[0]
        assert json.loads((tmp_path / ".lowband.lock").read_text())["pid"] == os.getpid()
    finally:
        again.release()
    assert not (tmp_path / ".lowband.lock").exists()


# -------------------------------------------------------------------------------------------------
# 4. Resuming on other data is refused, naming both fingerprints.

def test_resume_on_edited_text_with_the_same_size_and_mtime_is_refused(tiny: Path) -> None:
    text = tiny / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 60)
    st = text.stat()
    args = ["--data.source=text", f"--data.path={text}", "--checkpoint.every=1"]
    env = {"LOWBAND_CACHE_DIR": str(tiny / "cache")}
    proc = run_cli(tiny, "--run.steps=2", *args, env=env)
    assert proc.returncode == 0, proc.stderr
    saved = json.loads((tiny / "runs" / "t" / "checkpoint" / "step-2" / "lowband_checkpoint.json").read_text())
    # the same size and modification time, other bytes (cp -p, rsync -a, tar x, touch -r)
    text.write_text("THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG\n" * 60)
    os.utime(text, ns=(st.st_atime_ns, st.st_mtime_ns))
    proc = run_cli(tiny, "--run.steps=3", *args, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = stderr_lines(proc)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(E + f"checkpoint 'runs/t/checkpoint/step-2' was trained on other data: data "
                                   f"fingerprint {saved['data_fingerprint']} (")
    assert lines[0].count("sha256-") == 2 and "checkpoint.allow_data_change = true" in lines[0]
    # asked to allow it: a warning, and training goes on from step 2
    proc = run_cli(tiny, "--run.steps=3", *args, "--checkpoint.allow_data_change=true", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "(checkpoint.allow_data_change = true)" in stderr_lines(proc)[0]
    assert "resumed from runs/t/checkpoint/step-2 (step 2)" in proc.stdout
