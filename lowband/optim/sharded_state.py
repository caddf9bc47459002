"""Checkpoint layout of :class:`lowband.optim.ShardedOptimizer` state for ``torch.distributed.checkpoint``.

The optimizer owns contiguous ranges of flat buckets whose boundaries depend on the world size and
``bucket_mb``; those ranges are not a DTensor placement. Its checkpoint state is therefore stored
**per parameter** with the standard ``Shard(0)`` placement (``torch.chunk`` rows of the parameter's
full shape over the data-parallel group; rank ``r`` writes chunk ``r``), which DCP reshards to any
world size:

* :meth:`ShardedOptimizer.state_dict` returns ``{"state": {param_index: {...}}, "param_groups": [...]}``
  in ``torch.optim`` format, every state tensor a ``Shard(0)`` DTensor (a plain tensor on one rank),
  ``step`` a replicated float32 scalar. So torch's own
  ``torch.distributed.checkpoint.state_dict.get_state_dict(model, opt)`` / ``set_state_dict`` and
  ``dcp.save`` / ``dcp.load`` work on it, including a reshard to another world size.
* :class:`ShardedStateLayout` is the same state under flat string keys next to the model's
  parameters, ``{"model": {fqn: tensor}, "optim": {"state.<fqn>.<key>": ..., "param_groups.<g>.<hyper>":
  ...}}``, for a trainer that saves one dict with ``dcp.save`` (lowband's trainer does).

Per-parameter keys: AdamW ``step``, ``exp_avg``, ``exp_avg_sq``; Muon ``momentum_buffer``; plus
``master`` (the owner's fp32 master copy) where the optimizer keeps one (``param_wire_dtype`` narrower
than the parameters, or parameters narrower than fp32). A parameter whose unit has not stepped yet
gets what its first step would create (zeros, step 0, the parameter itself as master), so a template
always has every key.

Communication: saving runs :meth:`ShardedOptimizer.full_state_dict` (one all-gather per state tensor
per unit, ``tag="state"``) and keeps this rank's chunk; loading gathers each ``Shard(0)`` DTensor back
to the full tensor with one all-gather per dtype (``tag="state"``) and takes the owned ranges. Both go
through :mod:`lowband.comm` (counted in the ledger) and briefly hold the full optimizer state on every
rank (the price of a world-size-independent checkpoint).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lowband.comm import Comm

if TYPE_CHECKING:
    from lowband.optim.sharded import ShardedOptimizer

_GROUP_TYPES = (int, float, str, bool, tuple, type(None), torch.dtype)


def group_hyperparams(param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"param_groups.<g>.<key>": value}`` for every plain hyper-parameter (number, string, bool, tuple,
    None, dtype) of every param group: the flat, rank-independent keys under which each lowband state
    layout saves an optimizer's hyper-parameters (``lr`` included, so a resumed LR schedule continues)."""
    return {f"param_groups.{gi}.{k}": v for gi, g in enumerate(param_groups) for k, v in g.items()
            if k != "params" and isinstance(v, _GROUP_TYPES)}


def _chunk_bounds(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of ``torch.chunk(full, world, dim=0)[rank]`` (empty past the last chunk)."""
    c = -(-rows // world) if rows else 0
    lo = min(rows, rank * c)
    return lo, min(rows, lo + c)


class Shard0:
    """Builds ``Shard(0)`` DTensors over a :class:`Comm`'s group and gathers them back through it."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._mesh: Any = None

    def _mesh_for(self, device: torch.device) -> Any:
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            group = self.comm.group if self.comm.group is not None else dist.group.WORLD
            self._mesh = DeviceMesh.from_group(group, device.type)
        return self._mesh

    def shard(self, full: torch.Tensor) -> Any:
        """This rank's ``torch.chunk`` rows of ``full`` as a ``Shard(0)`` DTensor (a copy on one rank)."""
        if self.comm.size == 1:
            return full.detach().clone()
        from torch.distributed.tensor import DTensor, Shard

        full = full.detach().contiguous()
        lo, hi = _chunk_bounds(full.shape[0], self.comm.size, self.comm.rank)
        out = DTensor.from_local(full[lo:hi].clone(), self._mesh_for(full.device), [Shard(0)], run_check=False,
                                 shape=full.shape, stride=full.stride())
        # which rank's chunk this is (pickled with it): ShardedOptimizer.load_state_dict refuses it elsewhere
        out._lowband_shard_of = (self.comm.rank, self.comm.size)  # type: ignore[attr-defined]
        return out

    @torch.no_grad()
    def gather(self, values: dict[Any, Any]) -> dict[Any, Any]:
        """Full tensors for every ``Shard(0)`` DTensor in ``values`` (one all-gather per dtype and
        device, ``tag="state"``); other values pass through. A DTensor on another mesh or placement
        is gathered with its own ``full_tensor()``."""
        from torch.distributed.tensor import DTensor, Shard

        out: dict[Any, Any] = {}
        batches: dict[tuple, list[tuple[Any, torch.Tensor, tuple]]] = {}
        n, rank = self.comm.size, self.comm.rank
        for k, v in values.items():
            if not isinstance(v, DTensor):
                out[k] = v
                continue
            local = v.to_local()
            shape = tuple(v.shape)
            lo, hi = _chunk_bounds(shape[0], n, rank) if shape else (0, 0)
            if (v.device_mesh.size() != n or list(v.placements) != [Shard(0)] or not shape
                    or tuple(local.shape) != (hi - lo, *shape[1:])):
                out[k] = v.full_tensor()
                continue
            batches.setdefault((local.dtype, local.device), []).append((k, local, shape))
        for (dtype, device), items in batches.items():
            sizes = []
            for _k, _local, shape in items:
                row = 1
                for d in shape[1:]:
                    row *= d
                sizes.append((-(-shape[0] // n)) * row)  # padded chunk of every rank
            send = torch.zeros(sum(sizes), dtype=dtype, device=device)
            off = 0
            for (_k, local, _shape), size in zip(items, sizes):
                send[off:off + local.numel()].copy_(local.reshape(-1))
                off += size
            recv = torch.empty(n * send.numel(), dtype=dtype, device=device)
            self.comm.all_gather(recv, send, tag="state")
            parts = recv.view(n, -1)
            off = 0
            for (k, _local, shape), size in zip(items, sizes):
                row = size // max(1, -(-shape[0] // n))
                pieces = []
                for r in range(n):
                    lo, hi = _chunk_bounds(shape[0], n, r)
                    pieces.append(parts[r, off:off + (hi - lo) * row])
                out[k] = torch.cat(pieces).view(shape).clone()
                off += size
        return out


class ShardedStateLayout:
    """A model and its :class:`ShardedOptimizer` as one flat, world-size-independent checkpoint dict.

    ``state_dict()`` (collective) returns::

        {"model": {fqn: tensor},                         every rank holds each parameter whole
         "optim": {"state.<fqn>.<key>": DTensor Shard(0) | float32 scalar ("step"),
                   "param_groups.<g>.<hyper>": value}}   (lr, betas, algorithm, ...; replicated)

    ``load_state_dict(state)`` (collective) applies such a dict, saved at any world size and filled in
    by ``dcp.load``. Parameters are named by ``model.named_parameters()`` (a tied parameter by its
    first name). See the module docstring for the per-parameter keys and the communication.
    """

    def __init__(self, model: nn.Module, optimizer: ShardedOptimizer) -> None:
        self.model, self.optimizer = model, optimizer
        names = {id(p): n for n, p in model.named_parameters()}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        missing = [i for i, p in enumerate(params) if id(p) not in names]
        if missing:
            raise ValueError(f"ShardedStateLayout: optimizer parameters {missing} are not parameters of the model")
        self.names = [names[id(p)] for p in params]

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        osd = self.optimizer.state_dict()  # collective; waits for in-flight parameter gathers
        model = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        optim: dict[str, Any] = {}
        for idx, st in osd["state"].items():
            for k, v in st.items():
                optim[f"state.{self.names[idx]}.{k}"] = v
        optim.update(group_hyperparams(osd["param_groups"]))
        return {"model": model, "optim": optim}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        opt = self.optimizer
        opt.wait_for_params()
        for n, p in self.model.named_parameters():
            p.copy_(state["model"][n])  # a view into the optimizer's flat parameter buffer
        optim = state["optim"]
        index = {n: i for i, n in enumerate(self.names)}
        per_param: dict[int, dict[str, Any]] = {}
        for key, v in optim.items():
            if not key.startswith("state."):
                continue
            fqn, k = key[len("state."):].rsplit(".", 1)
            if fqn not in index:
                raise ValueError(f"ShardedStateLayout.load_state_dict: {key!r} names no optimizer parameter")
            per_param.setdefault(index[fqn], {})[k] = v
        groups = []
        start = 0
        for gi, g in enumerate(opt.param_groups):
            packed = {k: optim.get(f"param_groups.{gi}.{k}", v) for k, v in g.items() if k != "params"}
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        opt.load_state_dict({"state": per_param, "param_groups": groups})
