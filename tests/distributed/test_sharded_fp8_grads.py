"""ShardedAdamW / ShardedMuon with block-scaled fp8 (and int8) gradients on the wire
(``grad_wire_dtype="fp8"``, issue 24), 2 and 4 gloo ranks.

Against the single-process reference of the codec reduce-scatter
(:func:`lowband.comm.codecs.reference_reduce_scatter`): every unit's reduced gradient shard, the one the
update reads, is bitwise what the reference computes from the ranks' local flat gradients (the same
encode, decode and fp32 sums in rank order), and the ledger holds one ``all_to_all`` per unit with the
exact encoded bytes. The update itself is the fp32 path's code on that shard (tests/distributed and
tests/external check it against torch). A GradScaler overflow still skips on every rank (inf/NaN
survives the codec: a block holding one decodes non-finite).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowband.comm import Comm, default_ledger
from lowband.comm.codecs import get_codec, reduce_scatter_wire_bytes, reference_reduce_scatter
from lowband.optim import ShardedAdamW, ShardedMuon
from lowband.testing import run_ranks

BLOCK = 32


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 24), nn.Tanh(), nn.Linear(24, 5))


def _run(algo: str, name: str, scaler_inf: bool = False) -> dict:
    rank = dist.get_rank()
    model = _model()
    if algo == "adamw":
        opt = ShardedAdamW(model.parameters(), lr=1e-2, comm=Comm(), bucket_mb=2e-3, grad_wire_dtype=name,
                           grad_block_size=BLOCK)
    else:
        mats = [p for p in model.parameters() if p.dim() == 2]
        rest = [p for p in model.parameters() if p.dim() != 2]
        opt = ShardedMuon(mats, rest, lr=0.02, comm=Comm(), bucket_mb=2e-3, grad_wire_dtype=name,
                          grad_block_size=BLOCK, ns_dtype=torch.float32)
    ledger = default_ledger()
    ledger.reset()
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(8, 12, generator=g) * (1 + rank)
    loss = model(x).square().mean()
    scaler = torch.amp.GradScaler("cpu") if scaler_inf else None
    if scaler is not None:
        loss = scaler.scale(loss * (float("inf") if rank == 1 else 1.0))
    loss.backward()
    local = [u.grad_buf.clone() for u in opt._units]
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
        return {"scale": float(scaler.get_scale())}
    opt.step()
    gathered = []
    for buf in local:
        parts = [torch.empty_like(buf) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, buf)  # test bookkeeping, outside the ledger
        gathered.append(parts)
    recs = [(r.op, r.tag, r.wire_bytes) for r in ledger.records if r.tag.startswith("grad:")]
    return {"shards": [u.grad_shard.clone() for u in opt._units], "gathered": gathered, "recs": recs,
            "sizes": [u.layout.shard_numel for u in opt._units]}


@pytest.mark.parametrize(("world", "algo", "name"), [(2, "adamw", "fp8"), (4, "adamw", "fp8"),
                                                     (2, "muon", "fp8"), (2, "adamw", "int8")])
def test_reduced_shards_equal_the_codec_reference(world: int, algo: str, name: str) -> None:
    res = run_ranks(_run, world, algo, name)
    codec = get_codec(name, block_size=BLOCK)
    units = len(res[0]["shards"])
    assert units >= 2  # several units (bucket_mb is tiny): each is reduced on its own
    for ui in range(units):
        ref = reference_reduce_scatter(res[0]["gathered"][ui], codec, "avg", out_dtype=torch.float32)
        for r in range(world):
            assert torch.equal(res[r]["shards"][ui], ref[r]), (ui, r)
    for r in range(world):
        assert [op for op, _, _ in res[r]["recs"]] == ["all_to_all"] * units
        assert [b for _, _, b in res[r]["recs"]] == [reduce_scatter_wire_bytes(codec, n, world)
                                                   for n in res[r]["sizes"]]


def test_grad_scaler_overflow_skips_on_every_rank() -> None:
    res = run_ranks(_run, 2, "adamw", "fp8", True)
    assert [r["scale"] for r in res] == [2.0**15, 2.0**15]


def test_bad_block_size_is_refused() -> None:
    with pytest.raises(ValueError, match="grad_block_size must be a positive multiple of 4"):
        ShardedAdamW(_model().parameters(), grad_wire_dtype="fp8", grad_block_size=6)


def _trainer(cfg) -> dict:
    from lowband.train.trainer import train

    res = train(cfg, write_run_dir=False, log=False)
    recs = res.strategy.env.ledger.records
    return {"ops": sorted({r.op for r in recs if r.tag.startswith("grad:")})}


def test_trainer_key_sends_fp8_gradients(shard: str) -> None:
    """``strategy.grad_wire_dtype = "fp8"`` reaches the optimizer: the trainer's gradient collectives are
    the codec's all-to-alls, never a reduce-scatter."""
    from lowband.train.config import Config

    cfg = Config()
    cfg.run.world_size, cfg.run.steps, cfg.run.val_every, cfg.run.log_every, cfg.run.threads = 2, 2, 0, 1, 1
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 1, 32, 2, 16
    cfg.data.source, cfg.data.train_bin, cfg.data.batch_size = "bin", shard, 2
    cfg.strategy.name, cfg.strategy.grad_wire_dtype = "sharded-adamw", "fp8"
    res = run_ranks(_trainer, 2, cfg)
    assert all(r["ops"] == ["all_to_all"] for r in res), res
