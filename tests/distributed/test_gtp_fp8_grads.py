"""GTP with block-scaled fp8 (and int8) weight-gradient reduce-scatters (``GTPOptions(grad_wire_dtype="fp8")``,
issue 24), 2 and 4 gloo ranks.

The runtime's reduce-scatter is driven with known per-rank weight gradients (``reduce_weight_grad`` with a
``fill`` that writes them, as the layer's backward does): every rank's shard gradient is bitwise the
single-process reference (:func:`lowband.comm.codecs.reference_reduce_scatter` of the ranks' padded
gradients pre-scaled by ``1/N``, the ``mean`` grad mode, summed), and the ledger holds one ``all_to_all``
per weight with the codec's exact bytes. The trainer key ``strategy.grad_wire_dtype = "fp8"`` with the
``gtp`` strategy reaches the runtime (its gradient collectives are the codec's all-to-alls).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowband.comm import default_ledger
from lowband.comm.codecs import (
    chunk_layout,
    get_codec,
    reduce_scatter_wire_bytes,
    reference_all_reduce,
    reference_reduce_scatter,
)
from lowband.comm.ledger import ring_wire_bytes
from lowband.parallel import GTPOptions, GTPRuntime, shard_linears
from lowband.parallel.mesh import build_mesh
from lowband.testing import run_ranks

BLOCK = 16
OUT, IN = 10, 12  # 10 rows: padded to 12 on 4 ranks (3 per rank), to 10 on 2 (5 per rank)


def _dense_grad(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(40 + rank)
    return torch.randn(OUT, IN, generator=g) * torch.logspace(-3, 1, OUT).unsqueeze(1)


def _rs(name: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, OUT))
    rt = GTPRuntime(build_mesh(gtp=world).gtp, GTPOptions(grad_wire_dtype=name, grad_block_size=BLOCK))
    shard_linears(model, rt)
    gw = rt.weights[0]
    ledger = default_ledger()
    ledger.reset()
    rt.reduce_weight_grad(gw, lambda rows: rows.copy_(_dense_grad(rank)), "extra")
    rt.finalize_all()
    recs = [(r.op, r.wire_bytes) for r in ledger.records if r.tag == "gtp:rs"]
    return {"grad": gw.param.grad.clone(), "recs": recs, "padded": gw.padded_out}


@pytest.mark.parametrize(("world", "name"), [(2, "fp8"), (4, "fp8"), (2, "int8")])
def test_shard_gradient_equals_the_codec_reference(world: int, name: str) -> None:
    res = run_ranks(_rs, world, name)
    padded = res[0]["padded"]
    codec = get_codec(name, block_size=BLOCK)
    inputs = []
    for r in range(world):
        full = torch.zeros(padded, IN)
        full[:OUT] = _dense_grad(r)
        inputs.append(full.div_(world).reshape(-1))  # GTP's mean mode pre-scales the wgrad by 1/N
    ref = reference_reduce_scatter(inputs, codec, "sum")
    shard = padded // world
    for r in range(world):
        assert torch.equal(res[r]["grad"], ref[r].view(shard, IN)), r
        assert res[r]["recs"] == [("all_to_all", reduce_scatter_wire_bytes(codec, shard * IN, world))]


def test_fp8_gradients_refuse_a_bad_block_size() -> None:
    with pytest.raises(ValueError, match="grad_block_size must be a positive multiple of 4"):
        GTPOptions(grad_wire_dtype="fp8", grad_block_size=10)
    with pytest.raises(ValueError, match="grad_wire_dtype fp4 not in"):
        GTPOptions(grad_wire_dtype="fp4")


def _trainer(cfg) -> list[str]:
    from lowband.train.trainer import train

    res = train(cfg, write_run_dir=False, log=False)
    return sorted({r.op for r in res.strategy.env.ledger.records if r.tag == "gtp:rs"})


def test_trainer_key_sends_fp8_gradients(shard: str) -> None:
    from lowband.train.config import Config

    cfg = Config()
    cfg.run.world_size, cfg.run.steps, cfg.run.val_every, cfg.run.log_every, cfg.run.threads = 2, 2, 0, 1, 1
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 1, 32, 2, 16
    cfg.data.source, cfg.data.train_bin, cfg.data.batch_size = "bin", shard, 2
    cfg.strategy.name, cfg.strategy.grad_wire_dtype = "gtp", "fp8"
    assert run_ranks(_trainer, 2, cfg) == [["all_to_all"], ["all_to_all"]]


# --------------------------------------------------------------------- replicated gradients on the same wire
REP = {"lin.bias": OUT, "scale": 40, "rare": 24, "never": 8}  # numel of each replicated parameter


def _local_rep_grad(name: str, rank: int) -> torch.Tensor | None:
    """This rank's gradient of replicated parameter ``name``: ``rare`` only on rank 0, ``never`` nowhere;
    magnitudes spread over four decades so the blocks' scales differ."""
    if name == "never" or (name == "rare" and rank != 0):
        return None
    g = torch.Generator().manual_seed(100 * rank + len(name))
    return torch.randn(REP[name], generator=g) * torch.logspace(-2, 2, REP[name])


def _replicated(name: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Module()
    model.lin = nn.Linear(IN, OUT)
    for p in ("scale", "rare", "never"):
        model.register_parameter(p, nn.Parameter(torch.zeros(REP[p])))
    model.frozen = nn.Parameter(torch.zeros(5), requires_grad=False)
    rt = GTPRuntime(build_mesh(gtp=world).gtp, GTPOptions(grad_wire_dtype=name, grad_block_size=BLOCK))
    shard_linears(model, rt)
    named = dict(model.named_parameters())
    order = [n for n, p in named.items() if any(p is q for q in rt.attached_replicated()) and p.requires_grad]
    for n in order:
        g = _local_rep_grad(n, rank)
        named[n].grad = None if g is None else g.clone()
    ledger = default_ledger()
    ledger.reset()
    rt._reduce_replicated(rt.attached_replicated())
    return {"order": order,
            "grads": {n: None if named[n].grad is None else named[n].grad.clone() for n in order},
            "recs": [(r.op, r.tag, r.numel, r.wire_bytes) for r in ledger.records]}


@pytest.mark.parametrize(("world", "name"), [(2, "fp8"), (4, "fp8"), (2, "int8")])
def test_replicated_gradients_take_the_block_scaled_wire(world: int, name: str) -> None:
    """``grad_wire_dtype="fp8"``/``"int8"`` applies to the replicated parameters' all-reduce too: their
    gradients (zeros where a rank has none) are bitwise the single-process codec all-reduce of the ranks'
    concatenated gradients, the same on every rank; a parameter no rank has a gradient for keeps ``None``
    and a frozen one is left out; the used flags travel exactly in a float32 all-reduce of their own."""
    res = run_ranks(_replicated, world, name)
    order = res[0]["order"]
    assert sorted(order) == sorted(REP)  # model.parameters() order; the frozen parameter is left out
    codec = get_codec(name, block_size=BLOCK)
    inputs = []
    for r in range(world):
        parts = [_local_rep_grad(n, r) for n in order]
        inputs.append(torch.cat([torch.zeros(REP[n]) if g is None else g for n, g in zip(order, parts)]))
    ref = reference_all_reduce(inputs, codec, "avg")
    exact = torch.stack(inputs).mean(0)
    off = 0
    for n in order:
        for r in range(world):
            got = res[r]["grads"][n]
            if n == "never":
                assert got is None, r
            else:
                assert torch.equal(got, ref[off:off + REP[n]]), (n, r)
        off += REP[n]
    # the codec really was on the wire: the reduction differs from the exact mean, within the codec's bound
    assert not torch.equal(ref[:-REP["never"]], exact[:-REP["never"]])
    numel = sum(REP.values())
    chunk = chunk_layout(numel, world, codec)
    per = (world - 1) * codec.encoded_nbytes(chunk)
    enc = world * codec.encoded_nbytes(chunk)  # the records count the encoded bytes of the N chunks
    # one used flag per replicated parameter, then the GTP weight's used, read-outside-its-layer and non-finite flags
    n_flags = len(order) + 3
    assert res[0]["recs"] == [
        ("all_reduce", "gtp:replicated:flags", n_flags, ring_wire_bytes("all_reduce", world, 4 * n_flags)),
        ("all_to_all", "gtp:replicated", enc, per), ("all_gather", "gtp:replicated", enc, per)]


def _dp_trainer(cfg) -> dict:
    from lowband.train.trainer import train

    res = train(cfg, write_run_dir=False, log=False)
    recs = res.strategy.env.ledger.records
    shards = {n: p.detach().clone() for n, p in res.strategy.model.named_parameters()}
    return {"ops": sorted({(r.tag, r.op) for r in recs if r.tag in ("grad", "grad:flags", "gtp:replicated",
                                                                    "gtp:replicated:flags", "gtp:rs")}),
            "shards": shards, "loss": res.final_loss}


def test_trainer_fp8_gradients_with_data_parallel_gtp_groups(shard: str) -> None:
    """``gtp.size = 2`` on 4 ranks with ``strategy.grad_wire_dtype = "fp8"``: the data-parallel all-reduce across
    the GTP groups is block-scaled too (no longer refused), and the two data-parallel copies of every shard and
    replicated parameter stay bitwise equal (every rank decodes the same bytes)."""
    from lowband.train.config import Config

    cfg = Config()
    cfg.run.world_size, cfg.run.steps, cfg.run.val_every, cfg.run.log_every, cfg.run.threads = 4, 2, 0, 1, 1
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 1, 32, 2, 16
    cfg.data.source, cfg.data.train_bin, cfg.data.batch_size = "bin", shard, 2
    cfg.strategy.name, cfg.strategy.grad_wire_dtype, cfg.gtp.size = "gtp", "fp8", 2
    res = run_ranks(_dp_trainer, 4, cfg)
    assert res[0]["ops"] == [("grad", "all_gather"), ("grad", "all_to_all"), ("grad:flags", "all_reduce"),
                             ("gtp:replicated", "all_gather"), ("gtp:replicated", "all_to_all"),
                             ("gtp:replicated:flags", "all_reduce"), ("gtp:rs", "all_to_all")]
    for a, b in ((0, 2), (1, 3)):  # build_mesh: gtp groups {0, 1} and {2, 3}; ranks a and b hold the same shards
        assert res[a]["shards"].keys() == res[b]["shards"].keys()
        for n, t in res[a]["shards"].items():
            assert torch.equal(t, res[b]["shards"][n]), (a, b, n)
    assert all(math.isfinite(r["loss"]) for r in res)
