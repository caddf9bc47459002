"""``torch.optim.Muon`` as the bench suites' Muon baseline: what a user writes today.

* :func:`torch_muon_optimizers`: ``torch.optim.Muon`` for the hidden matrices
  (:func:`lowband.plan.muon_split` with the model's plan) and ``torch.optim.AdamW`` for the rest, with
  the hyper-parameters of lowband's ``sharded-muon`` (``optim.muon_lr``, ``optim.muon_momentum``,
  Nesterov, NS5 coefficients 3.4445/-4.7750/2.0315, 5 steps, ``adjust_lr_fn="original"`` =
  ``sqrt(max(1, rows/cols))``, the same shape scale as :func:`lowband.optim.muon.muon_shape_scale`;
  decoupled weight decay ``optim.weight_decay``). Polar Express has no ``torch.optim.Muon`` form
  (one coefficient triple for every iteration), so it is refused.
* :func:`ns_dtype`: ``torch.optim.Muon`` has no dtype knob: its ``_zeropower_via_newtonschulz`` always
  casts to bfloat16. lowband's ``sharded-muon`` runs Newton-Schulz in fp32 on CPU (``muon_ns_dtype =
  "auto"``), where bf16 matmuls are emulated and several times slower, so an unchanged torch Muon would
  lose on CPU for the dtype alone. Inside ``with ns_dtype(torch.float32):`` torch's Newton-Schulz is
  replaced, for the duration of the step only, by :func:`zeropower_in` — torch's own function with the
  bf16 cast replaced by a cast to the given dtype (same addmm iteration, same ``clamp(norm, eps)``
  normalization). ``ns_dtype(torch.bfloat16)`` leaves torch untouched.
* :class:`CollectiveBytes`: a dispatch mode that counts the ring-model wire bytes of the functional
  collectives a DTensor computation issues (FSDP2 + Muon: Newton-Schulz on DTensor shards).

Communication: none of its own; DDP's and FSDP2's collectives are counted by the contenders.
State: ``torch.optim.Muon`` keeps one momentum buffer per matrix (parameter shape, every rank, or the
local shard under FSDP2); AdamW two moments per remaining parameter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lowband.comm import ring_wire_bytes
from lowband.optim.muon import NS5_COEFFICIENTS
from lowband.plan import muon_split, plan_for
from lowband.train.config import OptimConfig
from lowband.train.optimizers import adamw_param_groups


def zeropower_in(dtype: torch.dtype):
    """torch 2.13's ``torch.optim._muon._zeropower_via_newtonschulz`` with its ``grad.bfloat16()``
    replaced by ``grad.to(dtype)``; everything else as in torch."""

    def zeropower(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                  eps: float) -> torch.Tensor:
        if ns_steps >= 100:
            raise ValueError("Number of steps must be less than 100 for computational efficiency")
        if len(grad.shape) != 2:
            raise ValueError("Input tensor gradient must be a 2D matrix")
        a, b, c = ns_coefficients
        x = grad.to(dtype)
        if grad.size(0) > grad.size(1):
            x = x.T
        x = x.div(x.norm().clamp(min=eps))
        for _ in range(ns_steps):
            gram = x @ x.T
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, poly, x, beta=a)
        if grad.size(0) > grad.size(1):
            x = x.T
        return x

    return zeropower


@contextlib.contextmanager
def ns_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Run ``torch.optim.Muon``'s Newton-Schulz in ``dtype`` inside the block (bf16: torch unchanged)."""
    if dtype == torch.bfloat16:
        yield
        return
    import torch.optim._muon as tm

    original = tm._zeropower_via_newtonschulz
    tm._zeropower_via_newtonschulz = zeropower_in(dtype)
    try:
        yield
    finally:
        tm._zeropower_via_newtonschulz = original


def torch_muon_optimizers(model: nn.Module, o: OptimConfig) -> tuple[torch.optim.Muon, torch.optim.AdamW]:
    """(``torch.optim.Muon`` over the hidden matrices, ``torch.optim.AdamW`` over the rest) with
    ``sharded-muon``'s hyper-parameters. ``model`` may already be wrapped by FSDP2 (DTensor parameters)."""
    if o.muon_ns_method != "ns5":
        raise ValueError(f"torch.optim.Muon has one NS coefficient triple for every iteration; "
                         f"optim.muon_ns_method = {o.muon_ns_method!r} has no torch form (use ns5)")
    muon, adam = muon_split(model, plan_for(model))
    muon_ids = {id(p) for p in muon}
    rest = nn.ParameterList([p for p in adam if id(p) not in muon_ids])
    m_opt = torch.optim.Muon(muon, lr=o.muon_lr, weight_decay=o.weight_decay, momentum=o.muon_momentum,
                             nesterov=True, ns_coefficients=NS5_COEFFICIENTS, eps=1e-7, ns_steps=5,
                             adjust_lr_fn="original")
    a_opt = torch.optim.AdamW(adamw_param_groups(rest, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2),
                              eps=o.eps, foreach=True)
    return m_opt, a_opt


_RING_OPS = {
    "all_gather_into_tensor": "all_gather",
    "all_reduce": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


class CollectiveBytes(TorchDispatchMode):
    """Count the ring-model wire bytes per rank of the ``_c10d_functional`` collectives dispatched inside.

    ``counts[op]`` = number of calls, ``wire_bytes`` = sum of :func:`lowband.comm.ring_wire_bytes` over
    them (the full buffer of an all-gather is ``group size x input``; on gloo a reduce-scatter is
    counted as the all-reduce gloo runs).
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self.wire_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar into local ops and collectives, seen next
        kwargs = kwargs or {}
        ns = getattr(func, "namespace", "")
        name = func._schema.name.split("::")[-1] if hasattr(func, "_schema") else ""
        if ns == "_c10d_functional" and name in _RING_OPS:
            t: Any = args[0]
            nbytes = t.numel() * t.element_size()
            op = _RING_OPS[name]
            if op == "all_gather":
                n = int(args[1])
                nbytes *= n
            else:
                n = _group_size(args, name)
            if op == "reduce_scatter" and _is_gloo():
                op = "all_reduce"  # gloo runs reduce_scatter_tensor as an all-reduce of the whole buffer
            self.counts[op] = self.counts.get(op, 0) + 1
            self.wire_bytes += ring_wire_bytes(op, n, nbytes)
        return func(*args, **kwargs)


def _group_size(args: tuple, name: str) -> int:
    """Group size of a functional collective: an argument of reduce_scatter, else from its group name."""
    if name == "reduce_scatter_tensor":
        return int(args[2])
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_world_size(_resolve_process_group(args[-1]))


def _is_gloo() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_backend() == "gloo"
