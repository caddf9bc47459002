"""Items 3, 6 and 7 of issue 16 on a real checkpoint: resume says what it does, saves that fail say so.

One module-scoped run (1 rank, 2 steps, a checkpoint after each) is copied for every case, each of
which runs the CLI on its copy and asserts the exact first line of stderr and the exit code.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import socket
from pathlib import Path

import pytest

from lowband.train.checkpoint import CheckpointError, check_metadata
from tests.cli.cli_util import TINY_TOML, assert_no_elastic_report, run_cli, stderr_lines

E = "lowband.train: error: "
W = "lowband.train: warning: "


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with ``tiny.toml`` and ``runs/t`` holding checkpoints step-1 and step-2 (run.steps = 2).

    The run starts over a stale lock (a pid that has exited), which it reports and takes over.
    """
    cwd = tmp_path_factory.mktemp("saved")
    (cwd / "tiny.toml").write_text(TINY_TOML)
    run_dir = cwd / "runs" / "t"
    run_dir.mkdir(parents=True)
    pid = os.fork()
    if pid == 0:  # a process that exits at once: its pid is dead (and not reused this quickly)
        os._exit(0)
    os.waitpid(pid, 0)
    lock = run_dir / ".lowband.lock"
    lock.write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "start": None,
                                "started_at": "2026-01-01T00:00:00Z"}))
    proc = run_cli(cwd, "--run.steps=2", "--checkpoint.every=1")
    assert proc.returncode == 0, proc.stderr
    assert stderr_lines(proc)[0] == (W + f"removed a stale run lock of pid {pid} on host {socket.gethostname()} "
                                         f"(started 2026-01-01T00:00:00Z; lock file {lock.resolve()}): that "
                                         "process is no longer running")
    assert not lock.exists()  # released at the end
    assert sorted(p.name for p in (run_dir / "checkpoint").iterdir()) == ["step-1", "step-2"]
    return cwd


def _copy(saved: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved, tmp_path / "w")
    return tmp_path / "w"


def test_resume_at_run_steps_is_a_notice_and_exit_0(saved: Path, tmp_path: Path) -> None:
    """Nothing to train: the run directory is left as the run wrote it (its summary once became an empty
    run's: no steps, no losses, no checkpoint)."""
    cwd = _copy(saved, tmp_path)
    rd = cwd / "runs" / "t"
    before = {p.name: p.read_bytes() for p in rd.iterdir() if p.is_file() and not p.name.startswith(".")}
    assert {"summary.json", "metrics.jsonl", "model.safetensors", "config.toml"} <= set(before)
    proc = run_cli(cwd, "--run.steps=2", "--checkpoint.every=1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert ("lowband.train: checkpoint 'runs/t/checkpoint/step-2' is at run.steps = 2: the run is complete, "
            "nothing to train (raise run.steps to train further)") in proc.stdout.splitlines()
    assert {n: (rd / n).read_bytes() for n in before} == before


def test_a_resume_trains_with_its_own_optimizer_settings(saved: Path, tmp_path: Path) -> None:
    """Resumed with another optim.lr and optim.weight_decay: the run trains with them, as its config.toml says
    (the checkpoint's optimizer state once brought its own back silently), and says so."""
    cwd = _copy(saved, tmp_path)
    flags = ["--run.steps=3", "--checkpoint.every=1", "--optim.schedule=constant", "--optim.warmup_steps=0"]
    proc = run_cli(cwd, *flags, "--optim.lr=0.0001", "--optim.weight_decay=0.5")
    assert proc.returncode == 0, proc.stderr
    notice = [ln for ln in proc.stdout.splitlines() if ln.startswith("lowband.train: resumed with this run's")]
    assert len(notice) == 1 and "lr " in notice[0] and "-> 0.0001" in notice[0], proc.stdout
    assert "group 0: weight_decay 0.0 -> 0.5" in notice[0], notice
    rows = [json.loads(ln) for ln in (cwd / "runs" / "t" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows if r.get("step") == 3 and "lr" in r] == [0.0001]


def test_a_resume_with_more_steps_takes_its_own_schedule_from_the_first_step(saved: Path, tmp_path: Path) -> None:
    """run.steps 2 -> 6 moves a decaying schedule: the first resumed step's lr is the new schedule's (it was the
    checkpoint's, the old schedule's value, for one step)."""
    from lowband.train.config import load_config
    from lowband.train.trainer import lr_factor

    cwd = _copy(saved, tmp_path)
    proc = run_cli(cwd, "--run.steps=6", "--checkpoint.every=1", "--optim.warmup_steps=0")
    assert proc.returncode == 0, proc.stderr
    cfg = load_config(str(cwd / "tiny.toml"), ["--run.steps=6", "--optim.warmup_steps=0"])
    rows = [json.loads(ln) for ln in (cwd / "runs" / "t" / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["lr"] for r in rows if "lr" in r and r["step"] > 2}
    assert logged == {s: cfg.optim.lr * lr_factor(cfg)(s - 1) for s in range(3, 7)}, logged


def test_a_torn_metrics_row_keeps_the_rows_around_it(saved: Path, tmp_path: Path) -> None:
    """A row cut short by a crash: the resumed run keeps every other earlier row (it once kept none)."""
    cwd = _copy(saved, tmp_path)
    metrics = cwd / "runs" / "t" / "metrics.jsonl"
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    metrics.write_text(metrics.read_text() + '{"step": 3, "loss": 5.6')
    proc = run_cli(cwd, "--run.steps=3", "--checkpoint.every=1")
    assert proc.returncode == 0, proc.stderr
    assert stderr_lines(proc) == [W + "'runs/t/metrics.jsonl': 1 line(s) that are not JSON rows (cut short by a "
                                      "crash?) left out; the other rows up to step 2 are kept"]
    after = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    assert [r for r in after if r.get("step", 0) <= 2] == [r for r in rows if r.get("step", 0) <= 2]
    assert [r["step"] for r in after if "loss" in r] == [1, 2, 3]


def test_resume_past_run_steps_is_an_error(saved: Path, tmp_path: Path) -> None:
    cwd = _copy(saved, tmp_path)
    proc = run_cli(cwd, "--run.steps=1", "--checkpoint.every=1")
    assert proc.returncode == 2
    assert stderr_lines(proc) == [E + "checkpoint 'runs/t/checkpoint/step-2' is at step 2, past run.steps = 1; "
                                      "raise run.steps to train on from it, or start over (checkpoint.resume = "
                                      "none with checkpoint.overwrite = true, or another checkpoint.dir)"]
    assert_no_elastic_report(proc)


def test_resume_with_another_seed_names_the_field(saved: Path, tmp_path: Path) -> None:
    cwd = _copy(saved, tmp_path)
    proc = run_cli(cwd, "--run.steps=3", "--checkpoint.every=1", "--run.seed=1")
    assert proc.returncode == 2
    assert stderr_lines(proc) == [E + "checkpoint 'runs/t/checkpoint/step-2' does not match this run: run.seed: "
                                      "checkpoint 0, this run 1 (the data order follows the seed; resume with the "
                                      "checkpoint's run.seed, or start over (checkpoint.resume = none with "
                                      "checkpoint.overwrite = true, or another checkpoint.dir))"]
    assert_no_elastic_report(proc)
    log = (cwd / "runs" / "t" / "logs" / "rank0.log").read_text()
    assert "Traceback (most recent call last)" in log and "CheckpointError" in log  # the full story is kept


def test_checkpoint_of_another_width_same_line_and_code_at_one_and_two_ranks(saved: Path, tmp_path: Path) -> None:
    cwd = _copy(saved, tmp_path)
    line = E + "checkpoint 'runs/t/checkpoint/step-2' does not match this run: model.n_embd: checkpoint 32, this run 64"
    # the same global batch (2 sequences) at 1 and at 2 ranks
    for world, batch in ((1, 2), (2, 1)):
        proc = run_cli(cwd, "--run.steps=3", "--checkpoint.every=1", "--model.n_embd=64",
                       f"--run.world_size={world}", f"--data.batch_size={batch}")
        assert proc.returncode == 2, (world, proc.stderr)
        assert stderr_lines(proc) == [line], (world, proc.stderr)
        assert_no_elastic_report(proc)


def test_unreadable_newest_checkpoint_is_a_warning_and_kept(saved: Path, tmp_path: Path) -> None:
    cwd = _copy(saved, tmp_path)
    ck = cwd / "runs" / "t" / "checkpoint"
    (ck / "step-2" / "lowband_checkpoint.json").write_text("{ not json")
    proc = run_cli(cwd, "--run.steps=3", "--checkpoint.every=1")
    assert proc.returncode == 0, proc.stderr
    assert stderr_lines(proc)[0] == (
        W + "skipping the newest checkpoint: checkpoint 'runs/t/checkpoint/step-2' is corrupt: "
            "lowband_checkpoint.json is not valid JSON (Expecting property name enclosed in double quotes: line 1 "
            "column 3 (char 2)); moved it to 'step-2.unreadable' (so no save overwrites it); resuming from "
            "'runs/t/checkpoint/step-1'")
    assert "resumed from runs/t/checkpoint/step-1 (step 1)" in proc.stdout
    assert (ck / "step-2.unreadable" / "lowband_checkpoint.json").read_text() == "{ not json"  # kept as it was
    assert sorted(p.name for p in ck.iterdir()) == ["step-2", "step-2.unreadable", "step-3"]


def test_flipped_metadata_without_verify_names_the_file(saved: Path, tmp_path: Path) -> None:
    cwd = _copy(saved, tmp_path)
    meta = cwd / "runs" / "t" / "checkpoint" / "step-2" / ".metadata"
    data = bytearray(meta.read_bytes())
    data[0] ^= 0xFF  # the pickle's first opcode
    meta.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        check_metadata(meta.parent, verify=False)
    expected = str(err.value).replace(str(meta.parent), "runs/t/checkpoint/step-2")
    assert "file '.metadata'" in expected
    proc = run_cli(cwd, "--run.steps=3", "--checkpoint.every=1", "--checkpoint.verify=false")
    assert proc.returncode == 2
    assert stderr_lines(proc) == [E + expected]
    assert_no_elastic_report(proc)
    # verify = true (the default) names the same file by its SHA-256
    proc = run_cli(cwd, "--run.steps=3", "--checkpoint.every=1")
    assert proc.returncode == 2
    assert stderr_lines(proc) == [E + "checkpoint 'runs/t/checkpoint/step-2' is corrupt: file '.metadata' does not "
                                      "match its recorded SHA-256"]


def _small_files() -> None:
    """In the child: files may not grow past 256 KiB (a checkpoint file is ~600 KB); EFBIG, not SIGXFSZ."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))


def test_a_failed_save_says_so_and_names_the_valid_checkpoint(saved: Path, tmp_path: Path) -> None:
    cwd = _copy(saved, tmp_path)
    ck = cwd / "runs" / "t" / "checkpoint"
    proc = run_cli(cwd, "--run.steps=4", "--checkpoint.every=1", preexec_fn=_small_files)
    assert proc.returncode == 1, proc.stderr
    # torch's writer reports a short write as "unexpected pos <written> vs <expected>" (sizes vary by build)
    failed = (r"checkpoint save of step 3 into 'runs/t/checkpoint' failed \(a write was cut short: disk full or a "
              r"file-size limit; torch: unexpected pos \d+ vs \d+\); the previous checkpoint "
              r"'runs/t/checkpoint/step-2' \(step 2\) stays valid")
    lines = stderr_lines(proc)
    assert len(lines) == 1 and re.fullmatch(
        re.escape(E) + failed + re.escape("; the run stops (set checkpoint.on_save_error = continue to train on "
                                          "without it)"), lines[0]), proc.stderr
    assert_no_elastic_report(proc)
    assert sorted(p.name for p in ck.iterdir()) == ["step-1", "step-2"]  # no partial folder left behind
    # as configured: continue
    proc = run_cli(cwd, "--run.steps=4", "--checkpoint.every=1", "--checkpoint.on_save_error=continue",
                   preexec_fn=_small_files)
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(re.escape(W) + failed + re.escape("; training continues (checkpoint.on_save_error = "
                                                          "continue)"), stderr_lines(proc)[0]), proc.stderr
    assert "step     4/4" in proc.stdout
    assert sorted(p.name for p in ck.iterdir()) == ["step-1", "step-2"]


def test_a_failed_async_save_with_continue_trains_on_and_exports(saved: Path, tmp_path: Path) -> None:
    """checkpoint.on_save_error = continue covers async saves too: a save that fails in the background (found at
    its commit, the next save or the run's end) is a warning, the next save is still made, and the run ends with
    exit 0 and its model (it ended with exit 1 and no model; the next save was never started)."""
    cwd = _copy(saved, tmp_path)
    ck = cwd / "runs" / "t" / "checkpoint"
    proc = run_cli(cwd, "--run.steps=4", "--checkpoint.every=1", "--checkpoint.async_save=true",
                   "--checkpoint.on_save_error=continue", preexec_fn=_small_files)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in stderr_lines(proc) if "training continues" in line]
    for step in (3, 4):  # each save failed and was reported as its own
        assert sum(f"checkpoint save of step {step} into 'runs/t/checkpoint' failed" in w for w in warnings) == 1, \
            proc.stderr
    assert "step     4/4" in proc.stdout
    assert "model written to" in proc.stdout, proc.stdout
    assert (cwd / "runs" / "t" / "model.safetensors").is_file()
    assert sorted(p.name for p in ck.iterdir()) == ["step-1", "step-2"]
