"""Checkpoint state of the ``diloco`` strategy (Streaming DiLoCo, DDP inside each replica).

What :class:`DilocoStateLayout` returns (keys never depend on the rank, the replica or the world size)::

    model.<fqn>                          the replica's parameters
    optim.state.<fqn>.<key>              the inner AdamW state (step, exp_avg, exp_avg_sq)
    optim.param_groups.<g>.<hyper>       inner hyperparameters (lr, betas, ...; the same on every rank)
    diloco.global.<fqn>                  the global (outer) copy of the parameter
    diloco.outer.<fqn>.momentum_buffer   the outer SGD momentum
    diloco.outer_started.<i>             whether fragment i's outer optimizer has state yet (bool)
    diloco.counters                      {"committed", "local_step"}
    diloco.inflight                      b"" or the pickled (fragment, averaged pseudo-gradient)

Layouts (``R`` replicas x ``D`` ranks per replica, replica-major ranks as in
:func:`lowband.diloco.replica_mesh`): the model and the inner optimizer state differ between
replicas (each trains on its own data between syncs) and are identical inside one (DDP), so each is a
``DTensor`` of global shape ``(R, *shape)`` on the ``(replica, dp)`` mesh with placements
``[Shard(0), Replicate()]`` (one row per replica, written once per replica); a plain ``(1, *shape)``
tensor on one rank. The global copies, the outer momentum, the counters and the in-flight fragment are
the same on every rank (every replica applies the same averaged pseudo-gradient) and are plain
tensors / objects, written once.

In-flight fragment: between a fragment's *prepare* and its *sync* (``diloco.delay > 0``) its
pseudo-gradient all-reduce is in flight. Saving waits for it (the same values the sync would wait for
later; only when phase 2 of the codec all-reduce is issued changes) and stores the averaged result;
loading re-creates the in-flight fragment with nothing left to wait for, so the resumed sync applies
exactly what the uninterrupted one applies. The resumed run needs the same number of replicas as the
saved one (the strategy's format tag carries it); the DDP size inside a replica may change (DCP
re-splits ``[Shard(0), Replicate()]``).

Communication: none of its own (building the device mesh once creates process groups, every rank
alike; the in-flight wait completes a pending codec all-reduce, tag ``diloco:frag<i>``).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch import nn

_GROUP_TYPES = (int, float, str, bool, tuple, type(None), torch.dtype)


class DilocoStateLayout:
    """Converts a ``diloco`` strategy's state to DCP's state and back (see the module docstring).

    Args:
        model: the plain replica model (not the DDP wrapper).
        optimizer: the inner torch AdamW.
        diloco: the :class:`~lowband.diloco.StreamingDiLoCo`.
        num_replicas, dp_size, replica: the mesh and this rank's replica.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, diloco: Any, num_replicas: int,
                 dp_size: int, replica: int) -> None:
        self.model, self.optimizer, self.diloco = model, optimizer, diloco
        self.r, self.d, self.replica = num_replicas, dp_size, replica
        self.names = {id(p): n for n, p in model.named_parameters()}
        self._mesh = None

    def _per_replica(self, x: torch.Tensor) -> Any:
        local = x.detach().unsqueeze(0).contiguous().clone()
        if self.r * self.d == 1:
            return local
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if self._mesh is None:
            self._mesh = init_device_mesh(x.device.type, (self.r, self.d), mesh_dim_names=("replica", "dp"))
        shape = torch.Size((self.r, *x.shape))
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, self._mesh, [Shard(0), Replicate()], run_check=False, shape=shape,
                                  stride=stride)

    @staticmethod
    def _row(x: Any) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        local = x.to_local() if isinstance(x, DTensor) else x
        return local[0].contiguous().clone()

    def _inner_state(self, p: torch.Tensor) -> dict[str, Any]:
        st = self.optimizer.state.get(p)
        if st:
            return st
        from torch.optim.optimizer import _get_scalar_dtype

        return {"step": torch.tensor(0.0, dtype=_get_scalar_dtype()), "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p)}

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        dl = self.diloco
        inflight = b""
        if dl._inflight is not None:
            for h in dl._inflight.handles:  # same order on every rank; the sync's wait is then a no-op
                h.wait()
            dl._inflight.handles = []
            inflight = pickle.dumps((dl._inflight.fragment, dl._inflight.flat.detach().cpu().clone()))
        model = {n: self._per_replica(p) for n, p in self.model.named_parameters()}
        optim: dict[str, Any] = {}
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                for k, v in self._inner_state(p).items():
                    optim[f"state.{self.names[id(p)]}.{k}"] = self._per_replica(v)
        for gi, g in enumerate(self.optimizer.param_groups):
            for k, v in g.items():
                if k != "params" and isinstance(v, _GROUP_TYPES):
                    optim[f"param_groups.{gi}.{k}"] = v
        out: dict[str, Any] = {"counters": {"committed": dl.committed, "local_step": dl.local_step},
                               "inflight": inflight}
        for i, (frag, gs, outer) in enumerate(zip(dl.frags, dl.globals, dl.outer, strict=True)):
            out[f"outer_started.{i}"] = any(bool(outer.state.get(g)) for g in gs)
            for name, g in zip(frag.names, gs, strict=True):
                out[f"global.{name}"] = g.detach().clone()
                st = outer.state.get(g, {})
                mom = st.get("momentum_buffer")
                out[f"outer.{name}.momentum_buffer"] = (mom.detach().clone() if mom is not None
                                                        else torch.zeros_like(g))
        return {"model": model, "optim": optim, "diloco": out}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        from lowband.diloco.streaming import _InFlight

        for n, p in self.model.named_parameters():
            p.copy_(self._row(state["model"][n]))
        optim = state["optim"]
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                prefix = f"state.{self.names[id(p)]}."
                self.optimizer.state[p] = {k[len(prefix):]: self._row(v) for k, v in optim.items()
                                           if k.startswith(prefix)}
        for gi, g in enumerate(self.optimizer.param_groups):
            for k in list(g):
                key = f"param_groups.{gi}.{k}"
                if k != "params" and key in optim:
                    g[k] = optim[key]
        dl, saved = self.diloco, state["diloco"]
        for i, (frag, gs, outer) in enumerate(zip(dl.frags, dl.globals, dl.outer, strict=True)):
            started = bool(saved[f"outer_started.{i}"])
            for name, g in zip(frag.names, gs, strict=True):
                g.copy_(saved[f"global.{name}"])
                if started:
                    outer.state[g]["momentum_buffer"] = saved[f"outer.{name}.momentum_buffer"].clone()
                else:
                    outer.state.pop(g, None)
        dl.committed = int(saved["counters"]["committed"])
        dl.local_step = int(saved["counters"]["local_step"])
        dl._inflight = None
        if saved["inflight"]:
            frag, flat = pickle.loads(saved["inflight"])
            device = dl.frags[frag].params[0].device
            dl._inflight = _InFlight(frag, flat.to(device), [])
