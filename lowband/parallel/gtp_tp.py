"""TP x GTP: Megatron tensor-parallel linears whose TP-local weight is GTP-sharded on dim 0.

Two cuts, as in Megatron-Core GTP (reference/gtp.md §1.2):

* :class:`GTPColumnParallelLinear`: TP cuts the output features (rank ``t`` holds rows
  ``[t*out/T, (t+1)*out/T)`` of the dense weight), GTP cuts that TP-local ``[out/T, in]`` weight again
  on dim 0 (both cuts on ``out``). The TP-local bias is replicated over GTP.
* :class:`GTPRowParallelLinear`: TP cuts the input features (``[out, in/T]`` per TP rank), GTP cuts
  the output features of that slice (the cuts are perpendicular). The bias is replicated.

Communication: the TP collectives are those of :mod:`lowband.parallel.tensor` (column: all-reduce of
``dX`` over TP in backward; row: all-reduce of the partial output over TP in forward); the GTP
collectives are those of :mod:`lowband.parallel.gtp` on the TP-local weight (gather just in time,
prefetch, async reduce-scatter of the wgrad over the GTP group). Data lanes: TP peers see the same
microbatch, GTP peers different ones (``lane = rank // TP``, :mod:`lowband.parallel.mesh`).
Replicated biases: average their grads over the GTP group (:func:`~lowband.parallel.gtp.sync_replicated_grads`).
The TP-local weights (and the column layer's bias) carry the TP layout attributes of
:func:`~lowband.parallel.tensor.mark_partition` (of the TP-local tensor before the GTP cut), so
:func:`lowband.parallel.clip_grad_norm_` sums their squares over both groups.
"""

from __future__ import annotations

import torch
from torch import nn

from lowband.comm import Comm
from lowband.parallel.dense import dense_linear, gather_tp
from lowband.parallel.gtp import GTPLinear, GTPRuntime
from lowband.parallel.tensor import (
    _next_site,
    copy_to_tp,
    gather_from_tp,
    mark_partition,
    reduce_from_tp,
    scatter_to_tp,
)


def _check_tp_split(what: str, features: int, size: int) -> None:
    if features % size:
        raise ValueError(f"{what}={features} is not divisible by the TP group size {size}")


class GTPColumnParallelLinear(nn.Module):
    """Column-parallel linear (TP on ``out``) with its TP-local weight GTP-sharded (also on ``out``).

    Args:
        linear: the dense ``nn.Linear`` (same values on every rank).
        tp_comm: the TP group.
        runtime: the GTP runtime (its comm is the GTP group).
        gather_output: all-gather the TP output slices (else return this rank's slice).
        name: weight name for logs and errors.
    """

    def __init__(self, linear: nn.Linear, tp_comm: Comm, runtime: GTPRuntime, *,
                 gather_output: bool = False, name: str = "") -> None:
        super().__init__()
        tp_comm = tp_comm.private("tp")  # the TP layers' own process group (see lowband.parallel.tensor)
        n, r = tp_comm.size, tp_comm.rank
        _check_tp_split("GTPColumnParallelLinear: out_features", linear.out_features, n)
        self.tp_comm, self.gather_output = tp_comm, gather_output
        local = nn.Linear(linear.in_features, linear.out_features // n, bias=linear.bias is not None,
                          dtype=linear.weight.dtype, device=linear.weight.device)
        with torch.no_grad():
            local.weight.copy_(linear.weight.chunk(n, 0)[r])
            if linear.bias is not None:
                local.bias.copy_(linear.bias.chunk(n, 0)[r])
        local.weight.requires_grad_(linear.weight.requires_grad)
        if linear.bias is not None:
            local.bias.requires_grad_(linear.bias.requires_grad)
        self.inner = GTPLinear.from_linear(local, runtime, name=name)
        self.tp_site = _next_site(tp_comm)
        self.tp_name = name or f"{type(self).__name__} #{self.tp_site}"
        mark_partition(self.inner.weight, 0, tp_comm, (linear.out_features, linear.in_features))
        if self.inner.bias is not None:
            mark_partition(self.inner.bias, 0, tp_comm, (linear.out_features,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_comm.size > 1:
            x = copy_to_tp(x, self.tp_comm, self.tp_site, self.tp_name)
        y = self.inner(x)
        if self.gather_output and self.tp_comm.size > 1:
            y = gather_from_tp(y, self.tp_comm, self.tp_site, self.tp_name)
        return y

    def lowband_dense(self) -> nn.Linear:
        """The plain ``nn.Linear`` (collective: the GTP gather of the TP-local weight, then the TP gathers)."""
        inner = self.inner
        w = gather_tp(self.tp_comm, inner.runtime.full_weight(inner.gtp), 0)
        b = None if inner.bias is None else gather_tp(self.tp_comm, inner.bias, 0)
        return dense_linear(w, b, inner.weight)


class GTPRowParallelLinear(nn.Module):
    """Row-parallel linear (TP on ``in``) with its TP-local ``[out, in/T]`` weight GTP-sharded on ``out``.

    Args:
        linear: the dense ``nn.Linear`` (same values on every rank).
        tp_comm: the TP group.
        runtime: the GTP runtime.
        input_is_parallel: the input is already this TP rank's slice of the input features.
        name: weight name for logs and errors.
    """

    def __init__(self, linear: nn.Linear, tp_comm: Comm, runtime: GTPRuntime, *,
                 input_is_parallel: bool = True, name: str = "") -> None:
        super().__init__()
        tp_comm = tp_comm.private("tp")
        n, r = tp_comm.size, tp_comm.rank
        _check_tp_split("GTPRowParallelLinear: in_features", linear.in_features, n)
        self.tp_comm, self.input_is_parallel = tp_comm, input_is_parallel
        local = nn.Linear(linear.in_features // n, linear.out_features, bias=False,
                          dtype=linear.weight.dtype, device=linear.weight.device)
        with torch.no_grad():
            local.weight.copy_(linear.weight.chunk(n, 1)[r])
        local.weight.requires_grad_(linear.weight.requires_grad)
        self.inner = GTPLinear.from_linear(local, runtime, name=name)
        self.tp_site = _next_site(tp_comm)
        self.tp_name = name or f"{type(self).__name__} #{self.tp_site}"
        mark_partition(self.inner.weight, 1, tp_comm, (linear.out_features, linear.in_features))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                                  requires_grad=linear.bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.tp_comm.size
        if not self.input_is_parallel and n > 1:
            x = scatter_to_tp(x, self.tp_comm, self.tp_site, self.tp_name)
        y = self.inner(x)
        if n > 1:
            y = reduce_from_tp(y, self.tp_comm, self.tp_site, self.tp_name)
        if self.bias is not None:
            y = y + self.bias
        return y

    def lowband_dense(self) -> nn.Linear:
        """The plain ``nn.Linear`` (collective: the GTP gather of the TP-local weight, then the TP gather)."""
        inner = self.inner
        w = gather_tp(self.tp_comm, inner.runtime.full_weight(inner.gtp), 1)
        return dense_linear(w, None if self.bias is None else self.bias.detach(), inner.weight)
