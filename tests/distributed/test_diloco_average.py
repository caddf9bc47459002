"""``StreamingDiLoCo.averaged_model()`` from a script of one's own (lowband.diloco.average): the model to keep at
the end of a run, on 3 gloo ranks = 3 replicas (a replica count whose fp32 sum of equal values rounds) and on one.

The model has a frozen weight and a float buffer that every replica holds alike, trained layers that differ, and
a fragment synced at the last step (equal everywhere) beside one with local steps since its sync. Checked: the
average against the replicas' own models segment by segment (tests/distributed/average_util.py: equal segments
bitwise, the rest the mean within an fp32 sum's rounding); only the differing segments travel (the ledger's
``average`` records), after one ``average:digests`` all-reduce of 32 bytes per segment; the live models are
untouched; ranks that do not keep it get ``None``. And on 2 replicas x 2 dp ranks with
``ShardedAdamW(param_gather="forward")`` inside: the average waits for the inner optimizer's all-gathers still in
flight (it read a replica's half-landed weights: adapter.weight off, no error).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lowband.comm import Comm, CommLedger
from lowband.diloco import StreamingDiLoCo
from lowband.diloco.average import segment_length
from lowband.testing import run_ranks
from tests.distributed.average_util import check_average


class _Adapted(nn.Module):
    """A frozen base projection and a float buffer (shared), a trained adapter and head."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 8)
        self.base.requires_grad_(False)
        self.adapter = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 3)
        self.register_buffer("scale", torch.rand(8) + 0.5)
        self.register_buffer("wide", torch.rand(1, 70_000))  # one row longer than a segment: cut in two

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.base(x) * self.scale)
        return self.head(h + self.adapter(h))


def _averaged(steps: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _Adapted()
    ledger = CommLedger()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    # two fragments (adapter, head) synced every 4 steps, one every 2: fragment 1 syncs at step 4, fragment 0
    # at step 2 and 6; after 4 steps fragment 1 is equal everywhere, fragment 0 has 2 local steps
    dl = StreamingDiLoCo(model, opt, comm=Comm(name="replica", ledger=ledger), sync_every=4,
                         fragments=[[model.adapter.weight], [model.head.weight, model.head.bias]])
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    live = {k: v.detach().clone() for k, v in model.state_dict().items()}
    start = len(ledger.records)
    avg = dl.averaged_model(keep=rank == 0)
    recs = [(r.op, r.tag, r.numel, r.wire_bytes) for r in ledger.records[start:]]
    after = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"live": live, "untouched": all(torch.equal(live[k], after[k]) for k in live), "recs": recs,
            "avg": None if avg is None else {k: v.detach().clone() for k, v in avg.state_dict().items()},
            "avg_device": None if avg is None else str(next(avg.parameters()).device)}


def test_averaged_model_of_three_replicas() -> None:
    world = 3
    out = run_ranks(_averaged, world, 4)
    lives = [o["live"] for o in out]
    avg = out[0]["avg"]
    assert out[0]["avg_device"] == "cpu" and all(o["avg"] is None for o in out[1:])
    assert all(o["untouched"] for o in out)
    assert sorted(avg) == sorted(lives[0])
    assert segment_length(lives[0]["wide"]) == 65_536  # SEGMENT_MAX_ELEMS
    for k in ("base.weight", "base.bias", "scale", "wide", "head.weight", "head.bias"):  # frozen, buffers, synced
        assert all(torch.equal(live[k], lives[0][k]) for live in lives), k
    assert not torch.equal(lives[0]["adapter.weight"], lives[1]["adapter.weight"])  # local steps since its sync
    differ = check_average(avg, lives)
    assert differ == lives[0]["adapter.weight"].numel()  # the whole adapter, nothing else
    segments = sum(-(-v.numel() // segment_length(v)) for v in lives[0].values())
    for o in out:
        assert [r[:2] for r in o["recs"]] == [("all_reduce", "average:digests"), ("all_reduce", "average")]
        digests, averages = o["recs"]
        assert digests[2] == 4 * segments and digests[3] == 2 * (world - 1) * 32 * segments // world
        assert averages[2] == differ and averages[3] == 2 * (world - 1) * 4 * differ // world


def test_averaged_model_of_one_replica_is_a_host_copy() -> None:
    out = run_ranks(_averaged, 1, 3)
    assert out[0]["recs"] == [] and out[0]["untouched"] and out[0]["avg_device"] == "cpu"
    assert all(torch.equal(out[0]["avg"][k], v) for k, v in out[0]["live"].items())


def _averaged_mid_gather() -> dict:
    """2 replicas x 2 dp ranks, ``ShardedAdamW(param_gather="forward")`` inside: ``step()`` returns with the updated
    slices' all-gathers in flight; dp rank 1 of each replica steps late, so dp rank 0 asks for the average while
    its peer's slices have not landed. Only replica 0's rank 0 keeps it: the others make no host copy (whose
    ``state_dict`` would have waited for the gathers) and read their live weights."""
    import time

    from lowband.diloco import replica_mesh
    from lowband.optim import ShardedAdamW

    mesh = replica_mesh(2)
    replica, dp_rank = mesh.coords.replica, mesh.coords.dp
    torch.manual_seed(0)
    model = _Adapted()
    opt = ShardedAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, comm=mesh.dp, module=model,
                       param_gather="forward", bucket_mb=1e-4)
    dl = StreamingDiLoCo(model, opt, comm=mesh.replica, sync_every=4,
                         fragments=[[model.adapter.weight], [model.head.weight, model.head.bias]])
    g = torch.Generator().manual_seed(100 + 10 * replica + dp_rank)
    for step in range(3):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        if step == 2 and dp_rank == 1:  # its updated slices leave 0.5 s late (after the step's own checks)
            def late(*args, gather=opt.comm.all_gather, **kwargs):  # type: ignore[no-untyped-def]
                time.sleep(0.5)
                return gather(*args, **kwargs)

            opt.comm.all_gather = late
        opt.step()
        opt.zero_grad()
    avg = dl.averaged_model(keep=replica == dp_rank == 0)  # the others read their live model only
    opt.wait_for_params()
    return {"avg": None if avg is None else {k: v.detach().clone() for k, v in avg.state_dict().items()},
            "live": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def test_averaged_model_waits_for_the_inner_optimizers_gathers() -> None:
    out = run_ranks(_averaged_mid_gather, 4)
    lives = [out[0]["live"], out[2]["live"]]  # replica 0's and replica 1's model (dp rank 0 of each)
    assert all(torch.equal(out[1]["live"][k], v) for k, v in lives[0].items())  # a replica's ranks agree
    assert not torch.equal(lives[0]["adapter.weight"], lives[1]["adapter.weight"])
    # the average of the weights after the gathers landed (replica 1's rank 0 read its live model, not a copy)
    check_average(out[0]["avg"], lives)
    assert all(o["avg"] is None for o in out[1:])
