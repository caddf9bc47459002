"""Torch's own sharded data-parallel contenders for the ``dp`` suite: ``zero``
(``ZeroRedundancyOptimizer`` over DDP) and ``fsdp2`` (``fully_shard`` per block then the root,
``reshard_after_forward=False``).

Their collectives run inside torch, not through :class:`lowband.comm.Comm`, so each reports its wire
bytes per step per rank by the ring model from the parameter sizes:

* ``zero``: DDP's gradient all-reduce ``2(N-1)/N * P * 4`` plus ZeRO's post-step parameter
  broadcasts, one per parameter from its owner, ``(N-1)/N * P * 4`` in total;
* ``fsdp2``: one all-gather of the parameters (forward; kept unsharded through backward) and one
  reduce-scatter of the gradients, each ``(N-1)/N * Ppad * 4`` where ``Ppad`` pads every
  parameter's dim 0 to a multiple of N (FSDP2's per-parameter ``Shard(0)``), plus the scalar
  all-reduce of the clipping norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from lowband.bench.dp import Batches, Contender, tensor_bytes
from lowband.comm import ring_wire_bytes
from lowband.train.config import Config
from lowband.train.env import DistEnv
from lowband.train.optimizers import adamw_param_groups
from lowband.train.trainer import build_model


def _train_step(forward: nn.Module, model: nn.Module, opt: torch.optim.Optimizer, cfg: Config,
                batches: Batches) -> Callable[[int], float]:
    """One training step of a torch-native contender: forward/backward, global-norm clip, step."""

    def step(i: int) -> float:
        x, y = batches.get(i)
        loss = forward(x, y)
        loss.backward()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return step


def _adamw_kwargs(cfg: Config) -> dict:
    o = cfg.optim
    return dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)


def build_zero(cfg: Config, env: DistEnv) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """(DDP wrapper, model, torch ``ZeroRedundancyOptimizer`` over AdamW): the ``zero`` contender of every suite."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = build_model(cfg, env.device)
    ddp = DistributedDataParallel(model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
                                  bucket_cap_mb=cfg.strategy.bucket_mb, gradient_as_bucket_view=True,
                                  broadcast_buffers=False)
    groups = adamw_param_groups(model, cfg.optim.weight_decay)
    opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                  weight_decay=groups[0]["weight_decay"], **_adamw_kwargs(cfg))
    for g in groups[1:]:
        opt.add_param_group(g)
    return ddp, model, opt


def build_fsdp2(cfg: Config, env: DistEnv) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """(model under FSDP2 ``fully_shard`` per block then the root, ``reshard_after_forward=False``; AdamW;
    bytes of the dim-0 padded parameters): the ``fsdp2`` contender of every suite."""
    from torch.distributed.fsdp import fully_shard

    model = build_model(cfg, env.device)
    n = env.world_size
    padded = sum(math.ceil(p.shape[0] / n) * n * (p.numel() // p.shape[0]) * p.element_size()
                 for p in model.parameters())
    blocks: nn.ModuleList = model.blocks  # type: ignore[assignment]
    for block in blocks:
        fully_shard(block, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    opt = torch.optim.AdamW(adamw_param_groups(model, cfg.optim.weight_decay), foreach=True, **_adamw_kwargs(cfg))
    return model, opt, padded


def zero_contender(cfg: Config, env: DistEnv, batches: Batches) -> Contender:
    ddp, model, opt = build_zero(cfg, env)
    n = env.world_size
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters())

    step = _train_step(ddp, model, opt, cfg, batches)

    def state_bytes() -> int:
        return sum(tensor_bytes(st.values()) for st in opt.optim.state.values())

    def resident() -> int:
        params = list(model.parameters())
        return tensor_bytes(params) + tensor_bytes(p.grad for p in params) + state_bytes()

    def wire() -> int:
        return ring_wire_bytes("all_reduce", n, pbytes) + ring_wire_bytes("broadcast", n, pbytes)

    return Contender("zero", step, state_bytes, resident, wire)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def fsdp2_contender(cfg: Config, env: DistEnv, batches: Batches) -> Contender:
    model, opt, padded = build_fsdp2(cfg, env)
    n = env.world_size

    step = _train_step(model, model, opt, cfg, batches)

    def state_bytes() -> int:
        return sum(tensor_bytes(_local(v) for v in st.values()) for st in opt.state.values())

    def resident() -> int:
        params = list(model.parameters())
        return (tensor_bytes(_local(p) for p in params) + tensor_bytes(_local(p.grad) for p in params
                                                                       if p.grad is not None) + state_bytes())

    def wire() -> int:
        norm = ring_wire_bytes("all_reduce", n, 4) if cfg.optim.grad_clip > 0 else 0
        return 2 * ring_wire_bytes("all_gather", n, padded) + norm

    return Contender("fsdp2", step, state_bytes, resident, wire)
