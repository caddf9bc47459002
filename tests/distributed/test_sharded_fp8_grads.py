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
    residuals = res.strategy.optimizer._residuals
    return {"ops": sorted({r.op for r in recs if r.tag.startswith("grad:")}),
            "residuals": len(residuals), "nonzero": sum(bool(r.any()) for r in residuals.values())}


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
    assert all(r["residuals"] == 0 for r in res)
    cfg.sharded.grad_error_feedback = True  # sharded.grad_error_feedback reaches the optimizer
    res = run_ranks(_trainer, 2, cfg)
    assert all(r["ops"] == ["all_to_all"] and r["residuals"] >= 1 and r["nonzero"] == r["residuals"] for r in res)


def test_error_feedback_key_needs_fp8_gradients() -> None:
    from lowband.train.config import Config, ConfigError
    from lowband.train.strategies import get_strategy_class

    cfg = Config()
    cfg.strategy.name, cfg.sharded.grad_error_feedback = "sharded-adamw", True
    msg = r"sharded\.grad_error_feedback = true needs strategy\.grad_wire_dtype = 'fp8'"
    with pytest.raises(ConfigError, match=msg):
        get_strategy_class("sharded-adamw").validate_config(cfg, 2)
    cfg.strategy.grad_wire_dtype = "fp8"
    get_strategy_class("sharded-adamw").validate_config(cfg, 2)


# ----------------------------------------------------------------------------------- error feedback
class _Branchy(nn.Module):
    """Three layers always used and ``aux``, used per the schedule (conditionally used parameters)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b, self.c = nn.Linear(12, 40), nn.Linear(40, 24), nn.Linear(24, 5)
        self.aux = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        y = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return y + self.aux(x) if use_aux else y


# aux: used on every rank, on rank 0 only, on no rank, then on every rank again
_AUX = [lambda r: True, lambda r: r == 0, lambda r: False, lambda r: True]


def _run_ef(algo: str) -> dict:
    rank = dist.get_rank()
    model = _Branchy()
    kw = dict(comm=Comm(), bucket_mb=2e-3, grad_wire_dtype="fp8", grad_block_size=BLOCK, grad_error_feedback=True)
    if algo == "adamw":
        opt = ShardedAdamW(model.parameters(), lr=1e-2, **kw)
    else:
        mats = [p for p in model.parameters() if p.dim() == 2]
        opt = ShardedMuon(mats, [p for p in model.parameters() if p.dim() != 2], lr=0.02,
                          ns_dtype=torch.float32, **kw)
    g = torch.Generator().manual_seed(100 + rank)
    steps = []
    for use in _AUX:
        x = torch.randn(8, 12, generator=g) * (1 + rank)
        model(x, use(rank)).square().mean().backward()
        has = [[p.grad is not None for p in u.params] for u in opt._units]
        opt.step()
        opt.zero_grad()
        steps.append({"has": has, "sent": [u.grad_buf.clone() for u in opt._units],
                      "shards": [u.grad_shard.clone() for u in opt._units],
                      "residuals": [opt._residuals[ui].clone() for ui in range(len(opt._units))]})
    aux_w = model.aux.weight.detach().clone()
    # a discarded step keeps the residual; a load restarts it at zero
    model(torch.randn(8, 12, generator=g), True).square().mean().backward()
    opt.discard_step()
    kept = all(torch.equal(opt._residuals[ui], steps[-1]["residuals"][ui]) for ui in opt._residuals)
    opt.load_state_dict(opt.state_dict())
    zeroed = all(not r.any() for r in opt._residuals.values())
    members = [[m.offset for m in u.layout.members] for u in opt._units]
    numels = [[m.numel for m in u.layout.members] for u in opt._units]
    return {"steps": steps, "kept": kept, "zeroed": zeroed, "members": members, "numels": numels,
            "aux_w": aux_w, "buffer_bytes": opt.buffer_bytes(),
            "plain_bytes": sum(u.grad_buf.numel() * 4 + u.grad_shard.numel() * 4 for u in opt._units)}


def _decoded(x: torch.Tensor, n: int, codec) -> torch.Tensor:
    """What the owners decode of one rank's reduce-scatter input (chunks padded and encoded apart)."""
    from lowband.comm.codecs import chunk_layout

    shard = x.numel() // n
    chunk = chunk_layout(shard, 1, codec)
    padded = torch.zeros(n, chunk, dtype=x.dtype)
    padded[:, :shard] = x.view(n, shard)
    return codec.decode(codec.encode(padded), chunk, torch.float32)[:, :shard].reshape(-1)


@pytest.mark.parametrize(("world", "algo"), [(2, "adamw"), (4, "adamw"), (2, "muon")])
def test_error_feedback_against_a_single_process_simulation(world: int, algo: str) -> None:
    """Every step, every rank sends ``gradient + residual`` on the members it has a gradient for, the owners'
    shards are bitwise the codec reference of those inputs, and each residual is bitwise ``sent - decoded``
    on those members and unchanged on the others (a parameter no rank used keeps its residual and its
    weights). Over all steps the telescoping sum holds: sum of the reduced gradients + the mean residual
    = sum of the exact mean gradients, to fp32 rounding."""
    res = run_ranks(_run_ef, world, algo)
    codec = get_codec("fp8", block_size=BLOCK)
    units = len(res[0]["members"])
    assert units >= 2
    residual = [[torch.zeros_like(res[0]["steps"][0]["sent"][ui]) for ui in range(units)] for _ in range(world)]
    exact_sum = [torch.zeros_like(res[0]["steps"][0]["sent"][ui]) for ui in range(units)]
    reduced_sum = [torch.zeros_like(exact_sum[ui]) for ui in range(units)]
    any_untouched = False
    for s, _use in enumerate(_AUX):
        for ui in range(units):
            inputs = []
            for r in range(world):
                st = res[r]["steps"][s]
                x = st["sent"][ui].clone()
                for mi, (off, num) in enumerate(zip(res[r]["members"][ui], res[r]["numels"][ui])):
                    if st["has"][ui][mi]:
                        x[off:off + num] += residual[r][ui][off:off + num]
                    else:
                        assert not st["sent"][ui][off:off + num].any()
                        any_untouched = True
                inputs.append(x)
            ref = reference_reduce_scatter(inputs, codec, "avg", out_dtype=torch.float32)
            for r in range(world):
                assert torch.equal(res[r]["steps"][s]["shards"][ui], ref[r]), (s, ui, r)
                err = inputs[r] - _decoded(inputs[r], world, codec)
                st = res[r]["steps"][s]
                for mi, (off, num) in enumerate(zip(res[r]["members"][ui], res[r]["numels"][ui])):
                    if st["has"][ui][mi]:
                        residual[r][ui][off:off + num] = err[off:off + num]
                assert torch.equal(st["residuals"][ui], residual[r][ui]), (s, ui, r)
            exact_sum[ui] += sum(res[r]["steps"][s]["sent"][ui] for r in range(world)) / world
            reduced_sum[ui] += torch.cat(ref)[:exact_sum[ui].numel()]
    assert any_untouched
    for ui in range(units):
        mean_res = sum(residual[r][ui] for r in range(world)) / world
        # each side is a handful of fp32 sums of O(1) values: rounding ~ 1e-6 of the largest magnitude
        scale = max(float(exact_sum[ui].abs().max()), 1.0)
        torch.testing.assert_close(reduced_sum[ui] + mean_res, exact_sum[ui], rtol=0, atol=1e-5 * scale)
    for r in range(world):
        assert res[r]["kept"] and res[r]["zeroed"]
        assert res[r]["buffer_bytes"] == res[r]["plain_bytes"] + sum(
            res[r]["steps"][0]["sent"][ui].numel() * 4 for ui in range(units))
        assert torch.equal(res[r]["aux_w"], res[0]["aux_w"])


def test_error_feedback_refusals() -> None:
    with pytest.raises(ValueError, match="grad_error_feedback needs a block-scaled gradient wire"):
        ShardedAdamW(_model().parameters(), grad_wire_dtype="bf16", grad_error_feedback=True)
    model = _model()
    opt = ShardedAdamW(model.parameters(), grad_wire_dtype="fp8", grad_error_feedback=True)
    model(torch.randn(2, 12)).sum().backward()
    with pytest.raises(ValueError, match=r"grad_error_feedback cannot be used with torch\.amp\.GradScaler"):
        opt.step(grad_scaler=torch.amp.GradScaler("cpu"))
