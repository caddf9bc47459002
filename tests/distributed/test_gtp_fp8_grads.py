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

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowband.comm import default_ledger
from lowband.comm.codecs import get_codec, reduce_scatter_wire_bytes, reference_reduce_scatter
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
