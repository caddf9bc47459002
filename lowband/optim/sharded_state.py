"""Checkpoint layout of :class:`lowband.optim.ShardedOptimizer` state for ``torch.distributed.checkpoint``.

The optimizer owns contiguous ranges of flat buckets whose boundaries depend on the world size and
``bucket_mb``; those ranges are not a DTensor placement. Its checkpoint state is stored **per parameter,
in the parameter's logical shape**, so DCP reshards it to any world size:

* :class:`ShardedStateLayout` (what lowband's trainer saves) puts the state under flat string keys next
  to the model's parameters, ``{"model": {fqn: tensor}, "optim": {"state.<fqn>.<key>": ...,
  "param_groups.<g>.<hyper>": ...}}``. Each state tensor is a :class:`lowband.dcp_chunks.LocalChunks`:
  this rank's owned elements only, as rectangular boxes of the logical shape that are views into the
  optimizer's own state buffers (an AdamW unit's owned flat range cut at the parameter's bounds, at most
  ``2 * (ndim - 1) + 1`` boxes; a Muon unit's whole matrices in this rank's slots), saved in chunks of at
  most 16 MiB on a grid fixed in the parameter's coordinates. ``dcp.save`` writes what each rank owns;
  ``dcp.load`` into a fresh template reads only the saved chunks that overlap what the rank owns and
  writes them in place. Files of the earlier gathered layout (``Shard(0)`` DTensors per parameter, the
  same keys and logical shapes) load into it, and vice versa.
* :meth:`ShardedOptimizer.state_dict` returns ``{"state": {param_index: {...}}, "param_groups": [...]}``
  in ``torch.optim`` format, every state tensor a ``Shard(0)`` DTensor (a plain tensor on one rank, and a
  0-d parameter's state, which has no rows, a plain 0-d tensor on every rank), ``step`` a replicated float32
  scalar. So torch's own
  ``torch.distributed.checkpoint.state_dict.get_state_dict(model, opt)`` / ``set_state_dict`` and
  ``dcp.save`` / ``dcp.load`` work on it, including a reshard to another world size; it gathers (below).

Per-parameter keys: AdamW ``step``, ``exp_avg``, ``exp_avg_sq``; Muon ``momentum_buffer``; plus
``master`` (the owner's fp32 master copy) where the optimizer keeps one (``param_wire_dtype`` narrower
than the parameters, or parameters narrower than fp32). A parameter whose unit has not stepped yet
gets what its first step would create (zeros, step 0, the parameter itself as master), so a template
always has every key.

Communication: :class:`ShardedStateLayout`'s ``state_dict`` / ``load_state_dict`` issue none (DCP's own
planning collectives only: metadata, no tensor data); each rank holds at most one saved chunk (16 MiB)
beyond its own state while saving, and about twice that while loading. Its
:meth:`~ShardedStateLayout.logical_state_dict` (whole tensors, for inspection and tests; DiLoCo's
checkpoint uses the rank-local form) gathers the state with :meth:`ShardedOptimizer.full_state_dict` (one
all-gather per state tensor per unit, ``tag="state"``; transiently the whole state on every rank). The
torch-API :meth:`ShardedOptimizer.state_dict` (``Shard(0)`` chunks) and its :meth:`~ShardedOptimizer.load_state_dict`
do not gather: each element moves once between its owner and its ``Shard(0)`` holder, one ``all_to_all`` per
unit (``tag="state"``, :mod:`lowband.optim.sharded_exchange`): the result (about ``1/N`` of the state) plus one
unit's buffers held per rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lowband.buffers import drop_unsaved, persistent_buffers
from lowband.comm import Comm
from lowband.dcp_chunks import LocalChunks, local_chunks
from lowband.optim.sharded_exchange import chunk_rows, state_keys

if TYPE_CHECKING:
    from lowband.optim.sharded import ShardedOptimizer

_GROUP_TYPES = (int, float, str, bool, tuple, type(None), torch.dtype)


def group_hyperparams(param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"param_groups.<g>.<key>": value}`` for every plain hyper-parameter (number, string, bool, tuple,
    None, dtype) of every param group: the flat, rank-independent keys under which each lowband state
    layout saves an optimizer's hyper-parameters (``lr`` included, so a resumed LR schedule continues)."""
    return {f"param_groups.{gi}.{k}": v for gi, g in enumerate(param_groups) for k, v in g.items()
            if k != "params" and isinstance(v, _GROUP_TYPES)}


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
        """This rank's ``torch.chunk`` rows of ``full`` as a ``Shard(0)`` DTensor (a copy on one rank, and for a
        0-d tensor, which has no rows: a plain tensor, the same on every rank, which DCP writes once)."""
        if self.comm.size == 1 or full.dim() == 0:
            return full.detach().clone()
        from torch.distributed.tensor import DTensor, Shard

        full = full.detach().contiguous()
        lo, hi = chunk_rows(full.shape[0], self.comm.size, self.comm.rank)
        out = DTensor.from_local(full[lo:hi].clone(), self._mesh_for(full.device), [Shard(0)], run_check=False,
                                 shape=full.shape, stride=full.stride())
        # which rank's chunk this is (pickled with it): ShardedOptimizer.load_state_dict refuses it elsewhere
        out._lowband_shard_of = (self.comm.rank, self.comm.size)  # type: ignore[attr-defined]
        return out

    def wrap(self, local: torch.Tensor, shape: tuple[int, ...]) -> Any:
        """``local`` (this rank's ``torch.chunk`` rows of a tensor of ``shape``) as a ``Shard(0)`` DTensor,
        stamped like :meth:`shard`'s (no copy, no communication); a 0-d ``shape`` has no rows: ``local`` itself,
        the whole tensor every rank holds, as :meth:`shard` returns it."""
        from torch.distributed.tensor import DTensor, Shard

        if not shape:
            return local

        stride = torch.empty(shape, device="meta").stride()
        out = DTensor.from_local(local, self._mesh_for(local.device), [Shard(0)], run_check=False,
                                 shape=torch.Size(shape), stride=stride)
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
            lo, hi = chunk_rows(shape[0], n, rank) if shape else (0, 0)
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
                    lo, hi = chunk_rows(shape[0], n, r)
                    pieces.append(parts[r, off:off + (hi - lo) * row])
                out[k] = torch.cat(pieces).view(shape).clone()
                off += size
        return out


class ShardedStateLayout:
    """A model and its :class:`ShardedOptimizer` as one flat, world-size-independent checkpoint dict.

    ``state_dict()`` (no communication) returns::

        {"model": {fqn: parameter or persistent buffer},   every rank holds each whole (buffers: this rank's)
         "optim": {"state.<fqn>.<key>": LocalChunks | float32 scalar ("step"),
                   "param_groups.<g>.<hyper>": value}}   (lr, betas, algorithm, ...; replicated)

    Each ``LocalChunks`` (:mod:`lowband.dcp_chunks`) has the parameter's logical shape and holds, as
    views into the optimizer's own state buffers, the part this rank owns: for an AdamW unit, the owned
    flat range of the bucket intersected with the parameter (at most ``2 * (ndim - 1) + 1`` boxes); for a
    Muon unit, the whole matrices in this rank's slots; nothing for a parameter the rank owns no element
    of. The model entries are the parameters themselves (``detach()``ed, no copy). So ``dcp.save`` writes
    what each rank owns and ``dcp.load`` into a fresh ``state_dict()`` writes the owned elements straight
    into the optimizer state and the parameters, at any world size. A unit that has not stepped yet is
    given the state its first step would create (zero moments / momentum, step 0, its fp32 master the
    parameter), so a template always has every key.

    ``load_state_dict(state)`` (no communication) applies such a dict after ``dcp.load`` filled it (values
    already in place are left as they are), or one holding plain full tensors in the same keys (the
    gathered form of :meth:`logical_state_dict`, or files DiLoCo's checkpoint wrote before it was rank-local):
    it takes this rank's part of each. Parameters are named by ``model.named_parameters()`` (a tied
    parameter by its first name). See the module docstring for the per-parameter keys.

    ``include_buffers`` (default ``True``): the model's persistent buffers (what ``model.state_dict()`` holds
    besides parameters: BatchNorm running statistics, counters) are ``"model"`` entries too, as plain tensors
    (DCP writes rank 0's; buffers that differ per rank need a per-rank save of their own, as lowband's trainer
    does, which passes ``False``). :meth:`fit_template` fits a template to a checkpoint saved without them.
    """

    def __init__(self, model: nn.Module, optimizer: ShardedOptimizer, *, include_buffers: bool = True) -> None:
        self.model, self.optimizer = model, optimizer
        self.include_buffers = include_buffers
        names = {id(p): n for n, p in model.named_parameters()}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        missing = [i for i, p in enumerate(params) if id(p) not in names]
        if missing:
            raise ValueError(f"ShardedStateLayout: optimizer parameters {missing} are not parameters of the model")
        self.names = [names[id(p)] for p in params]

    # ------------------------------------------------------------------------------ local state
    def _ensure_state(self) -> None:
        """Create, for every unit without it, the state its first step would create (no communication)."""
        opt = self.optimizer
        rank = opt.comm.rank
        for ui, unit in enumerate(opt._units):
            lay, st = unit.layout, opt.state[ui]
            if lay.kind == "adamw":
                if not st:
                    st.update(opt._new_adamw_state(unit))
                lo, hi = lay.owner_range(rank)
                opt._master(unit, unit.param_buf[lo:hi], st)
            else:
                assert lay.matrix_shape is not None and lay.real_per_rank is not None
                rows, cols = lay.matrix_shape
                c, real = lay.slots_per_rank, lay.real_per_rank[rank]
                if not st:
                    st["momentum_buffer"] = torch.zeros(real, rows, cols, dtype=unit.grad_shard.dtype,
                                                        device=unit.grad_shard.device)
                if real:
                    opt._master(unit, unit.param_buf.view(-1, rows, cols)[rank * c:rank * c + real], st)

    def _owned(self) -> list[tuple[int, int, dict[str, Any], list[tuple[str, torch.Tensor | None, int, int]]]]:
        """Per unit member: ``(ui, mi, unit state, [(key, dst, a, b)])``: ``dst`` is the 1-D view of the
        unit's state tensor ``key`` holding the member's logical flat elements ``[a, b)`` this rank owns
        (``None`` when it owns none)."""
        opt = self.optimizer
        rank = opt.comm.rank
        out = []
        for ui, unit in enumerate(opt._units):
            lay, st = unit.layout, opt.state[ui]
            keys = state_keys(opt, ui)  # the master on every rank alike (one owning no Muon matrix has none)
            if lay.kind == "adamw":
                lo, hi = lay.owner_range(rank)
                for mi, m in enumerate(lay.members):
                    a, b = max(lo, m.offset), min(hi, m.offset + m.numel)
                    out.append((ui, mi, st, [(k, st[k][a - lo:b - lo] if a < b else None, a - m.offset,
                                              b - m.offset) for k in keys]))
            else:
                slot = {mi: j for j, mi in enumerate(opt._owned_members(lay, rank))}
                for mi, m in enumerate(lay.members):
                    j = slot.get(mi)
                    out.append((ui, mi, st, [(k, st[k][j].view(-1) if j is not None else None, 0,
                                              m.numel if j is not None else 0) for k in keys]))
        return out

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """The checkpoint dict (see the class docstring); creates missing state; no communication."""
        opt = self.optimizer
        opt.wait_for_params()
        self._ensure_state()
        params = [p for g in opt.param_groups for p in g["params"]]
        model = {n: p.detach() for n, p in self.model.named_parameters()}
        model.update({n: b.detach() for n, b in self._buffers()})
        state: dict[int, dict[str, Any]] = {}
        for ui, mi, st, parts in self._owned():
            m = opt._units[ui].layout.members[mi]
            p = params[m.index]
            entry: dict[str, Any] = {}
            if "steps" in st:
                entry["step"] = torch.tensor(float(st["steps"][mi]), dtype=torch.float32)
            acc = opt._units[ui].grad_shard
            for key, dst, a, b in parts:
                if dst is None:
                    entry[key] = LocalChunks(p.shape, [], dtype=acc.dtype, device=acc.device)
                else:
                    entry[key] = local_chunks(p.shape, a, b, dst)
            state[m.index] = entry
        optim: dict[str, Any] = {}
        for idx in sorted(state):
            for k, v in state[idx].items():
                optim[f"state.{self.names[idx]}.{k}"] = v
        optim.update(group_hyperparams(opt._packed_groups()))
        return {"model": model, "optim": optim}

    def logical_state_dict(self) -> dict[str, Any]:
        """The same keys as :meth:`state_dict` with every state tensor whole (the parameter's shape) and
        every value a copy: ``ShardedOptimizer.logical_state_dict`` (collective: one all-gather per state
        tensor per unit, ``tag="state"``; every rank holds the whole optimizer state meanwhile). For
        inspection and tests; :meth:`load_state_dict` takes it."""
        full = self.optimizer.logical_state_dict()
        optim: dict[str, Any] = {}
        for idx, st in full["state"].items():
            for k, v in st.items():
                optim[f"state.{self.names[idx]}.{k}"] = v
        optim.update(group_hyperparams(full["param_groups"]))
        model = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        model.update({n: b.detach().clone() for n, b in self._buffers()})
        return {"model": model, "optim": optim}

    def _buffers(self) -> list[tuple[str, torch.Tensor]]:
        return persistent_buffers(self.model) if self.include_buffers else []

    def fit_template(self, state: dict[str, Any], saved_keys: set[str]) -> list[str]:
        """Drop from a fresh :meth:`state_dict` (the load template) the buffer entries a checkpoint saved without
        buffers lacks (``saved_keys``: its flattened DCP keys, relative to this state), so ``dcp.load`` does not
        stop at a missing key; :meth:`load_state_dict` then leaves those buffers as they are. Returns the dropped
        names. No communication."""
        return drop_unsaved(state.get("model", {}), (n for n, _b in self._buffers()), saved_keys)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Apply a filled :meth:`state_dict` template, or :meth:`logical_state_dict`'s whole tensors (see
        the class docstring); no communication. A parameter whose state is missing starts as before its
        first step."""
        opt = self.optimizer
        opt.wait_for_params()
        for n, p in self.model.named_parameters():
            v = state["model"][n]
            if not _same_memory(v, p):
                p.copy_(v)  # a view into the optimizer's flat parameter buffer
        for n, b in self._buffers():
            if n in state["model"] and not _same_memory(state["model"][n], b):
                b.copy_(state["model"][n])
        optim = state["optim"]
        index = {n: i for i, n in enumerate(self.names)}
        for key in optim:
            if key.startswith("state.") and key[len("state."):].rsplit(".", 1)[0] not in index:
                raise ValueError(f"ShardedStateLayout.load_state_dict: {key!r} names no optimizer parameter")
        groups = []
        start = 0
        for gi, g in enumerate(opt.param_groups):
            packed = {k: optim.get(f"param_groups.{gi}.{k}", v) for k, v in g.items() if k != "params"}
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        opt._load_groups(groups, "ShardedStateLayout.load_state_dict")
        self._ensure_state()
        params = [p for g in opt.param_groups for p in g["params"]]
        rank = opt.comm.rank
        for ui, mi, st, parts in self._owned():
            unit = opt._units[ui]
            m = unit.layout.members[mi]
            prefix = f"state.{self.names[m.index]}."
            if "steps" in st:
                step = optim.get(prefix + "step")
                st["steps"][mi] = int(float(step)) if step is not None else 0
            for key, dst, a, b in parts:
                if dst is None:
                    continue
                v = optim.get(prefix + key)
                if v is None:  # as before the member's first step
                    if key == "master":
                        dst.copy_(params[m.index].detach().reshape(-1)[a:b])
                    else:
                        dst.zero_()
                elif isinstance(v, LocalChunks):
                    _take_pieces(v, dst, a, b, prefix + key)
                elif type(v) is torch.Tensor or isinstance(v, nn.Parameter):
                    if v.numel() != m.numel:
                        raise ValueError(f"ShardedStateLayout.load_state_dict: {prefix + key!r} has "
                                         f"{v.numel()} elements, the parameter {m.numel}")
                    dst.copy_(v.reshape(-1)[a:b])
                else:
                    raise TypeError(f"ShardedStateLayout.load_state_dict: {prefix + key!r} is a {type(v).__name__}; "
                                    "expected the LocalChunks of this layout's state_dict() or a whole tensor")
        for ui, unit in enumerate(opt._units):  # bucket padding past the last member: as a fresh state
            lay = unit.layout
            if lay.kind != "adamw":
                continue
            lo, hi = lay.owner_range(rank)
            end = max(lo, min(hi, max(m.offset + m.numel for m in lay.members)))
            if end < hi:
                st = opt.state[ui]
                st["exp_avg"][end - lo:].zero_()
                st["exp_avg_sq"][end - lo:].zero_()
                if "master" in st:
                    st["master"][end - lo:].copy_(unit.param_buf[end:hi])


def _same_memory(a: Any, b: torch.Tensor) -> bool:
    return (type(a) is torch.Tensor or isinstance(a, nn.Parameter)) and a.device == b.device \
        and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _take_pieces(v: LocalChunks, dst: torch.Tensor, a: int, b: int, key: str) -> None:
    """Copy ``v``'s pieces into ``dst`` (the logical flat elements ``[a, b)``), unless they are views of it
    already (the template :meth:`ShardedStateLayout.state_dict` made, filled in place)."""
    mine = local_chunks(v.shape, a, b, dst)
    theirs = {o: t for o, t in v.pieces}
    if len(theirs) != len(mine.pieces):
        raise ValueError(f"ShardedStateLayout.load_state_dict: {key!r} does not hold this rank's part "
                         "(pass the template this layout's state_dict() returned, filled by dcp.load)")
    for o, t in mine.pieces:
        src = theirs.get(o)
        if src is None or src.shape != t.shape:
            raise ValueError(f"ShardedStateLayout.load_state_dict: {key!r} does not hold this rank's part "
                             "(pass the template this layout's state_dict() returned, filled by dcp.load)")
        if src.data_ptr() != t.data_ptr() or src.stride() != t.stride():  # else filled in place already
            t.copy_(src)
