"""The one state format of Streaming DiLoCo, and its DCP checkpoint together with the model and inner optimizer.

:meth:`StreamingDiLoCo.state_dict() <lowband.diloco.StreamingDiLoCo.state_dict>` (built here by
:func:`diloco_state_dict`) returns a flat dict whose keys never depend on the rank, the replica or the
world size (``<fqn>`` = the parameter's first name in the model; tied parameters appear once)::

    counters                      {"committed": int, "local_step": int}
    inflight                      b"" or the pickled (fragment, its parameter names, averaged pseudo-gradient)
    outer_started.<i>             whether fragment i's outer optimizer has state yet (bool)
    global.<fqn>                  the global (outer) copy of the parameter
    outer.<fqn>.momentum_buffer   the outer SGD momentum (torch.optim.SGD outer optimizers with momentum)
    outer_opt.<i>                 other outer optimizers: their torch ``state_dict()``, serialized (bytes)
    residual.<fqn>                error feedback: this replica's residual of the parameter     (per replica)
    inflight_residual.<fqn>       error feedback: the residual an in-flight sync leaves        (per replica)

Everything but the two ``residual`` families is identical on every rank (every replica applies the
same averaged pseudo-gradient) and is a plain tensor / object. The residuals are private to a replica
(identical inside one, whose dp ranks hold the same weights): each is a ``DTensor`` of global shape
``(R, *shape)`` on a ``(replica, dp)`` device mesh with placements ``[Shard(0), Replicate()]`` (one
row per replica), a plain ``(1, *shape)`` tensor with one replica. So ``torch.distributed.checkpoint``
(``dcp.save`` / ``dcp.load`` into a fresh :meth:`state_dict` as template) stores every replica's own
residual and re-splits the dp dimension; a resumed run needs the same number of replicas (a
different count is refused by DCP's shape check, before anything is loaded). Building the mesh needs
the replica-major layout of :func:`lowband.diloco.replica_mesh` (``rank = replica * dp + dp_rank``);
with error feedback on, several replicas and another layout, :func:`diloco_state_dict` raises
``RuntimeError`` instead of writing a mislabeled checkpoint. Keys are per parameter, so a checkpoint
loads into another fragment split of the same model, unless a fragment is in flight (refused, naming
the fragment).

Row-sharded parameters (GTP inside a replica): when ``StreamingDiLoCo.state_layout`` is set (a
:class:`lowband.diloco.shards.GTPShardLayout`), every per-parameter value above (global copy, momentum,
residuals, and each parameter's piece of the in-flight buffer) is stored in its *logical* form: the
rank's row shard all-gathered over its GTP group to the whole, unpadded weight shape (identical on every
rank of the replica), and sliced back to the rank's padded shard at load. So the state is the same as
with whole parameters, and loads at another GTP size.

In-flight fragment (between a prepare and its sync, ``delay > 0``): saving waits for its all-reduce
(the values the sync would wait for later) and stores the averaged result and the residual it leaves;
loading re-creates the in-flight fragment with nothing left to wait for, so the resumed sync applies
exactly what the uninterrupted one applies.

:class:`DilocoCheckpoint` adds the replica's model and inner optimizer (per-replica ``DTensor`` rows
the same way) under ``model`` / ``optim`` and nests the DiLoCo state under ``diloco``: the DCP layout
the trainer's ``diloco`` strategy checkpoints. The inner part is the inner torch optimizer's state per
parameter (DDP inside), or the inner strategy's own checkpoint layout (sharded optimizer, GTP)
gathered to logical tensors inside the replica (the inner's ``logical_state_dict``: for sharded state,
one all-gather per state tensor per unit over the replica's dp group; for GTP, one all-gather per GTP
tensor over the gtp group, or a broadcast per GTP Muon momentum). Communication: besides those
gathers none of its own, except that the first per-replica ``DTensor`` creates the device mesh
(collective, every rank alike) and saving completes an in-flight all-reduce.
"""

from __future__ import annotations

import io
import pickle
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lowband.optim.sharded_state import group_hyperparams

if TYPE_CHECKING:
    from lowband.diloco.streaming import StreamingDiLoCo


# ------------------------------------------------------------------------------ per-replica rows
def replica_layout(comm: Any) -> tuple[int, int, int] | None:
    """``(replicas, dp, replica)`` of a cross-replica Comm laid out replica-major, else ``None``."""
    r = comm.size
    if not dist.is_initialized():
        return (1, 1, 0) if r == 1 else None
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % r:
        return None
    d = world // r
    ranks = dist.get_process_group_ranks(comm.group) if comm.group is not None else [rank]
    if list(ranks) != [i * d + rank % d for i in range(r)]:
        return None
    return r, d, rank // d


def per_replica(x: torch.Tensor, replicas: int, dp: int, meshes: dict) -> Any:
    """``x`` as this replica's row of an ``(R, *shape)`` tensor: a DTensor when there are several ranks
    (on a ``(replica, dp)`` device mesh created once per ``meshes`` cache, collectively)."""
    local = x.detach().unsqueeze(0).contiguous().clone()
    if replicas * dp == 1:
        return local
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    key = (x.device.type, replicas, dp)
    if key not in meshes:
        meshes[key] = init_device_mesh(x.device.type, (replicas, dp), mesh_dim_names=("replica", "dp"))
    shape = torch.Size((replicas, *x.shape))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, meshes[key], [Shard(0), Replicate()], run_check=False, shape=shape,
                              stride=stride)


def row(x: Any) -> torch.Tensor:
    """This replica's row of a :func:`per_replica` value (DTensor or plain ``(1, *shape)``)."""
    from torch.distributed.tensor import DTensor

    local = x.to_local() if isinstance(x, DTensor) else x
    return local[0].contiguous().clone()


# ------------------------------------------------------------------------------ StreamingDiLoCo
def _is_sgd(o: torch.optim.Optimizer) -> bool:
    return type(o) is torch.optim.SGD


def _split(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    out, off = [], 0
    for p in params:
        out.append(flat[off:off + p.numel()].view(p.shape))
        off += p.numel()
    return out


def _logical(dl: StreamingDiLoCo, name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` (a tensor of parameter ``name``'s local shape) in logical form (see ``state_layout``)."""
    lay = dl.state_layout
    return t if lay is None else lay.to_logical(name, t)


def _local(dl: StreamingDiLoCo, name: str, t: torch.Tensor) -> torch.Tensor:
    lay = dl.state_layout
    return t if lay is None else lay.to_local(name, t)


def _logical_shape(dl: StreamingDiLoCo, name: str, p: torch.Tensor) -> torch.Size:
    gw = None if dl.state_layout is None else dl.state_layout.weights.get(name)
    return p.shape if gw is None else torch.Size((gw.out_features, gw.in_features))


def _logical_flat(dl: StreamingDiLoCo, frag_i: int, flat: torch.Tensor) -> torch.Tensor:
    """A fragment's flat buffer (local shapes, concatenated) as the concatenation of the logical tensors."""
    if dl.state_layout is None:
        return flat
    frag = dl.frags[frag_i]
    parts = [_logical(dl, n, x).reshape(-1) for n, x in zip(frag.names, _split(flat, frag.params), strict=True)]
    return torch.cat(parts)


def _local_flat(dl: StreamingDiLoCo, frag_i: int, flat: torch.Tensor) -> torch.Tensor:
    if dl.state_layout is None:
        return flat
    frag = dl.frags[frag_i]
    parts, off = [], 0
    for n, p in zip(frag.names, frag.params, strict=True):
        shape = _logical_shape(dl, n, p)
        numel = shape.numel()
        if off + numel > flat.numel():
            raise ValueError(f"diloco load_state_dict: the in-flight buffer of fragment {frag_i} is shorter than "
                             "its parameters' logical sizes")
        parts.append(_local(dl, n, flat[off:off + numel].view(shape)).reshape(-1))
        off += numel
    return torch.cat(parts)


@torch.no_grad()
def diloco_state_dict(dl: StreamingDiLoCo) -> dict[str, Any]:
    """The state of ``dl`` in the format of this module (see the module docstring)."""
    layout = None
    if dl.error_feedback:
        layout = replica_layout(dl.comm)
        if layout is None:
            raise RuntimeError("diloco state_dict: error-feedback residuals are per replica and need the "
                               "replica-major (replica, dp) layout of lowband.diloco.replica_mesh to be labeled "
                               f"for torch.distributed.checkpoint; the cross-replica group {dl.comm.name!r} "
                               f"(size {dl.comm.size}) is laid out otherwise")
    inflight = b""
    infl = dl._inflight
    if infl is not None:
        dl._wait_inflight()  # same order on every rank; the sync's own wait is then a no-op
        flat = _logical_flat(dl, infl.fragment, infl.flat.detach())
        inflight = pickle.dumps((infl.fragment, list(dl.frags[infl.fragment].names), flat.cpu().clone()))
    out: dict[str, Any] = {"counters": {"committed": dl.committed, "local_step": dl.local_step},
                           "inflight": inflight}
    for i, (frag, gs, outer) in enumerate(zip(dl.frags, dl.globals, dl.outer, strict=True)):
        out[f"outer_started.{i}"] = any(bool(outer.state.get(g)) for g in gs)
        for name, g in zip(frag.names, gs, strict=True):
            out[f"global.{name}"] = _logical(dl, name, g.detach().clone())
        if _is_sgd(outer):
            if any(grp["momentum"] != 0 for grp in outer.param_groups):
                for name, g in zip(frag.names, gs, strict=True):
                    mom = outer.state.get(g, {}).get("momentum_buffer")
                    out[f"outer.{name}.momentum_buffer"] = _logical(dl, name, mom.detach().clone() if mom is not None
                                                                    else torch.zeros_like(g))
        else:
            if dl.state_layout is not None and dl.state_layout.weights:
                raise RuntimeError("diloco state_dict: outer optimizers other than torch.optim.SGD are saved as "
                                   "their serialized state, which cannot hold sharded (GTP) parameters")
            buf = io.BytesIO()
            torch.save(outer.state_dict(), buf)
            out[f"outer_opt.{i}"] = buf.getvalue()
        res = dl.residuals[i]
        if res is not None:
            assert layout is not None
            pending = (infl.residual if infl is not None and infl.fragment == i and infl.residual is not None
                       else torch.zeros_like(res))
            for name, r, q in zip(frag.names, _split(res, gs), _split(pending.to(res.device), gs), strict=True):
                out[f"residual.{name}"] = per_replica(_logical(dl, name, r), layout[0], layout[1], dl.dcp_meshes)
                out[f"inflight_residual.{name}"] = per_replica(_logical(dl, name, q), layout[0], layout[1],
                                                               dl.dcp_meshes)
    return out


@torch.no_grad()
def load_diloco_state_dict(dl: StreamingDiLoCo, state: dict[str, Any]) -> None:
    """Load :func:`diloco_state_dict` output into ``dl`` (``ValueError`` naming a missing key)."""
    from lowband.diloco.streaming import _InFlight

    def get(key: str) -> Any:
        if key not in state:
            raise ValueError(f"diloco load_state_dict: key {key!r} is missing (the state was saved with other "
                             "fragments, outer optimizer or error-feedback settings)")
        return state[key]

    for i, (frag, gs, outer) in enumerate(zip(dl.frags, dl.globals, dl.outer, strict=True)):
        for name, g in zip(frag.names, gs, strict=True):
            g.copy_(_local(dl, name, get(f"global.{name}")))
        if _is_sgd(outer):
            if any(grp["momentum"] != 0 for grp in outer.param_groups):
                started = bool(get(f"outer_started.{i}"))
                for name, g in zip(frag.names, gs, strict=True):
                    if started:
                        outer.state[g]["momentum_buffer"] = _local(dl, name, get(f"outer.{name}.momentum_buffer")
                                                                   ).to(g.device).clone()
                    else:
                        outer.state.pop(g, None)
        else:
            outer.load_state_dict(torch.load(io.BytesIO(get(f"outer_opt.{i}")), weights_only=True))
        res = dl.residuals[i]
        if res is not None:
            for name, r in zip(frag.names, _split(res, gs), strict=True):
                r.copy_(_local(dl, name, row(get(f"residual.{name}"))))
    dl.committed = int(get("counters")["committed"])
    dl.local_step = int(get("counters")["local_step"])
    dl._inflight = None
    blob = get("inflight")
    if blob:
        frag_i, names, flat = pickle.loads(blob)
        if frag_i >= dl.num_fragments or list(dl.frags[frag_i].names) != list(names):
            raise ValueError(f"diloco load_state_dict: fragment {frag_i} was in flight when saved, with parameters "
                             f"{names[:3]}...; this instance's fragments differ; resume with the saved split")
        frag = dl.frags[frag_i]
        pending = None
        if dl.residuals[frag_i] is not None:
            pending = torch.cat([_local(dl, n, row(get(f"inflight_residual.{n}"))).reshape(-1) for n in frag.names])
            pending = pending.to(device=frag.params[0].device, dtype=dl.buffer_dtypes[frag_i])
        flat = _local_flat(dl, frag_i, flat)
        dl._inflight = _InFlight(frag_i, flat.to(frag.params[0].device), [], pending,
                                 bool(torch.isfinite(flat).all()))


# ------------------------------------------------------------------------------ DCP checkpoint
class DilocoCheckpoint:
    """Model + inner optimizer + :class:`~lowband.diloco.StreamingDiLoCo` of one rank, for DCP.

    ``state_dict()`` = ``{"model": {fqn: row}, "optim": {...}, "diloco": StreamingDiLoCo.state_dict()}``,
    where a *row* is a :func:`per_replica` value (the model and the inner optimizer state differ between
    replicas and are identical inside one). Save with ``dcp.save(ckpt.state_dict(), ...)``; resume by
    ``sd = ckpt.state_dict(); dcp.load(sd, ...); ckpt.load_state_dict(sd)``.

    Two sources of the inner part:

    * ``inner=None`` (DDP inside a replica): the inner torch optimizer's own state per parameter,
      ``"optim": {"state.<fqn>.<key>": row, "param_groups.<g>.<hyper>": value}``. It must keep its state
      per parameter as tensors (torch AdamW / SGD / Adam ...; missing state before the first step is
      written as AdamW-shaped zeros only for AdamW-like optimizers).
    * ``inner=`` an object with ``state_dict()`` / ``load_state_dict(state)`` in the ``{"model": {fqn: ...},
      "optim": {key: ...}}`` shape (a sharded inner strategy's
      :class:`~lowband.optim.sharded_state.ShardedStateLayout`, GTP's
      :class:`~lowband.parallel.gtp_state.GTPStateLayout`, i.e. the inner strategy itself): its values are
      made *logical*, the same full tensor on every rank of the replica (an inner with a
      ``logical_state_dict()``, the sharded and GTP strategies, is asked for that gathered form instead of
      its rank-local ``state_dict()``: ``tag="state"`` / ``"gtp:state"``; ``Shard(0)`` DTensors over
      ``inner_comm`` are all-gathered through it), and every tensor becomes a row;
      other values (hyperparameters) stay plain. Loading hands the rows back as full tensors to
      ``inner.load_state_dict``, which keeps this rank's part. So the inner layout inside a replica may change
      between save and resume (dp or gtp size), the replica count may not. Transiently every rank holds its
      replica's full inner state (as the inner layouts themselves do). The DiLoCo hooks are paused meanwhile
      (``StreamingDiLoCo.paused``), so a zero-lr initialization step of torch's ``get_state_dict`` is not
      counted as an inner step.

    Args:
        model: the plain replica model (not a DDP wrapper).
        optimizer: the inner optimizer.
        diloco: the StreamingDiLoCo driving it.
        num_replicas, dp_size, replica: the mesh (``dp_size`` = ranks per replica) and this rank's replica
            (replica-major ranks).
        inner: the inner state layout (see above), or ``None``.
        inner_comm: the Comm over which ``inner``'s ``Shard(0)`` DTensors are sharded (the replica's dp
            group); needed only when they are.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, diloco: StreamingDiLoCo,
                 num_replicas: int, dp_size: int, replica: int, *, inner: Any = None, inner_comm: Any = None) -> None:
        self.model, self.optimizer, self.diloco = model, optimizer, diloco
        self.r, self.d, self.replica = num_replicas, dp_size, replica
        self.inner, self.inner_comm = inner, inner_comm
        self.names = {id(p): n for n, p in model.named_parameters()}

    def _inner_state(self, p: torch.Tensor) -> dict[str, Any]:
        st = self.optimizer.state.get(p)
        if st:
            return st
        from torch.optim.optimizer import _get_scalar_dtype

        return {"step": torch.tensor(0.0, dtype=_get_scalar_dtype()), "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p)}

    def _row(self, v: torch.Tensor) -> Any:
        return per_replica(v, self.r, self.d, self.diloco.dcp_meshes)

    def _logical(self, values: dict[str, Any]) -> dict[str, Any]:
        """``values`` with every ``DTensor`` gathered to its full tensor (through ``inner_comm``)."""
        from torch.distributed.tensor import DTensor

        if not any(isinstance(v, DTensor) for v in values.values()):
            return dict(values)
        if self.inner_comm is None:
            raise RuntimeError("DilocoCheckpoint: the inner state holds DTensors but no inner_comm was given")
        from lowband.optim.sharded_state import Shard0

        if getattr(self, "_shard0", None) is None:
            self._shard0 = Shard0(self.inner_comm)
        return self._shard0.gather(values)

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        diloco = self.diloco.state_dict()  # first: completes an in-flight all-reduce
        if self.inner is not None:
            with self.diloco.paused():  # the gathered form where the inner layout saves rank-local chunks
                sd = getattr(self.inner, "logical_state_dict", self.inner.state_dict)()
            model = {n: self._row(v) for n, v in self._logical(sd["model"]).items()}
            optim = {k: self._row(v) if isinstance(v, torch.Tensor) else v
                     for k, v in self._logical(sd.get("optim", {})).items()}
            return {"model": model, "optim": optim, "diloco": diloco}
        model = {n: self._row(p) for n, p in self.model.named_parameters()}
        optim: dict[str, Any] = {}
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                for k, v in self._inner_state(p).items():
                    optim[f"state.{self.names[id(p)]}.{k}"] = self._row(v)
        optim.update(group_hyperparams(self.optimizer.param_groups))
        return {"model": model, "optim": optim, "diloco": diloco}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.inner is not None:
            model = {n: row(v) for n, v in state["model"].items()}
            optim = {k: row(v) if isinstance(v, torch.Tensor) else v for k, v in state["optim"].items()}
            with self.diloco.paused():
                self.inner.load_state_dict({"model": model, "optim": optim})
            self.diloco.load_state_dict(state["diloco"])
            return
        for n, p in self.model.named_parameters():
            p.copy_(row(state["model"][n]))
        optim = state["optim"]
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                prefix = f"state.{self.names[id(p)]}."
                self.optimizer.state[p] = {k[len(prefix):]: row(v) for k, v in optim.items()
                                           if k.startswith(prefix)}
        for gi, g in enumerate(self.optimizer.param_groups):
            for k in list(g):
                key = f"param_groups.{gi}.{k}"
                if k != "params" and key in optim:
                    g[k] = optim[key]
        self.diloco.load_state_dict(state["diloco"])
