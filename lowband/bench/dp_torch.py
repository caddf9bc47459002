"""Torch's own contenders for the ``dp`` suite: ``zero`` (``ZeroRedundancyOptimizer`` over DDP),
``fsdp2`` (``fully_shard`` per block then the root, ``reshard_after_forward=False``), and the Muon
baselines ``ddp-muon`` and ``fsdp2-muon``.

Their collectives run inside torch, not through :class:`lowband.comm.Comm`, so each reports its wire
bytes per step per rank by the ring model from the parameter sizes:

* ``zero``: DDP's gradient all-reduce ``2(N-1)/N * P * 4`` plus ZeRO's post-step parameter
  broadcasts, one per parameter from its owner, ``(N-1)/N * P * 4`` in total;
* ``fsdp2``: one all-gather of the parameters (forward; kept unsharded through backward),
  ``(N-1)/N * Ppad * 4`` where ``Ppad`` pads every parameter's dim 0 to a multiple of N (FSDP2's
  per-parameter ``Shard(0)``), and one reduce-scatter of the gradients, counted as the backend runs
  it: NCCL's native reduce-scatter moves ``(N-1)/N * Ppad * 4``; gloo has no reduce-scatter and
  torch runs ``reduce_scatter_tensor`` there as an all-reduce of the whole buffer
  (``2(N-1)/N * Ppad * 4``), as the ``link`` suite counts it; plus the scalar all-reduce of the
  clipping norm.

Muon baselines (issue 15), with :mod:`lowband.bench.torch_muon` (``torch.optim.Muon`` for the hidden
matrices, ``torch.optim.AdamW`` for the rest, ``sharded-muon``'s hyper-parameters, Newton-Schulz in
``optim.muon_ns_dtype`` resolved as ``sharded-muon`` resolves it):

* ``ddp-muon``: lowband's DDP wrapping (:func:`lowband.train.strategies.ddp.wrap_ddp`: torch DDP whose
  bucket all-reduce goes through ``lowband.comm``, so the ledger counts it); every rank orthogonalizes
  every matrix. What a user writes today.
* ``fsdp2-muon``: FSDP2 as ``fsdp2`` with ``torch.optim.Muon`` on its DTensor shards. torch accepts it
  and the math is right (tested equal to ``ddp-muon``): DTensor runs Newton-Schulz with whole-matrix
  semantics, so the norm is all-reduced and every matmul of the iteration issues the collectives its
  sharding propagation picks (all-gathers of row-sharded operands, all-reduces of partial products);
  the work of each product is split over the ranks. Those collectives are counted by
  :class:`lowband.bench.torch_muon.CollectiveBytes` on the contender's first step (a warm-up step
  when ``--warmup`` >= 1; reported as ``muon_step_collectives`` / ``muon_step_wire_bytes``) and
  added to FSDP2's own.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from lowband.bench.dp import Batches, Contender, tensor_bytes
from lowband.bench.torch_muon import CollectiveBytes, ns_dtype, torch_muon_optimizers
from lowband.comm import ring_wire_bytes
from lowband.train.config import Config
from lowband.train.env import DistEnv
from lowband.train.optimizers import adamw_param_groups
from lowband.train.trainer import build_model


def torch_step(forward: nn.Module, model: nn.Module, cfg: Config, optimizers: list[torch.optim.Optimizer],
               update: Callable[[], None] | None = None) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """``step(x, y) -> local loss`` of a torch-native contender (every suite's): forward/backward,
    global-norm clip, ``update()`` (default: ``step()`` of every optimizer), zero the gradients."""

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = forward(x, y)
        loss.backward()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip, foreach=True)
        if update is not None:
            update()
        else:
            for opt in optimizers:
                opt.step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def _train_step(forward: nn.Module, model: nn.Module, opt: torch.optim.Optimizer, cfg: Config,
                batches: Batches) -> Callable[[int], float]:
    """:func:`torch_step` over the dp suite's batches (``step(i)``)."""
    train = torch_step(forward, model, cfg, [opt])
    return lambda i: train(*batches.get(i))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 parameters, gradients, optimizer state); any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def resident_bytes(model: nn.Module, state_bytes: int) -> int:
    """Local parameter + gradient bytes of ``model`` (DTensors: their shards) plus ``state_bytes``."""
    params = list(model.parameters())
    return (tensor_bytes(local_tensor(p) for p in params)
            + tensor_bytes(local_tensor(p.grad) for p in params if p.grad is not None) + state_bytes)


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
                                  forward_sync_buffers=False)
    groups = adamw_param_groups(model, cfg.optim.weight_decay)
    opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                  weight_decay=groups[0]["weight_decay"], **_adamw_kwargs(cfg))
    for g in groups[1:]:
        opt.add_param_group(g)
    return ddp, model, opt


def shard_fsdp2(cfg: Config, env: DistEnv) -> tuple[nn.Module, int]:
    """(model under FSDP2 ``fully_shard`` per block then the root, ``reshard_after_forward=False``; bytes
    of the dim-0 padded parameters): the sharding of ``fsdp2`` and ``fsdp2-muon``."""
    from torch.distributed.fsdp import fully_shard

    model = build_model(cfg, env.device)
    n = env.world_size
    padded = sum(math.ceil(p.shape[0] / n) * n * (p.numel() // p.shape[0]) * p.element_size()
                 for p in model.parameters())
    blocks: nn.ModuleList = model.blocks  # type: ignore[assignment]
    for block in blocks:
        fully_shard(block, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    return model, padded


def build_fsdp2(cfg: Config, env: DistEnv) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """(:func:`shard_fsdp2`'s model, AdamW over it, its padded bytes): the ``fsdp2`` contender of every suite."""
    model, padded = shard_fsdp2(cfg, env)
    opt = torch.optim.AdamW(adamw_param_groups(model, cfg.optim.weight_decay), foreach=True, **_adamw_kwargs(cfg))
    return model, opt, padded


def zero_contender(cfg: Config, env: DistEnv, batches: Batches) -> Contender:
    ddp, model, opt = build_zero(cfg, env)
    n = env.world_size
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters())

    step = _train_step(ddp, model, opt, cfg, batches)

    def state_bytes() -> int:
        return sum(tensor_bytes(st.values()) for st in opt.optim.state.values())

    def wire() -> int:
        return ring_wire_bytes("all_reduce", n, pbytes) + ring_wire_bytes("broadcast", n, pbytes)

    return Contender("zero", step, state_bytes, lambda: resident_bytes(model, state_bytes()), wire)


def fsdp2_contender(cfg: Config, env: DistEnv, batches: Batches) -> Contender:
    model, opt, padded = build_fsdp2(cfg, env)
    n = env.world_size

    step = _train_step(model, model, opt, cfg, batches)

    def state_bytes() -> int:
        return sum(tensor_bytes(local_tensor(v) for v in st.values()) for st in opt.state.values())

    def wire() -> int:
        return fsdp2_wire_bytes(cfg, n, padded)

    return Contender("fsdp2", step, state_bytes, lambda: resident_bytes(model, state_bytes()), wire)


def fsdp2_reduce_op() -> str:
    """How FSDP2's gradient reduce-scatter travels: ``all_reduce`` on gloo (torch emulates
    ``reduce_scatter_tensor`` by an all-reduce), ``reduce_scatter`` on NCCL and other backends."""
    import torch.distributed as dist

    return "all_reduce" if dist.is_initialized() and dist.get_backend() == "gloo" else "reduce_scatter"


def fsdp2_wire_bytes(cfg: Config, n: int, padded: int) -> int:
    """Ring-model bytes per step per rank of ``fsdp2`` (reshard_after_forward=False): one all-gather
    of the padded parameters, the gradient reduce-scatter as the backend runs it, the clip norm."""
    norm = ring_wire_bytes("all_reduce", n, 4) if cfg.optim.grad_clip > 0 else 0
    return ring_wire_bytes("all_gather", n, padded) + ring_wire_bytes(fsdp2_reduce_op(), n, padded) + norm


def _muon_step(m_opt: torch.optim.Optimizer, a_opt: torch.optim.Optimizer, forward: nn.Module,
               model: nn.Module, cfg: Config, batches: Batches, dtype: torch.dtype,
               on_first: Callable[[Callable[[], None]], None] | None = None) -> Callable[[int], float]:
    """:func:`torch_step` of a torch Muon contender over the dp suite's batches: the update is the Muon
    step (Newton-Schulz in ``dtype``) then the AdamW step. ``on_first(run_optimizers)`` runs the first
    step's optimizer update (to count its collectives)."""
    first = [True]

    def run_optimizers() -> None:
        with ns_dtype(dtype):
            m_opt.step()
        a_opt.step()

    def update() -> None:
        if first[0] and on_first is not None:
            on_first(run_optimizers)
        else:
            run_optimizers()
        first[0] = False

    train = torch_step(forward, model, cfg, [m_opt, a_opt], update)
    return lambda i: train(*batches.get(i))


def _state_bytes(*opts: torch.optim.Optimizer) -> int:
    """Local bytes of every state tensor with at least one dimension (DTensor: the local shard)."""
    return sum(tensor_bytes(local_tensor(v) for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
               for o in opts for st in o.state.values())


def ddp_muon_contender(cfg: Config, env: DistEnv, batches: Batches) -> Contender:
    """``ddp-muon``: DDP + ``torch.optim.Muon`` (hidden matrices) + AdamW (the rest); wire from the ledger."""
    from lowband.train.strategies.ddp import wrap_ddp
    from lowband.train.strategies.sharded import muon_ns_dtype

    model = build_model(cfg, env.device)
    forward = wrap_ddp(model, env.device, env.comm, cfg) if env.world_size > 1 else model
    m_opt, a_opt = torch_muon_optimizers(model, cfg.optim)
    step = _muon_step(m_opt, a_opt, forward, model, cfg, batches, muon_ns_dtype(cfg.optim.muon_ns_dtype,
                                                                                env.device))

    return Contender("ddp-muon", step, lambda: _state_bytes(m_opt, a_opt),
                     lambda: resident_bytes(model, _state_bytes(m_opt, a_opt)), None)


def fsdp2_muon_contender(cfg: Config, env: DistEnv, batches: Batches) -> Contender:
    """``fsdp2-muon``: ``fsdp2``'s sharding with ``torch.optim.Muon`` on the DTensor shards + AdamW."""
    from lowband.train.strategies.sharded import muon_ns_dtype

    model, padded = shard_fsdp2(cfg, env)
    n = env.world_size
    m_opt, a_opt = torch_muon_optimizers(model, cfg.optim)
    counted: dict[str, int] = {}

    def count(run_optimizers: Callable[[], None]) -> None:
        mode = CollectiveBytes()
        with mode:
            run_optimizers()
        counted["wire"] = mode.wire_bytes
        counted.update({f"muon_{k}": v for k, v in mode.counts.items()})

    step = _muon_step(m_opt, a_opt, model, model, cfg, batches,
                      muon_ns_dtype(cfg.optim.muon_ns_dtype, env.device), on_first=count)

    def wire() -> int:
        return fsdp2_wire_bytes(cfg, n, padded) + counted.get("wire", 0)

    c = Contender("fsdp2-muon", step, lambda: _state_bytes(m_opt, a_opt),
                  lambda: resident_bytes(model, _state_bytes(m_opt, a_opt)), wire)
    c.extra = lambda: {"muon_step_collectives": {k[5:]: v for k, v in counted.items() if k.startswith("muon_")},
                       "muon_step_wire_bytes": counted.get("wire", 0)}
    return c
