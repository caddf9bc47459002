"""In-process checks of the CLI's pieces: the error summary, the run lock, the shard scan cache, stops."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from lowband.comm import Comm
from lowband.data.shards import shard_max_token, write_shard
from lowband.train import stop
from lowband.train.config import ConfigError, load_config
from lowband.train.errors import Outcome, summarize
from lowband.train.guards import NonFiniteGuard
from lowband.train.lock import LockError, acquire


def test_summary_merges_identical_errors_and_puts_causes_first() -> None:
    same = [Outcome(2, "input", "bad thing", r, 4) for r in range(4)]
    assert summarize(same, 4) == (2, ["lowband.train: error: bad thing"])  # no qualifier: every rank said it
    mixed = [Outcome(1, "peer", "peer gone (a)", 0, 4), Outcome(1, "unexpected", "boom", 2, 4),
             Outcome(1, "peer", "peer gone (b)", 1, 4), Outcome(0, "ok", "", 3, 4)]
    assert summarize(mixed, 4) == (1, ["lowband.train: error: rank 2 of 4: boom",
                                       "lowband.train: error: ranks 0, 1 of 4: peer gone (a)"])
    stopped = [Outcome(130, "stopped", "stopped by SIGINT after step 3", r, 2) for r in range(2)]
    assert summarize(stopped, 2) == (130, ["lowband.train: stopped by SIGINT after step 3"])
    assert summarize([Outcome(0, "ok", "", 0, 1)], 1) == (0, [])


def test_lock_is_exclusive_and_stale_locks_are_taken_over(tmp_path: Path) -> None:
    held = acquire(tmp_path)
    rec = json.loads(held.path.read_text())
    assert rec["pid"] == os.getpid() and rec["host"] == socket.gethostname()
    with pytest.raises(LockError, match=f"is in use by pid {os.getpid()} on host"):
        acquire(tmp_path)
    held.release()
    assert not held.path.exists()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    held.path.write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "start": None}))
    again = acquire(tmp_path)
    assert again.warnings and f"removed a stale run lock of pid {pid}" in again.warnings[0]
    again.release()
    # another host: liveness cannot be checked, so it is held
    held.path.write_text(json.dumps({"pid": 1, "host": "elsewhere-" + socket.gethostname(), "start": None}))
    with pytest.raises(LockError, match="another host"):
        acquire(tmp_path)


def test_shard_scan_is_cached_and_rescanned_when_the_shard_changes(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOWBAND_CACHE_DIR", str(tmp_path / "cache"))
    path = write_shard(tmp_path / "a.bin", np.array([1, 7, 3]))
    assert shard_max_token(path) == 7
    entry = next((tmp_path / "cache" / "shard-stats").glob("*.json"))
    rec = json.loads(entry.read_text())
    entry.write_text(json.dumps(dict(rec, max_id=99)))  # the cache is what a second call reads
    assert shard_max_token(path) == 99
    write_shard(path, np.array([1, 2, 3, 4, 500]))  # another size: scanned again
    assert shard_max_token(path) == 500
    assert shard_max_token(write_shard(tmp_path / "e.bin", np.array([], dtype=np.int64))) == -1


@pytest.mark.parametrize("key", ["optim.lr", "optim.eps", "optim.weight_decay", "run.timeout_s", "optim.beta1"])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_every_non_finite_float_is_a_config_error(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key} must be a finite number, got {float(value)!r}$"):
        load_config(None, [f"--{key}={value}"])


def test_a_stop_request_rides_the_guard_flags() -> None:
    guard = NonFiniteGuard(Comm())
    assert guard.check(1, torch.tensor(1.0), 1.0).stop == 0
    stop.request(15)
    try:
        verdict = guard.check(2, torch.tensor(1.0), 1.0)
        assert verdict.stop == 15 and not verdict.skip
        verdict = guard.check(3, torch.tensor(float("nan")), 1.0)
        assert verdict.stop == 15 and verdict.skip
    finally:
        stop.reset()
