"""Items 2-4 of issue 16: what is checkable before the first collective is checked, in one line, exit 2.

Each case runs the real CLI. At ``run.world_size = 2`` the self-launcher finds the problem before it
starts any rank; at 1 the single process finds it before it trains. Both print the same first line
and exit with the same code, with no torch elastic report and no traceback (``--debug`` adds it).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from lowband.data import write_shard
from lowband.train.lock import _proc_start
from tests.cli.cli_util import assert_no_elastic_report, run_cli, stderr_lines

E = "lowband.train: error: "


def _expect(cwd: Path, overrides: list[str], line: str, code: int = 2, worlds: tuple[int, ...] = (1, 2)) -> None:
    for world in worlds:
        proc = run_cli(cwd, *overrides, f"--run.world_size={world}")
        assert proc.returncode == code, (world, proc.stderr)
        lines = stderr_lines(proc)
        assert lines and lines[0] == line, (world, proc.stderr)
        assert len(lines) == 1, (world, proc.stderr)
        assert_no_elastic_report(proc)


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_learning_rate_is_a_config_error(tiny: Path, value: str) -> None:
    _expect(tiny, [f"--optim.lr={value}"], E + f"optim.lr must be a finite number, got {float(value)!r}")


def test_vocab_smaller_than_the_tokenizer_is_a_config_error(tiny: Path) -> None:
    _expect(tiny, ["--model.vocab_size=200"],
            E + "model.vocab_size = 200 is smaller than the byte tokenizer's 258 ids (data.source = builtin); "
                "use model.vocab_size >= 258 (320 is the padded default)")


def test_token_ids_beyond_the_vocabulary_are_found_before_training(tiny: Path) -> None:
    cache = tiny / "cache"
    ids = np.arange(5000) % 256
    ids[1234] = 400
    write_shard(tiny / "data" / "a.bin", ids)
    pattern = str(tiny / "data" / "*.bin")
    line = (E + f"data.train_bin: shard {str(tiny / 'data' / 'a.bin')!r} holds token id 400, but model.vocab_size "
            "= 320 (ids must be < vocab_size); set model.vocab_size >= 401 or use shards of a matching tokenizer")
    for world in (1, 2):
        proc = run_cli(tiny, "--data.source=bin", f"--data.train_bin={pattern}", f"--run.world_size={world}",
                       env={"LOWBAND_CACHE_DIR": str(cache)})
        assert proc.returncode == 2 and stderr_lines(proc) == [line], proc.stderr
        assert_no_elastic_report(proc)
    assert len(list((cache / "shard-stats").glob("*.json"))) == 1  # the one scan was cached


def test_corpus_shorter_than_one_global_batch(tiny: Path) -> None:
    write_shard(tiny / "small.bin", np.arange(100) % 256)
    # 100 tokens less the 5-token validation tail = 95 = 2 windows of 32 (+1); a global batch at 2 ranks x 2
    # sequences needs 4.
    proc = run_cli(tiny, "--data.source=bin", "--data.train_bin=small.bin", "--run.world_size=2")
    assert proc.returncode == 2
    assert stderr_lines(proc) == [
        E + "data: data.train_bin 'small.bin' (without its validation tail) has 95 tokens, 2 windows of "
            "model.seq_len = 32 (+1 target), fewer than one global batch of data.batch_size x world size = 2 x 2 "
            "= 4; lower data.batch_size or model.seq_len, or use more data"]
    assert_no_elastic_report(proc)
    # seq_len longer than the whole corpus: zero windows
    proc = run_cli(tiny, "--data.source=bin", "--data.train_bin=small.bin", "--model.seq_len=128")
    assert proc.returncode == 2
    assert stderr_lines(proc)[0].startswith(E + "data: data.train_bin 'small.bin' (without its validation tail) "
                                                "has 95 tokens, 0 windows of model.seq_len = 128 (+1 target)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_is_a_config_error(tiny: Path) -> None:
    build = "a CPU-only build" if torch.version.cuda is None else "no GPU visible"
    _expect(tiny, ["--run.device=cuda"],
            E + f"run.device = cuda, but CUDA is not available here (torch {torch.__version__}, {build}); use "
                "run.device = cpu or auto")


def test_unwritable_checkpoint_directory(tiny: Path) -> None:
    (tiny / "blocker").write_text("a file, not a folder")
    _expect(tiny, ["--checkpoint.every=1", "--checkpoint.dir=blocker/ck"],
            E + "checkpoint.dir: cannot create 'blocker/ck': 'blocker' is not a directory; choose another path")
    _expect(tiny, ["--run.out_dir=blocker"],
            E + "run.out_dir: 'blocker' exists and is not a directory; choose a directory path", worlds=(2,))


def test_a_checkpoint_directory_inside_a_committed_checkpoint_is_refused(tiny: Path) -> None:
    """checkpoint.dir = <a step-N folder> (a slip for checkpoint.resume) started from step 0 and saved this run's
    checkpoints inside that one, where its own run's pruning deleted them."""
    step = tiny / "ck" / "step-8"
    step.mkdir(parents=True)
    (step / "lowband_checkpoint.json").write_text("{}")
    where = str(step.resolve())
    for given, inside in (("ck/step-8", "is"), ("ck/step-8/sub", "lies inside")):
        _expect(tiny, ["--checkpoint.every=1", f"--checkpoint.dir={given}"],
                E + f"checkpoint.dir: '{given}' {inside} the committed checkpoint {where!r}: this run's files would "
                    "be mixed into it (and deleted with it when its run prunes it). To resume from it set "
                    f"checkpoint.resume = {where!r}; to save, choose a directory outside it")
    assert not (step / "sub").exists()


def test_more_cpu_ranks_than_cores_warns_first(tiny: Path) -> None:
    # One core visible (affinity): 2 ranks are more than the cores. A missing shard then stops the run
    # before any rank starts, so the test stays fast; the warning is the first line.
    proc = run_cli(tiny, "--run.world_size=2", "--data.source=bin", "--data.train_bin=nope-*.bin",
                   preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))
    assert proc.returncode == 2
    assert stderr_lines(proc) == [
        "lowband.train: warning: run.world_size = 2 CPU ranks on 1 CPU core: the ranks will share cores and run "
        "slowly; use run.world_size <= 1",
        E + "nope-*.bin: no token shard files match this pattern"]


def test_a_run_directory_in_use_exits_2_naming_the_owner(tiny: Path) -> None:
    run_dir = tiny / "runs" / "t"
    run_dir.mkdir(parents=True)
    lock = run_dir / ".lowband.lock"
    # The owner: this (live) test process, on this host.
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "start": _proc_start(os.getpid()),
                                "started_at": "2026-01-01T00:00:00Z"}))
    d = run_dir.resolve()
    _expect(tiny, [], E + f"run directory {str(d)!r} is in use by pid {os.getpid()} on host {socket.gethostname()} "
                          f"(started 2026-01-01T00:00:00Z; lock file {d / '.lowband.lock'}); wait for that run to "
                          "end, or choose another run.name / run.out_dir")
    assert lock.exists()  # the owner's lock is left alone


def test_debug_prints_the_traceback(tiny: Path) -> None:
    proc = run_cli(tiny, "--optim.lr=inf", "--debug")
    assert proc.returncode == 2
    assert "Traceback (most recent call last)" in proc.stderr and "ConfigError" in proc.stderr
    assert stderr_lines(proc)[-1] == E + "optim.lr must be a finite number, got inf"
    proc = run_cli(tiny, "--optim.lr=inf", env={"LOWBAND_DEBUG": "1"})
    assert "Traceback (most recent call last)" in proc.stderr
