"""Checkpoint state of ``sharded-adamw`` / ``sharded-muon`` (:class:`~lowband.optim.ShardedOptimizer`).

What :func:`sharded_state_dict` returns (keys never depend on the rank or the world size)::

    model.<fqn>                      the parameter (every rank holds it whole: a plain tensor, written once)
    optim.state.<fqn>.step           AdamW step count (float32 scalar, replicated; AdamW parameters only)
    optim.state.<fqn>.exp_avg        AdamW moments of the parameter, DTensor Shard(0) over the world
    optim.state.<fqn>.exp_avg_sq       (torch.chunk rows of the parameter's full shape; rank r writes chunk r)
    optim.state.<fqn>.momentum_buffer  Muon momentum of a matrix, the same layout
    optim.param_groups.<g>.<hyper>   hyperparameters of param group g (lr, betas, ...; replicated)

The optimizer itself owns contiguous ranges of flat buckets whose boundaries depend on the world size
and ``bucket_mb``; those ranges are not a DTensor placement. The checkpoint therefore stores every
state tensor per parameter with the standard ``Shard(0)`` placement, which DCP reshards to any world
size, and converts at save and load: :meth:`ShardedOptimizer.full_state_dict` (one all-gather per state
tensor per unit, ``tag="state"`` in the ledger) then each rank keeps its ``Shard(0)`` chunk; on load
each parameter's state is gathered from its DTensor (``full_tensor``, DTensor's own collective) and
:meth:`ShardedOptimizer.load_full_state_dict` takes this rank's owned ranges. Both briefly hold the full
optimizer state on every rank (the price of not writing the bucket layout into the checkpoint).

A parameter whose unit has no state yet gets zeros and step 0, exactly what the optimizer creates at
its first step, so the template always has every key.

fp32 master copies (``param_wire_dtype = "bfloat16"`` or parameters narrower than fp32: the owner
updates an fp32 copy of its slice and every rank computes with the rounded parameters) are saved as
``optim.state.<fqn>.master`` in the same per-parameter ``Shard(0)`` layout (one more all-gather per
unit at save, ``tag="state"``); a unit that has not stepped yet gets the master its first step would
create (the parameter in fp32). Row-sparse tables (``strategy.sparse_embeddings``) need nothing extra:
their AdamW state is an ordinary unit's; the sparse exchange keeps only per-step bookkeeping.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowband.optim import ShardedOptimizer

_GROUP_TYPES = (int, float, str, bool, tuple, type(None), torch.dtype)


class ShardedStateLayout:
    """Converts a :class:`ShardedOptimizer` and its model to DCP's per-parameter state and back."""

    def __init__(self, model: nn.Module, optimizer: ShardedOptimizer) -> None:
        self.model, self.optimizer = model, optimizer
        names = {id(p): n for n, p in model.named_parameters()}
        self.by_index = [(names[id(p)], p) for g in optimizer.param_groups for p in g["params"]]
        self.kind = {}
        for unit in optimizer.units:
            for m in unit.members:
                self.kind[m.index] = unit.kind
        self.world, self.rank = optimizer.comm.size, optimizer.comm.rank
        self._mesh = None

    def _sharded(self, full: torch.Tensor) -> Any:
        """Rank r's ``torch.chunk`` rows of ``full`` as a ``Shard(0)`` DTensor (plain on one rank)."""
        if self.world == 1:
            return full.clone()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        if self._mesh is None:
            self._mesh = init_device_mesh(full.device.type, (self.world,))
        chunks = full.chunk(self.world, dim=0)
        local = (chunks[self.rank] if self.rank < len(chunks)
                 else full.new_empty((0, *full.shape[1:]))).contiguous().clone()
        return DTensor.from_local(local, self._mesh, [Shard(0)], run_check=False, shape=full.shape,
                                  stride=full.stride())

    # ------------------------------------------------------------------------------ fp32 masters
    def _master_units(self) -> list[int]:
        """Units whose owner keeps an fp32 master (see ``ShardedOptimizer._master``)."""
        opt = self.optimizer
        return [ui for ui, u in enumerate(opt._units)
                if not (u.layout.dtype == u.grad_shard.dtype and opt._param_wire(u) == u.layout.dtype)]

    def _gather_master(self, ui: int) -> torch.Tensor:
        """Unit ``ui``'s masters over its whole flat space (one all-gather, ``tag="state"``)."""
        opt = self.optimizer
        unit = opt._units[ui]
        lay, acc = unit.layout, unit.grad_shard.dtype
        st = opt.state.get(ui, {})
        if lay.kind == "adamw":
            lo, hi = lay.owner_range(self.rank)
            local = st["master"] if "master" in st else unit.param_buf[lo:hi].to(acc)
        else:
            rows, cols = lay.matrix_shape
            c, real = lay.slots_per_rank, lay.real_per_rank[self.rank]
            local = torch.zeros(c, rows, cols, dtype=acc, device=unit.grad_shard.device)
            own = unit.param_buf.view(-1, rows, cols)[self.rank * c:self.rank * c + real]
            local[:real].copy_(st["master"] if "master" in st else own.to(acc))
        full = torch.empty(lay.numel, dtype=acc, device=unit.grad_shard.device)
        opt.comm.all_gather(full, local.contiguous().reshape(-1), tag="state")
        return full

    def _install_master(self, ui: int, per_member: dict[int, torch.Tensor]) -> None:
        opt = self.optimizer
        unit = opt._units[ui]
        lay, acc = unit.layout, unit.grad_shard.dtype
        full = torch.zeros(lay.numel, dtype=acc, device=unit.grad_shard.device)
        for m in lay.members:
            full[m.offset:m.offset + m.numel].copy_(per_member[m.index].reshape(-1))
        if lay.kind == "adamw":
            lo, hi = lay.owner_range(self.rank)
            master = full[lo:hi].clone()
        else:
            rows, cols = lay.matrix_shape
            c, real = lay.slots_per_rank, lay.real_per_rank[self.rank]
            master = full.view(-1, rows, cols)[self.rank * c:self.rank * c + real].clone()
        opt.state[ui]["master"] = master

    # ---------------------------------------------------------------------------------- public
    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        opt = self.optimizer
        full = opt.full_state_dict()  # collective; waits for in-flight parameter gathers
        model = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        optim: dict[str, Any] = {}
        for idx, (name, p) in enumerate(self.by_index):
            if idx not in self.kind:  # frozen: in no unit
                continue
            st = full["state"].get(idx)
            acc = torch.float64 if p.dtype == torch.float64 else torch.float32
            if self.kind[idx] == "adamw":
                if st is None:
                    st = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(p.shape, dtype=acc, device=p.device),
                          "exp_avg_sq": torch.zeros(p.shape, dtype=acc, device=p.device)}
                optim[f"state.{name}.step"] = st["step"].detach().to(torch.float32).clone()
                for k in ("exp_avg", "exp_avg_sq"):
                    optim[f"state.{name}.{k}"] = self._sharded(st[k].reshape(p.shape))
            else:
                mom = st["momentum_buffer"] if st is not None else torch.zeros(p.shape, dtype=acc, device=p.device)
                optim[f"state.{name}.momentum_buffer"] = self._sharded(mom.reshape(p.shape))
        for ui in self._master_units():
            flat = self._gather_master(ui)
            for m in opt._units[ui].layout.members:
                name, p = self.by_index[m.index]
                optim[f"state.{name}.master"] = self._sharded(flat[m.offset:m.offset + m.numel].view(p.shape))
        for gi, g in enumerate(full["param_groups"]):
            for k, v in g.items():
                if k != "params" and isinstance(v, _GROUP_TYPES):
                    optim[f"param_groups.{gi}.{k}"] = v
        return {"model": model, "optim": optim}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.tensor import DTensor

        opt = self.optimizer
        opt.wait_for_params()
        for n, p in self.model.named_parameters():
            p.copy_(state["model"][n])  # p is a view into the flat parameter buffer
        optim = state["optim"]
        gathered = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in optim.items()}
        full_state: dict[int, dict[str, Any]] = {}
        for idx, (name, _p) in enumerate(self.by_index):
            if idx not in self.kind:
                continue
            keys = ("step", "exp_avg", "exp_avg_sq") if self.kind[idx] == "adamw" else ("momentum_buffer",)
            full_state[idx] = {k: gathered[f"state.{name}.{k}"] for k in keys}
        groups = []
        for gi, g in enumerate(opt.param_groups):
            packed = {k: gathered.get(f"param_groups.{gi}.{k}", v) for k, v in g.items() if k != "params"}
            packed["params"] = g["params"]
            groups.append(packed)
        opt.load_full_state_dict({"state": full_state, "param_groups": groups})
        for ui in self._master_units():
            members = opt._units[ui].layout.members
            self._install_master(ui, {m.index: gathered[f"state.{self.by_index[m.index][0]}.master"]
                                      for m in members})
