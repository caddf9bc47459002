"""Every DiLoCo wire codec in fault-tolerant mode (torchft 0.2.0): replica processes (one rank each,
Manager + ProcessGroupGloo) around an in-process Lighthouse.

* collective level: ``TorchftMembership.all_reduce`` with ``int8``, ``int4``, ``int2``, ``topk`` and
  ``topk-int2`` over 2 and 3 replicas equals ``reference_wire_all_reduce`` of the inputs in
  participating-rank order, bitwise, on every replica; ``residual_out`` is the sender's own encoding
  error; the ledger bytes are ``wire_bytes_per_rank``;
* a membership change (3 replicas, one SIGKILLed, the next quorum has 2): the n=2 reduction;
* injected failures (``report_error`` before or during the collective): ``should_commit()`` False on
  the errored replicas, no exception, no hang, outputs zero (never decoded from garbage); a peer
  whose collective completed commits (torchft's vote is per replica group); the next step works again;
* end to end: StreamingDiLoCo with ``topk-int2`` and error feedback, one failed all-reduce: the
  rolled-back fragment's residual is kept, and the replicas' global copies are bitwise equal at every
  common committed step.
"""

from __future__ import annotations

import pickle
import queue
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torchft._torchft import LighthouseServer  # the ft extra: scripts/setup.sh installs it

from lowband.comm.codecs import (
    Codec,
    get_wire,
    reference_wire_all_reduce,
    sender_roundtrip,
    wire_bytes_per_rank,
)
from tests.distributed.test_diloco_ft import N_FRAGMENTS, _put, _run

CODECS = ("int8", "int4", "int2", "topk", "topk-int2")
NUMEL = 1000  # not a multiple of any block or chunk: padding is exercised
TIMEOUT_S = 150


def _manager(replica: int, lighthouse: str, state_dict: Any, load_state_dict: Any, init_sync: bool = True) -> Any:
    import torch.distributed as dist
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=20)), min_replica_size=1,
                      use_async_quorum=False, load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"replica{replica}", store_addr="localhost", store_port=store.port, rank=0,
                      world_size=1, lighthouse_addr=lighthouse, hostname="localhost",
                      timeout=timedelta(seconds=20), quorum_timeout=timedelta(seconds=60),
                      connect_timeout=timedelta(seconds=20), init_sync=init_sync)
    manager._lowband_store = store  # keep the store alive as long as the manager
    return manager


def _inputs(replica: int, rnd: int, idx: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * replica + 100 * rnd + idx)
    return torch.randn(NUMEL, generator=g) * (1.0 + idx)


# ------------------------------------------------------------------------- collective level
def _coll_replica(replica: int, lighthouse: str, rounds: list[dict], gates: list, out: Any,
                  init_sync: bool) -> None:
    """Per round: wait for its gate (if any), quorum, one ``all_reduce`` per codec (all issued, then
    polled in order up to the first not advanced, then waited in order), optional injected ``report_error``,
    ``should_commit``; report it all (with the quorum's up-to-date count and whether this replica healed)."""
    from lowband.comm import CommLedger
    from lowband.diloco.ft import TorchftMembership

    torch.set_num_threads(1)
    manager = _manager(replica, lighthouse, lambda: {"w": torch.zeros(1)}, lambda sd: None, init_sync=init_sync)
    ledger = CommLedger()
    membership = TorchftMembership(manager, ledger=ledger)
    _put(out, ("ready", replica, -1, {}))
    for rnd, spec in enumerate(rounds):
        while replica in spec.get("victims", ()):  # SIGKILLed by the parent (never waits on a shared
            time.sleep(0.05)  # Event: a killed waiter would block the parent's Event.set() for ever)
        if spec.get("gate") is not None:
            gates[spec["gate"]].wait()
        manager.start_quorum()
        rank, n = manager.participating_rank(), manager.num_participants()
        up, healed = membership.contributors()
        inject = replica in spec.get("inject_on", ()) and spec.get("inject")
        if inject == "before":
            manager.report_error(RuntimeError("injected failure before the collective"))
        items = []
        for idx, name in enumerate(spec["codecs"]):
            codec = get_wire(name)
            x = _inputs(replica, rnd, idx)
            flat, res = x.clone(), torch.empty_like(x)
            h = membership.all_reduce(flat, codec, f"r{rnd}:{name}", residual_out=res)
            items.append((name, x, flat, res, h))
        if inject == "during":
            manager.report_error(RuntimeError("injected failure during the collective"))
        for *_, h in items:  # in order, stopping at the first not advanced, as StreamingDiLoCo polls: a later
            if not h.poll():  # handle's phase 1 may finish first (gloo's worker threads), and issuing its phase 2
                break  # before an earlier one's would pair different collectives across replicas
        results = {}
        for name, x, flat, res, h in items:
            raised = None
            try:
                h.wait()
            except Exception as e:  # must not happen: reported as a failure by the parent
                raised = f"{type(e).__name__}: {e}"
            recs = [(r.op, r.group, r.group_size, r.numel, r.wire_dtype, r.wire_bytes, r.algorithm)
                    for r in ledger.select(tag=f"r{rnd}:{name}")]
            results[name] = {"input": x, "result": flat.clone(), "residual": res.clone(), "raised": raised,
                             "records": recs}
        exact = None
        if spec.get("fp32"):  # manager.allreduce; integer values: any summation order gives the same sum
            x = torch.randint(-1000, 1000, (NUMEL,), generator=torch.Generator().manual_seed(7 * replica + rnd))
            flat = x.float()
            membership.all_reduce(flat, get_wire("fp32"), f"r{rnd}:fp32").wait()
            exact = {"input": x.float(), "result": flat.clone()}
        ok = bool(manager.should_commit())
        _put(out, ("round", replica, rnd, {"rank": rank, "n": n, "ok": ok, "results": results, "up": up,
                                           "healed": healed, "fp32": exact}))
    _put(out, ("done", replica, -1, {}))
    manager.shutdown(wait=False)


def _drive(nrep: int, rounds: list[dict], kill: tuple[int, int] | None = None,
           init_sync: bool = False) -> dict[int, dict[int, dict]]:
    """Run ``nrep`` collective-level replicas; gate 0 opens once all are ready (so the first quorum
    has all of them); with ``kill = (replica, gate)`` that replica is SIGKILLed once every replica has
    reported the round before ``gate`` opens, then the gate opens. ``init_sync``: torchft's (every
    replica but the first heals at step 0). Returns {round: {replica: info}}."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=30_000,
                                  heartbeat_timeout_ms=1_000)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    gates = [ctx.Event() for _ in range(2)]
    procs = {r: ctx.Process(target=_coll_replica, args=(r, lighthouse.address(), rounds, gates, out, init_sync),
                             daemon=True)
             for r in range(nrep)}
    for p in procs.values():
        p.start()
    ready: set[int] = set()
    done: set[int] = set()
    by: dict[int, dict[int, dict]] = {}
    killed = False
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while len(done) < nrep - (1 if kill else 0):
            if time.monotonic() > deadline:
                raise AssertionError(f"ft collective run timed out; ready={sorted(ready)} done={sorted(done)} "
                                     f"rounds={ {k: sorted(v) for k, v in by.items()} }")
            try:
                kind, replica, rnd, info = pickle.loads(out.get(timeout=1.0))
            except queue.Empty:
                dead = [r for r, p in procs.items() if not p.is_alive() and r not in done
                        and not (killed and r == kill[0]) and p.exitcode != 0]
                if dead:
                    raise AssertionError(f"replica process {dead} died: {[procs[r].exitcode for r in dead]}") \
                        from None
                continue
            if kind == "ready":
                ready.add(replica)
                if len(ready) == nrep:
                    gates[0].set()
            elif kind == "round":
                by.setdefault(rnd, {})[replica] = info
                if kill and not killed and rnd == kill[1] - 1 and len(by[rnd]) == nrep:
                    procs[kill[0]].kill()
                    procs[kill[0]].join(10)
                    killed = True
                    gates[kill[1]].set()
            else:
                done.add(replica)
    finally:
        for p in procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    assert not kill or killed
    return by


def _check_round(infos: dict[int, dict], n: int, healed: set[int] = frozenset()) -> None:
    """Every replica committed, saw ``n`` participants with distinct ranks, the replicas in ``healed``
    (and only they) healed at the quorum, and every replica got the reference: the healed replicas' inputs
    replaced by zeros, the sum divided by the up-to-date ones."""
    assert len(infos) == n and all(i["ok"] and i["n"] == n for i in infos.values()), \
        {r: (i["ok"], i["n"], i["rank"]) for r, i in infos.items()}
    order = sorted(infos, key=lambda r: infos[r]["rank"])
    assert [infos[r]["rank"] for r in order] == list(range(n))
    assert {r for r in infos if infos[r]["healed"]} == set(healed)
    up = n - len(healed)
    assert all(i["up"] == up for i in infos.values()), {r: i["up"] for r, i in infos.items()}
    for name in infos[order[0]]["results"]:
        codec = get_wire(name)
        inputs = [torch.zeros_like(infos[r]["results"][name]["input"]) if r in healed
                  else infos[r]["results"][name]["input"] for r in order]
        ref = reference_wire_all_reduce(inputs, codec, avg_over=up)
        for r in order:
            res = infos[r]["results"][name]
            assert res["raised"] is None, res["raised"]
            assert torch.equal(res["result"], ref), f"{name}: replica {r} differs from the reference (n={n})"
            x = torch.zeros_like(res["input"]) if r in healed else res["input"]
            assert torch.equal(res["residual"], x - sender_roundtrip(codec, x, n)), f"{name}: residual"
            recs = res["records"]
            ops = ["all_to_all", "all_gather"] if isinstance(codec, Codec) else ["all_gather"]
            assert [rec[0] for rec in recs] == ops, recs
            assert all(rec[1] == "ft" and rec[2] == n and rec[4] == "uint8" and rec[6] == "torchft"
                       for rec in recs), recs
            assert sum(rec[5] for rec in recs) == wire_bytes_per_rank(codec, NUMEL, n), (name, recs)
        assert not torch.equal(ref, inputs[0])  # lossy: the test would notice a plain copy
    if infos[order[0]]["fp32"] is not None:  # fp32 wire (manager.allreduce): exact sums of integers
        ref = sum(infos[r]["fp32"]["input"] for r in order if r not in healed) / up
        for r in order:
            assert torch.equal(infos[r]["fp32"]["result"], ref), f"fp32: replica {r} (n={n}, U={up})"


@pytest.fixture(scope="module")
def two_replica_rounds() -> dict[int, dict[int, dict]]:
    rounds = [
        {"gate": 0, "codecs": CODECS},
        {"codecs": ("int8", "topk-int2"), "inject": "before", "inject_on": (0, 1)},
        {"codecs": ("int8", "int4"), "inject": "during", "inject_on": (0, 1)},
        {"codecs": ("topk",), "inject": "during", "inject_on": (1,)},
        {"codecs": (*CODECS, "bf16", "fp8", "topk-int4")},  # and the remaining lossy wires
    ]
    return _drive(2, rounds)


def test_codecs_match_reference_two_replicas(two_replica_rounds: dict) -> None:
    _check_round(two_replica_rounds[0], 2)
    # after three failed steps everything works again; replica 1 missed round 3's commit, so it heals from
    # replica 0 at round 4's quorum and sends zeros: the result is replica 0's contribution alone
    _check_round(two_replica_rounds[4], 2, healed={1})


def test_injected_failure_is_not_committed_and_never_decodes_garbage(two_replica_rounds: dict) -> None:
    for rnd in (1, 2, 3):
        infos = two_replica_rounds[rnd]
        assert len(infos) == 2
        for replica, info in infos.items():
            errored = rnd < 3 or replica == 1
            # should_commit is a vote of this replica group's own ranks: the errored replica does not
            # commit (it heals from its peer at a later quorum), the peer whose collective completed does
            assert info["n"] == 2 and info["ok"] is not errored, (rnd, replica, info["ok"])
            for name, res in info["results"].items():
                assert res["raised"] is None, (rnd, name, res["raised"])
                if errored:  # outputs zeroed, decoded as zeros (never from garbage)
                    assert bool((res["result"] == 0).all()), (rnd, replica, name)
                else:  # the peer's collective completed normally
                    ref = reference_wire_all_reduce(
                        [infos[r]["results"][name]["input"] for r in sorted(infos, key=lambda r: infos[r]["rank"])],
                        get_wire(name))
                    assert torch.equal(res["result"], ref)


def test_healed_replicas_send_zeros_and_the_rest_average() -> None:
    """A replica healed at a quorum holds its source's weights: its pseudo-gradient would count the source's
    work twice. With torchft's ``init_sync`` every replica but the first heals at step 0 (U = 1); a replica
    that missed a commit heals at the next quorum (U = 2 of 3). Every replica gets, bitwise, the reference
    with the healed inputs zeroed and the sum divided by U; a healed replica's residual is zero."""
    rounds = [{"gate": 0, "codecs": CODECS, "fp32": True},
              {"codecs": ("topk", "topk-int2"), "inject": "during", "inject_on": (2,)},  # one phase each
              {"codecs": CODECS, "fp32": True}]
    by = _drive(3, rounds, init_sync=True)
    assert len(by[0]) == 3 and sum(i["healed"] for i in by[0].values()) == 2
    _check_round(by[0], 3, healed={r for r, i in by[0].items() if i["healed"]})
    assert not any(i["healed"] for i in by[1].values()) and [by[1][r]["ok"] for r in range(3)] == [True, True, False], \
        {r: (i["ok"], i["healed"], i["up"]) for r, i in by[1].items()}
    _check_round(by[2], 3, healed={2})


def test_codecs_three_replicas_then_one_killed() -> None:
    rounds = [{"gate": 0, "codecs": CODECS}, {"gate": 1, "codecs": CODECS, "victims": (2,)}]
    by = _drive(3, rounds, kill=(2, 1))
    _check_round(by[0], 3)
    assert set(by[1]) == {0, 1}
    _check_round(by[1], 2)  # the next quorum has the 2 survivors: their n=2 reduction, bitwise


# ----------------------------------------------------------------------- StreamingDiLoCo e2e
def test_streaming_diloco_topk_int2_rollback_keeps_residual() -> None:
    """test_diloco_ft's replica driver (Net, AdamW inner, 2 fragments) with the ``topk-int2`` wire, error
    feedback on (its default for message codecs), one all-reduce failure injected on both replicas."""
    cfg = {"sync_every": [4, 4], "delay": 1, "target": 5, "wire": "topk-int2", "fail_allreduce_at": [2]}
    runs, done = _run(cfg)
    attempts = [(replica, info) for replica, _attempt, info in runs]
    by: dict[int, dict[int, dict]] = {0: {}, 1: {}}
    for replica, info in attempts:
        if info["ok"]:
            by[replica][info["step"]] = info
    common = sorted(set(by[0]) & set(by[1]))
    assert common == [1, 2, 3, 4, 5], common
    for s in common:  # bitwise equal global copies at every common committed step
        a, b = by[0][s], by[1][s]
        assert a["fragment"] == b["fragment"] == (s - 1) % N_FRAGMENTS
        for ga, gb in zip(a["globals"], b["globals"]):
            assert all(torch.equal(x, y) for x, y in zip(ga, gb)), f"global copies differ at step {s}"
    codec = get_wire("topk-int2")
    # torchft's init_sync: at step 0 the replica that is not the quorum's first heals from it and sends zeros
    assert sorted(next(info["healed"] for rr, info in attempts if rr == r) for r in range(2)) == [False, True]
    for r in range(2):
        mine = [info for rr, info in attempts if rr == r]
        seq = [(i["step"], i["fragment"], i["ok"]) for i in mine]
        assert seq[:4] == [(1, 0, True), (2, 1, True), (2, 0, False), (3, 0, True)], seq
        before, failed, retried = mine[1], mine[2], mine[3]
        assert failed["rolled_back"]
        # error feedback holds dropped mass; a replica that sent zeros has none
        assert bool(before["residuals"][0].abs().sum() > 0) is not mine[0]["healed"]
        for ra, rb in zip(before["residuals"], failed["residuals"]):
            assert torch.equal(ra, rb)  # rollback keeps every residual, the failed fragment's included
        assert not torch.equal(retried["residuals"][0], failed["residuals"][0])  # the retry commits a new one
        assert torch.equal(retried["residuals"][1], failed["residuals"][1])
        recs = [rec for rec in done[r]["records"] if rec[1].startswith("diloco:frag")]
        assert len(recs) == len(mine)  # one all-gather per attempt (one bucket per fragment)
        for op, tag, group, _numel, nbytes in recs:
            frag = int(tag.removeprefix("diloco:frag"))
            assert op == "all_gather" and group == "ft"
            assert nbytes == wire_bytes_per_rank(codec, done[r]["numel"][frag], 2)
