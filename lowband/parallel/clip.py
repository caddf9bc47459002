"""Global gradient-norm clipping for GTP, TP and GTP x TP models.

``torch.nn.utils.clip_grad_norm_`` on a sharded model computes each rank's norm over *its* shards
and clips every rank with a different factor: the update is no longer the single-process one.
:func:`clip_grad_norm_` here computes the norm of the whole logical gradient, identical on every
rank, and scales like torch (``coef = min(1, max_norm / (norm + eps))``, applied to every gradient).

Which groups a parameter is sharded over is read from its :class:`~lowband.sharding.Placement`
(:func:`~lowband.sharding.placement_of`):

* a ``"gtp"`` cut (set by :class:`~lowband.parallel.gtp.GTPRuntime`): over the GTP group (pad rows hold
  zero gradient and add nothing);
* a ``"tp"`` cut (set by the TP layers of :mod:`lowband.parallel.tensor` / :mod:`lowband.parallel.gtp_tp`,
  or declared on a user's own TP layer): over the TP group;
* both (GTP x TP): over both; anything else is replicated and counted once.

Replicated gradients must already be equal across the groups (as after
:func:`~lowband.parallel.gtp.sync_replicated_grads`, or for TP peers that computed on the same
batch), and data-parallel gradients already averaged: call this after the gradient reductions, right
before ``optimizer.step()``.

Communication pattern: one ``all_reduce`` (sum) of a small vector of squared partial norms per
distinct GTP group, then one per distinct TP group (tags ``"gtp:norm"``, ``"tp:norm"``); none when
no parameter is sharded. Every rank of every group must call it, with parameters in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lowband.comm import Comm
from lowband.parallel.gtp import note_grads
from lowband.sharding import placement_of


def _groups(p: torch.Tensor) -> tuple[Comm | None, Comm | None]:
    pl = placement_of(p)
    if pl is None:
        return None, None
    return pl.group("gtp"), pl.group("tp")


def _params(parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(parameters, nn.Module):
        return list(parameters.parameters())
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    seen: set[int] = set()
    out = []
    for p in parameters:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


@torch.no_grad()
def global_grad_norm(parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor,
                     norm_type: float = 2.0) -> torch.Tensor:
    """The 2-norm of the whole logical gradient (a 0-d tensor, the same on every rank; collective).

    Squares are accumulated in float64 if any gradient is float64, else float32. Parameters without a
    gradient count as zero (and still decide the collectives, so every rank issues the same ones).

    Raises:
        ValueError: ``norm_type`` is not 2 (before any collective).
    """
    if float(norm_type) != 2.0:
        raise ValueError(f"lowband.parallel.global_grad_norm: only norm_type=2.0 is supported, got {norm_type}")
    params = _params(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    acc = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    device = grads[0].device if grads else (params[0].device if params else torch.device("cpu"))
    keys: list[tuple[int | None, int | None]] = []
    comms: dict[int, Comm] = {}
    sums: dict[tuple[int | None, int | None], torch.Tensor] = {}
    for p in params:
        gtp, tp = _groups(p)
        key = (None if gtp is None else id(gtp), None if tp is None else id(tp))
        for c in (gtp, tp):
            if c is not None:
                comms[id(c)] = c
        if key not in sums:
            keys.append(key)
            sums[key] = torch.zeros((), dtype=acc, device=device)
        if p.grad is not None:
            sums[key] += p.grad.detach().to(acc).square().sum()
    vec = torch.stack([sums[k] for k in keys]) if keys else torch.zeros(0, dtype=acc, device=device)
    for axis, tag in ((0, "gtp:norm"), (1, "tp:norm")):
        order: list[int] = []
        for k in keys:
            if k[axis] is not None and k[axis] not in order:
                order.append(k[axis])
        for cid in order:
            idx = torch.tensor([i for i, k in enumerate(keys) if k[axis] == cid], device=device)
            part = vec.index_select(0, idx).contiguous()
            comms[cid].all_reduce(part, "sum", tag=tag)
            vec.index_copy_(0, idx, part)
    return vec.sum().sqrt()


@torch.no_grad()
def clip_grad_norm_(parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0, *, eps: float = 1e-6,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of a GTP / TP / GTP x TP model by the global norm, in place (collective).

    Equal to ``torch.nn.utils.clip_grad_norm_`` on the single-process model: the total norm is that of
    the whole logical gradient (:func:`global_grad_norm`), and every gradient is multiplied by
    ``min(1, max_norm / (total + eps))`` on every rank. Returns the total norm (before clipping).

    Raises:
        ValueError: ``norm_type`` is not 2; or ``error_if_nonfinite`` and the norm is not finite (on
            every rank alike, since the norm is the same everywhere).
    """
    params = _params(parameters)
    total = global_grad_norm(params, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise ValueError(f"lowband.parallel.clip_grad_norm_: the total gradient norm is {float(total)}")
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return total
    coef = torch.clamp(max_norm / (total + eps), max=1.0)
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault((g.dtype, g.device), []).append(g)
    for (dtype, device), gs in by_dtype.items():
        torch._foreach_mul_(gs, coef.to(dtype=dtype, device=device))
    note_grads(params)  # lowband's own edit: not refused by GTP's check at optimizer.step()
    return total
