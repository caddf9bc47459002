"""Fault-tolerant Streaming DiLoCo with torchft 0.2.0: replica processes (one rank each) around an
in-process Lighthouse. A replica killed with SIGKILL mid-run and restarted heals from its peer and
catches up; an all-reduce that fails on every replica is rolled back and the same fragment retried;
replicas with sync_every 4 and 8 stay consistent. In every case all replicas hold identical global
copies and outer-optimizer state after every manager step they both committed."""

from __future__ import annotations

import pickle
import queue
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torchft._torchft import LighthouseServer

N_FRAGMENTS = 2
TIMEOUT_S = 150


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        return self.out(x)


def _put(out: Any, item: tuple) -> None:
    out.put(pickle.dumps(item))  # by value: torch's shared-memory tensors die with the process


def _replica(replica: int, attempt: int, lighthouse: str, cfg: dict[str, Any], out: Any) -> None:
    """One replica group of one rank: Manager + StreamingDiLoCo(TorchftMembership); trains until the
    committed step reaches ``cfg["target"]`` and reports every sync attempt on ``out``."""
    import torch.distributed as dist
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from lowband.comm import CommLedger
    from lowband.diloco import StreamingDiLoCo
    from lowband.diloco.ft import TorchftMembership

    torch.set_num_threads(1)
    torch.manual_seed(100 * replica + attempt)  # replicas (and restarts) start from different weights
    model = Net()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1,
                      use_async_quorum=False, load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"replica{replica}", store_addr="localhost", store_port=store.port, rank=0,
                      world_size=1, lighthouse_addr=lighthouse, hostname="localhost",
                      timeout=timedelta(seconds=5), quorum_timeout=timedelta(seconds=60),
                      connect_timeout=timedelta(seconds=10))
    fail_at = set(cfg.get("fail_allreduce_at", ()))
    ledger = CommLedger()

    class Membership(TorchftMembership):
        def all_reduce(self, flat, codec, tag, residual_out=None):  # type: ignore[no-untyped-def]
            handle = super().all_reduce(flat, codec, tag, residual_out=residual_out)
            step = self.manager.current_step()
            if step in fail_at:  # an all-reduce that fails on this replica, once per listed step
                fail_at.discard(step)
                self.manager.report_error(RuntimeError(f"injected all-reduce failure at step {step}"))
            return handle

    h = cfg["sync_every"][replica]
    diloco = StreamingDiLoCo(model, inner, sync_every=h, fragments=N_FRAGMENTS, delay=cfg["delay"],
                             wire=cfg.get("wire", "fp32"), membership=Membership(manager, ledger=ledger))

    def on_attempt(d: StreamingDiLoCo, frag: int, ok: bool) -> None:
        rolled_back = all(torch.equal(p, g) for p, g in zip(d.frags[frag].params, d.globals[frag]))
        _put(out, ("attempt", replica, attempt, {
            "step": d.committed, "fragment": frag, "ok": ok, "rolled_back": rolled_back,
            "healed": d.membership.contributors()[1],  # healed at this attempt's quorum: sent zeros
            "globals": [[g.clone() for g in gs] for gs in d.globals],
            "outer": [[o.state[p]["momentum_buffer"].clone() for p in o.param_groups[0]["params"]
                       if "momentum_buffer" in o.state[p]] for o in d.outer],
            "residuals": [None if r is None else r.clone() for r in d.residuals]}))

    diloco.add_attempt_callback(on_attempt)
    g = torch.Generator().manual_seed(1000 * replica + attempt)
    while diloco.committed < cfg["target"]:
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
        inner.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        if cfg.get("slow"):
            time.sleep(cfg["slow"])
    _put(out, ("done", replica, attempt, {"step": diloco.committed, "numel": [f.numel for f in diloco.frags],
                                          "records": [(r.op, r.tag, r.group, r.numel, r.wire_bytes)
                                                      for r in ledger.records]}))
    diloco.close()
    manager.shutdown(wait=False)


def _run(cfg: dict[str, Any], kill: tuple[int, int] | None = None) -> tuple[list, dict]:
    """Run 2 replica processes; with ``kill = (replica, step)`` SIGKILL that replica once it has
    committed ``step`` and start it again. Returns (attempt reports, done reports)."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=10_000,
                                  heartbeat_timeout_ms=1_000)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = {r: ctx.Process(target=_replica, args=(r, 0, lighthouse.address(), cfg, out), daemon=True)
             for r in range(2)}
    for p in procs.values():
        p.start()
    attempts: list[tuple[int, int, dict]] = []
    done: dict[int, dict] = {}
    killed = False
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while len(done) < 2:
            if time.monotonic() > deadline:
                raise AssertionError(f"ft run timed out; done={sorted(done)} attempts={len(attempts)}")
            try:
                kind, replica, attempt, info = pickle.loads(out.get(timeout=1.0))
            except queue.Empty:
                dead = [r for r, p in procs.items() if not p.is_alive() and r not in done
                        and not (killed and r == kill[0] and p.exitcode == -9)]
                if dead and all(procs[r].exitcode not in (None, 0) for r in dead):
                    codes = [procs[r].exitcode for r in dead]
                    raise AssertionError(f"replica process {dead} died: {codes}") from None
                continue
            if kind == "attempt":
                attempts.append((replica, attempt, info))
                if kill and not killed and replica == kill[0] and info["ok"] and info["step"] >= kill[1]:
                    procs[replica].kill()
                    procs[replica].join(10)
                    killed = True
                    procs[replica] = ctx.Process(target=_replica, args=(replica, 1, lighthouse.address(), cfg,
                                                                        out), daemon=True)
                    procs[replica].start()
            else:
                done[replica] = info
    finally:
        for p in procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    assert not kill or killed
    return attempts, done


def _assert_consistent(attempts: list) -> dict[int, dict[int, dict]]:
    """Committed states per (replica, step); equal across replicas at every common step."""
    by: dict[int, dict[int, dict]] = {0: {}, 1: {}}
    for replica, _attempt, info in attempts:
        if info["ok"]:
            by[replica][info["step"]] = info
    common = sorted(set(by[0]) & set(by[1]))
    assert common, "the replicas never committed a common step"
    for s in common:
        a, b = by[0][s], by[1][s]
        assert a["fragment"] == b["fragment"] == (s - 1) % N_FRAGMENTS
        for ga, gb in zip(a["globals"], b["globals"]):
            assert all(torch.equal(x, y) for x, y in zip(ga, gb)), f"global copies differ at step {s}"
        for oa, ob in zip(a["outer"], b["outer"]):
            assert len(oa) == len(ob) and all(torch.equal(x, y) for x, y in zip(oa, ob)), \
                f"outer state differs at step {s}"
    return by


@pytest.mark.parametrize("wire", ["fp32", "topk-int2"])
def test_killed_replica_rejoins_and_catches_up(wire: str) -> None:
    """fp32 (``manager.allreduce``) and a message codec with error feedback (lowband's codec over the
    Manager's process group; the healed replica's residuals restart at zero, its peer's stay)."""
    cfg = {"sync_every": [4, 4], "delay": 1, "target": 8, "wire": wire}
    attempts, done = _run(cfg, kill=(1, 2))
    assert done[0]["step"] == done[1]["step"] == 8
    by = _assert_consistent(attempts)
    restarted = {info["step"] for r, a, info in attempts if r == 1 and a == 1 and info["ok"]}
    first = min(restarted)
    assert first > 2 and restarted == set(range(first, 9))  # healed to the peer's step, then in lockstep
    assert max(by[1]) == 8 and set(by[0]) >= restarted


def test_failed_allreduce_rolls_back_and_retries_same_fragment() -> None:
    cfg = {"sync_every": [4, 4], "delay": 1, "target": 5, "fail_allreduce_at": [2]}
    attempts, done = _run(cfg)
    _assert_consistent(attempts)
    for r in range(2):
        seq = [(info["step"], info["fragment"], info["ok"]) for rr, _a, info in attempts if rr == r]
        # step counts after each attempt: the failed one stays at 2 and retries fragment 0
        assert seq[:4] == [(1, 0, True), (2, 1, True), (2, 0, False), (3, 0, True)], seq
        failed = [info for rr, _a, info in attempts if rr == r and not info["ok"]]
        assert len(failed) == 1 and failed[0]["rolled_back"]
        recs = [rec for rec in done[r]["records"] if rec[1].startswith("diloco:frag")]
        assert len(recs) == 6 and all(rec[0] == "all_reduce" and rec[2] == "ft" for rec in recs)


def test_heterogeneous_sync_every_stays_consistent() -> None:
    cfg = {"sync_every": [4, 8], "delay": 1, "target": 4}
    attempts, done = _run(cfg)
    by = _assert_consistent(attempts)
    assert set(by[0]) == set(by[1]) == {1, 2, 3, 4}
    assert done[0]["step"] == done[1]["step"] == 4
