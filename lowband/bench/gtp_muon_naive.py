"""The naive GTP + Muon baseline of the ``gtp`` bench suite (``gtp-muon-naive``).

What one writes without a Muon distributor for GTP-sharded weights: every rank all-gathers every
Muon matrix's full gradient from the row shards, keeps a full-matrix momentum buffer, orthogonalizes
every matrix and keeps only its own rows of the update. The math is :mod:`lowband.optim.muon`'s (the
same momentum / Nesterov blend, :func:`~lowband.optim.muon.orthogonalize`, shape scale and decoupled
weight decay as :func:`~lowband.optim.muon.muon_update_`, element by element), so it equals
single-device Muon on the full matrices; only the work and the state are replicated.

Communication per step: one ``Comm.all_gather`` per Muon matrix on the GTP group (tag
``gtp-muon-naive:ag``), ``(N-1)/N`` of the padded gradient bytes each. Nothing else (the rest of the
model is AdamW on shards and replicated parameters, elementwise).

State per rank: for each Muon matrix a full ``[out, in]`` momentum buffer (N times a shard's);
AdamW's two moments for the other parameters (shards or replicated, as GTP holds them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lowband.comm import Comm
from lowband.optim.muon import muon_shape_scale, orthogonalize, validate_muon_hparams
from lowband.plan import muon_split, plan_for
from lowband.train.config import OptimConfig
from lowband.train.optimizers import adamw_param_groups


class NaiveGTPMuon(torch.optim.Optimizer):
    """Muon on GTP row shards by gathering every full gradient on every rank.

    Args:
        params: GTP shard parameters (each with ``.gtp``, a :class:`lowband.parallel.gtp.GTPWeight`).
        comm: the GTP group the shards live on.
        lr, momentum, nesterov, weight_decay, ns_method, ns_steps, ns_dtype: as :class:`lowband.optim.muon.Muon`.
    """

    def __init__(self, params: Iterable[nn.Parameter], comm: Comm, *, lr: float = 0.02, momentum: float = 0.95,
                 nesterov: bool = True, weight_decay: float = 0.0, ns_method: str = "ns5", ns_steps: int = 5,
                 ns_dtype: torch.dtype = torch.bfloat16) -> None:
        validate_muon_hparams(lr, momentum, nesterov, weight_decay, ns_method, ns_steps, ns_dtype,
                              where="NaiveGTPMuon")
        params = list(params)
        for p in params:
            if getattr(p, "gtp", None) is None:
                raise ValueError("NaiveGTPMuon: every parameter must be a GTP shard (shard the model with "
                                 "lowband.parallel.gtp.shard_linears first)")
        self.comm = comm
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                                      ns_method=ns_method, ns_steps=ns_steps, ns_dtype=ns_dtype))

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mom, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                gw = p.gtp
                full = torch.empty((gw.padded_out, gw.in_features), dtype=p.grad.dtype, device=p.grad.device)
                self.comm.all_gather(full, p.grad.contiguous(), tag="gtp-muon-naive:ag")
                g = full[:gw.out_features]
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros((gw.out_features, gw.in_features), dtype=p.dtype,
                                                           device=p.device)
                buf = state["momentum_buffer"]
                # muon_update_'s arithmetic on the full matrix; only this rank's rows are written
                g = g.to(buf.dtype)
                buf.lerp_(g, 1 - mom)
                u = g.lerp(buf, mom) if group["nesterov"] else buf
                o = orthogonalize(u, method=group["ns_method"], steps=group["ns_steps"], dtype=group["ns_dtype"])
                if wd != 0:
                    p.mul_(1 - lr * wd)
                lo = gw.shard_slice.start
                hi = min(lo + gw.shard_rows, gw.out_features)
                if hi > lo:
                    scale = muon_shape_scale(gw.out_features, gw.in_features)
                    p[: hi - lo].add_(o[lo:hi].to(p.dtype), alpha=-lr * scale)
        return loss


class OptimizerPair:
    """Two optimizers stepped as one (``step``, ``zero_grad``, merged ``state`` and ``param_groups``)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    @property
    def state(self) -> dict[Any, Any]:
        return {k: v for o in self.optimizers for k, v in o.state.items()}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def muon_names(model: nn.Module) -> set[str]:
    """Names of the parameters :func:`lowband.plan.muon_split` gives Muon (call before sharding)."""
    muon, _ = muon_split(model, plan_for(model))
    ids = {id(p) for p in muon}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def naive_gtp_muon(model: nn.Module, names: set[str], comm: Comm, o: OptimConfig,
                   ns_dtype: torch.dtype) -> OptimizerPair:
    """``NaiveGTPMuon`` over the GTP shards named in ``names`` (``sharded-muon``'s hyper-parameters:
    ``optim.muon_lr``, ``optim.muon_momentum``, Nesterov, 5 steps of ``optim.muon_ns_method``), and
    torch AdamW (:func:`lowband.train.optimizers.adamw_param_groups`, ``optim.lr``) over the rest."""
    params = dict(model.named_parameters())
    missing = sorted(names - set(params))
    if missing:
        raise ValueError(f"naive_gtp_muon: parameters {missing} are not in the model")
    unsharded = sorted(n for n in names if getattr(params[n], "gtp", None) is None)
    if unsharded:
        raise ValueError(f"naive_gtp_muon: Muon matrices {unsharded} are not GTP-sharded")
    muon = [p for n, p in params.items() if n in names]
    rest = nn.ParameterList([p for n, p in params.items() if n not in names and p.requires_grad])
    m_opt = NaiveGTPMuon(muon, comm, lr=o.muon_lr, momentum=o.muon_momentum, nesterov=True,
                         weight_decay=o.weight_decay, ns_method=o.muon_ns_method, ns_steps=5, ns_dtype=ns_dtype)
    a_opt = torch.optim.AdamW(adamw_param_groups(rest, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2),
                              eps=o.eps, foreach=True)
    return OptimizerPair(m_opt, a_opt)
