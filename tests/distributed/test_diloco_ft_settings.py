"""Fault-tolerant DiLoCo refuses replica groups whose settings differ, at the first sync of the quorum they
join, on every group, naming the setting: ``fp8`` and ``int8`` wires have the same message size, so without
the check they would decode each other's bytes as something else; a model of another width would fail in
torchft's heal with no word about why. Two replica processes (one rank each) around an in-process Lighthouse."""

from __future__ import annotations

import pickle
import queue
import time
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torchft._torchft import LighthouseServer  # the ft extra: scripts/setup.sh installs it

from tests.distributed.test_diloco_ft_codecs import _manager

TIMEOUT_S = 150


def _replica(replica: int, lighthouse: str, cfg: dict[str, Any], out: Any) -> None:
    from lowband.comm import CommLedger
    from lowband.diloco import StreamingDiLoCo
    from lowband.diloco.ft import TorchftMembership

    torch.set_num_threads(1)
    torch.manual_seed(cfg.get("seeds", [0, 1])[replica])
    width = cfg["width"][replica]
    model = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 2))
    inner = torch.optim.SGD(model.parameters(), lr=1e-2)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    heals = []

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])
        heals.append(1)

    init_sync = cfg.get("init_sync_by_replica", [cfg.get("init_sync", True)] * 2)[replica]
    manager = _manager(replica, lighthouse, state_dict, load_state_dict, init_sync=init_sync)
    ledger = CommLedger()
    diloco = StreamingDiLoCo(model, inner, sync_every=2, fragments=1, wire=cfg["wire"][replica],
                             ef_decay=cfg.get("ef_decay", [1.0, 1.0])[replica],
                             membership=TorchftMembership(manager, ledger=ledger))
    g = torch.Generator().manual_seed(replica)
    try:
        while diloco.committed < cfg["target"]:
            x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
            inner.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            inner.step()
        try:  # no replica group to average over outside a quorum: refused, before any collective
            diloco.averaged_model()
            refusal = ""
        except ValueError as e:
            refusal = str(e)
        result = ("done", replica, (diloco.committed, len(heals), [g.clone() for g in diloco.globals[0]], refusal))
    except ValueError as e:
        result = ("refused", replica, str(e))
    checks = [(r.op, r.wire_bytes) for r in ledger.select(tag="diloco:settings")]
    out.put(pickle.dumps((*result, checks)))
    manager.shutdown(wait=False)


def _run(cfg: dict[str, Any]) -> dict[int, tuple]:
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=10_000, heartbeat_timeout_ms=1_000)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_replica, args=(r, lighthouse.address(), cfg, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    results: dict[int, tuple] = {}
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while len(results) < 2:
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; results: {results}")
            try:
                kind, replica, value, checks = pickle.loads(out.get(timeout=1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                if dead:
                    raise AssertionError(f"replica {dead} died: {[procs[r].exitcode for r in dead]}") from None
                continue
            results[replica] = (kind, value, checks)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    return results


@pytest.mark.parametrize(("differ", "cfg", "this", "other"), [
    ("wire", {"wire": ["fp8", "int8"], "width": [8, 8]}, "'fp8'", "'int8'"),
    ("fragment shapes", {"wire": ["int4", "int4"], "width": [8, 6]}, "[[(8, 4), (8,), (2, 8), (2,)]]",
     "[[(6, 4), (6,), (2, 6), (2,)]]"),
    ("ef_decay", {"wire": ["int4", "int4"], "width": [8, 8], "ef_decay": [1.0, 0.95]}, "1.0", "0.95"),
])
def test_groups_with_other_settings_are_refused_on_every_group_naming_the_setting(
        differ: str, cfg: dict, this: str, other: str) -> None:
    results = _run({**cfg, "target": 3})
    for replica, (kind, message, checks) in results.items():
        assert kind == "refused", (replica, message)
        assert f"replica groups disagree on {differ} " in message and "refused at join" in message, message
        assert (this if replica == 0 else other) in message, message
        assert checks and all(op == "all_gather" and nbytes == 8 * 15 for op, nbytes in checks)  # 15 settings


def test_groups_with_the_same_settings_check_once_per_quorum_and_train() -> None:
    results = _run({"wire": ["int8", "int8"], "width": [8, 8], "target": 3})
    for replica, (kind, (step, _heals, _globals, refusal), checks) in results.items():
        assert kind == "done" and step == 3, (replica, step)
        assert len(checks) == 1, checks  # one quorum throughout: checked at its first sync only
        assert "averaged_model: this StreamingDiLoCo syncs through the 'ft' membership" in refusal, refusal


def test_without_init_sync_groups_must_start_equal_and_none_heals_at_step_0() -> None:
    """A manager built with ``init_sync=False`` (the trainer's): at step 0 no group heals, so groups with other
    initial weights (another seed) are refused on both, naming the weights at step 0; groups seeded alike train
    without a heal and end with equal global copies."""
    refused = _run({"wire": ["int8", "int8"], "width": [8, 8], "target": 3, "init_sync": False, "seeds": [0, 1]})
    for replica, (kind, message, _checks) in refused.items():
        assert kind == "refused", (replica, message)
        assert "replica groups disagree on the weights at step 0 (torchft init_sync off" in message, message
    same = _run({"wire": ["int8", "int8"], "width": [8, 8], "target": 3, "init_sync": False, "seeds": [5, 5]})
    (k0, (s0, h0, g0, _), _), (k1, (s1, h1, g1, _), _) = same[0], same[1]
    assert k0 == k1 == "done" and s0 == s1 == 3 and h0 == h1 == 0, (same[0][:2], same[1][:2])
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))


def test_groups_with_other_init_sync_are_refused_naming_it() -> None:
    cfg = {"wire": ["int8", "int8"], "width": [8, 8], "target": 3, "init_sync": True, "seeds": [5, 5]}
    results = _run({**cfg, "init_sync_by_replica": [True, False]})
    for replica, (kind, message, _checks) in results.items():
        assert kind == "refused" and "replica groups disagree on torchft init_sync " in message, (replica, message)
