"""The state format of Streaming DiLoCo, and its DCP checkpoint together with the model and inner optimizer.

:func:`diloco_state_dict` returns a flat dict whose keys never depend on the rank, the replica or the
world size (``<fqn>`` = the parameter's first name in the model; tied parameters appear once)::

    counters                      {"committed": int, "local_step": int}
    inflight                      b"" or the pickled (fragment, its parameter names, averaged pseudo-gradient
                                  or None when it is stored per parameter below)
    outer_started.<i>             whether fragment i's outer optimizer has state yet (bool)
    global.<fqn>                  the global (outer) copy of the parameter
    outer.<fqn>.momentum_buffer   the outer SGD momentum (torch.optim.SGD outer optimizers with momentum)
    outer_opt.<i>                 other outer optimizers: their torch ``state_dict()``, serialized (bytes)
    inflight_avg.<fqn>            rank-local form, row-sharded parameters, delay > 0: the parameter's part of
                                  the in-flight averaged pseudo-gradient (zeros outside the in-flight fragment)
    residual.<fqn>                error feedback: this replica's residual of the parameter     (per replica)
    inflight_residual.<fqn>       error feedback: the residual an in-flight sync leaves        (per replica)
    weights_digest.<fqn>          logical form, replica-major layout: digests of the rows of this replica's
                                  weights when it saved (:func:`lowband.diloco.row_digest.row_digests` of
                                  the whole parameter; a GTP shard digests its own rows and the digests are
                                  gathered, not the rows; per replica); the first inner step after loading
                                  refuses weights whose rows differ (a model file of another replica or step)
    saved_by_replica              logical form, replica-major layout: the index of the replica that saved it
                                  (per replica; a row loaded on another replica is refused: replicas differ
                                  between syncs. Files of the previous version name it ``residual_owner``)

Everything but the ``residual`` families is identical on every replica (every replica applies the
same averaged pseudo-gradient). The residuals are private to a replica (identical on ranks holding the
same elements inside one): each is stored as one tensor of shape ``(R, *shape)``, replica ``j``'s row
at leading offset ``j``, so ``torch.distributed.checkpoint`` (``dcp.save`` / ``dcp.load`` into a fresh
state dict as template) stores every replica's own residual and reshards inside a replica; a resumed
run needs the same number of replicas (a different count is refused by DCP's shape check, before
anything is loaded). Labeling a row needs the replica-major layout of :func:`lowband.diloco.replica_mesh`
(``rank = replica * dp + dp_rank``); with error feedback on, several replicas and another layout,
:func:`diloco_state_dict` raises ``RuntimeError`` instead of writing a mislabeled checkpoint. Keys are
per parameter, so a checkpoint loads into another fragment split of the same model, unless a fragment is
in flight (refused, naming the fragment).

Two forms of the same keys and logical shapes (each loads from a file the other wrote, except below):

* **rank-local** (``diloco_state_dict(dl, rank_local=True)``, what :class:`DilocoCheckpoint` saves):
  every tensor is this rank's own elements as views of the live state, no copy. With whole parameters
  a value is the plain tensor (every rank holds it; DCP writes it once); with row-sharded parameters
  (GTP inside a replica: ``StreamingDiLoCo.state_layout`` is a
  :class:`lowband.diloco.state.GTPShardLayout`) a per-parameter value is a
  :class:`lowband.dcp_chunks.LocalChunks` of the whole, unpadded weight shape holding this rank's real
  rows (the same pieces on every replica: DCP writes them once); a per-replica value is lifted under the
  replica coordinate (:func:`lowband.dcp_chunks.lift_chunks`: pieces at ``(replica, *offsets)``). A
  load into such a template reads only the saved chunks overlapping what the rank owns now, at any GTP
  size. The in-flight averaged pseudo-gradient of whole parameters is the same on every rank and stays
  in the ``inflight`` blob; with row-sharded parameters and ``delay > 0`` it is stored per parameter in
  ``inflight_avg.<fqn>``, for every parameter (a template cannot know which fragment a file has in
  flight, so these keys are always present: one logical copy of the model, zeros outside the in-flight
  fragment). Communication: none, except completing an in-flight all-reduce.
* **logical** (``rank_local=False``, what :meth:`StreamingDiLoCo.state_dict()
  <lowband.diloco.StreamingDiLoCo.state_dict>` returns, for inspection and the earlier file format):
  copies; row shards all-gathered over their GTP group to whole weights (``tag="diloco:state"``, every
  rank of the group); residuals as ``DTensor`` rows (``[Shard(0), Replicate()]`` on a ``(replica, dp)``
  device mesh, created collectively on first use), a plain ``(1, *shape)`` tensor with one replica; the
  in-flight buffer (whole weights) in the blob.

:func:`load_diloco_state_dict` takes either (a filled rank-local template, a logical dict, or files of
the earlier, gathered format loaded into a rank-local template), with no communication: this rank's
rows of a whole logical tensor are sliced out, its padded shard rebuilt from rank-local chunks (pad rows
zero). Files of the gathered format with row-sharded parameters and ``delay > 0`` lack
``inflight_avg.<fqn>``: :meth:`DilocoCheckpoint.fit_template` drops those keys from the template before
``dcp.load`` (the trainer does, from the checkpoint's metadata), and the in-flight fragment is read from
the blob, where those files kept it in logical form.

In-flight fragment (between a prepare and its sync, ``delay > 0``): saving waits for its all-reduce
(the values the sync would wait for later) and stores the averaged result and the residual it leaves;
loading re-creates the in-flight fragment with nothing left to wait for, so the resumed sync applies
exactly what the uninterrupted one applies.

:class:`DilocoCheckpoint` adds the replica's model and inner optimizer under ``model`` / ``optim`` and
nests the rank-local DiLoCo state under ``diloco``: the DCP layout the trainer's ``diloco`` strategy
checkpoints. The inner part is the inner torch optimizer's state per parameter (DDP inside), or the
inner strategy's own rank-local checkpoint layout (sharded optimizer: owned flat ranges; GTP: real rows;
GTP Muon: a momentum on its owner), every tensor lifted to a per-replica row ``(R, *logical shape)``. No
state is gathered or broadcast at save or load; DCP reshards inside a replica (dp or GTP size).
"""

from __future__ import annotations

import io
import math
import pickle
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lowband.dcp_chunks import LocalChunks, lift_chunks, lower_chunks, whole_or_chunks
from lowband.diloco.row_digest import row_digests
from lowband.optim.sharded_state import group_hyperparams
from lowband.parallel.gtp import GTPWeight, is_gtp_param
from lowband.parallel.gtp_state import gather_logical
from lowband.sharding import Placement, from_state, logical_boxes, placement_of, to_state

if TYPE_CHECKING:
    from lowband.diloco.streaming import StreamingDiLoCo


# ------------------------------------------------------------------------------ row-sharded (GTP) parameters
class GTPShardLayout:
    """Logical <-> local (row shard) tensors of the GTP parameters of ``model``, by parameter name.

    With GTP inside a replica a DiLoCo parameter is this rank's row shard of a weight, and so are its global
    copy, outer momentum, residual and piece of an in-flight buffer. This layout describes each in the
    weight's logical (whole, unpadded) shape, so the state loads at any GTP size: :meth:`to_chunks` (what
    checkpoints save: this rank's real rows as ``LocalChunks``, views, no copy) and :meth:`from_saved` (back
    to the padded shard, pad rows zero); :meth:`to_logical` (the whole tensor, for
    :meth:`StreamingDiLoCo.state_dict`) and :meth:`to_local`. Parameters that are not GTP shards pass through.

    Communication: :meth:`to_logical` all-gathers the shard over the weight's GTP group
    (``tag="diloco:state"``; every rank of that group calls it for the same names in the same order); the
    other methods have none.

    Args:
        model: the GTP model (names as ``named_parameters()`` gives them: DiLoCo's fragment names).
    """

    def __init__(self, model: nn.Module) -> None:
        self.weights: dict[str, GTPWeight] = {n: p.gtp for n, p in model.named_parameters() if is_gtp_param(p)}
        self.placements: dict[str, Placement] = {n: placement_of(gw.param) for n, gw in self.weights.items()}

    def to_logical(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The whole (unpadded) tensor of which ``local`` is this rank's shard (collective over the GTP group)."""
        gw = self.weights.get(name)
        return local if gw is None else gather_logical(gw, local, tag="diloco:state")

    def to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's padded row shard of the logical ``full`` (``ValueError`` on a wrong shape)."""
        pl = self.placements.get(name)
        return full if pl is None else from_state(pl, full, what=f"diloco checkpoint: {name}")

    def to_chunks(self, name: str, local: torch.Tensor) -> Any:
        """``local`` (this rank's padded shard of ``name``, or a tensor of its shape) as a ``LocalChunks`` of
        the logical shape holding its real rows, views of ``local`` (no copy, no communication); a
        parameter that is not a GTP shard: ``local`` itself."""
        pl = self.placements.get(name)
        return local if pl is None else to_state(pl, local, what=f"diloco state {name}")

    def from_saved(self, name: str, saved: torch.Tensor) -> torch.Tensor:
        """This rank's padded shard (pad rows zero) from a :meth:`to_chunks` template filled by ``dcp.load``
        or from a whole logical tensor (``ValueError`` naming ``name`` when it fits neither); no
        communication. A parameter that is not a GTP shard: ``saved`` itself."""
        pl = self.placements.get(name)
        return saved if pl is None else from_state(pl, saved, what=f"diloco checkpoint: {name}")

    def logical_numel(self, name: str, local: torch.Tensor) -> int:
        pl = self.placements.get(name)
        return local.numel() if pl is None else math.prod(pl.shape)

    def row_runs(self, name: str) -> list[tuple[int, int, int]] | None:
        """``[(logical_row, local_row, rows)]``: the whole rows of the logical tensor that this rank's shard of
        ``name`` holds, and where they sit in it (:func:`lowband.sharding.logical_boxes`; pad rows are in
        none); ``None`` when ``name`` is not a GTP shard. No communication."""
        pl = self.placements.get(name)
        if pl is None:
            return None
        runs = []
        for log, loc, sizes in logical_boxes(pl):
            if any(o != 0 for o in log[1:]) or tuple(sizes[1:]) != tuple(pl.shape[1:]):
                raise ValueError(f"diloco state {name}: its placement cuts more than rows ({pl}); row digests "
                                 "need whole rows")
            runs.append((log[0], loc[0], sizes[0]))
        return runs

    def logical_row_digests(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """:func:`lowband.diloco.row_digest.row_digests` of the logical tensor of which ``local`` is this
        rank's shard, without gathering it: each rank digests its own rows and the ``shard_rows`` digests are
        all-gathered over the weight's GTP group (``tag="diloco:state"``, 8 bytes a row; collective like
        :meth:`to_logical`). Not a GTP shard: ``row_digests(local)``."""
        gw = self.weights.get(name)
        mine = row_digests(local)
        if gw is None:
            return mine
        out = torch.empty(gw.padded_out, dtype=mine.dtype, device=mine.device)
        gw.runtime.state_gather(out, mine.contiguous(), f"{name!r} (its row digests)", tag="diloco:state")
        return out[: gw.out_features].clone()


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
    """``x`` as this replica's row of an ``(R, *shape)`` tensor: a DTensor when there are several ranks,
    sharded over the first dimension of the device mesh ``meshes[(device type, replicas, dp)]`` (the replica
    axis, replica-major) and replicated over the others. A caller with a
    :class:`~lowband.parallel.mesh.ParallelMesh` puts its :meth:`~lowband.parallel.mesh.ParallelMesh.device_mesh`
    there (the trainer's ``diloco`` strategy does: no new process group); else a ``(replica, dp)`` mesh is
    created once per cache, collectively (``init_device_mesh``: new groups)."""
    local = x.detach().unsqueeze(0).contiguous().clone()
    if replicas * dp == 1:
        return local
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    key = (x.device.type, replicas, dp)
    if key not in meshes:
        meshes[key] = init_device_mesh(x.device.type, (replicas, dp), mesh_dim_names=("replica", "dp"))
    mesh = meshes[key]
    shape = torch.Size((replicas, *x.shape))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1), run_check=False,
                              shape=shape, stride=stride)


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


def _logical_row_digests(dl: StreamingDiLoCo, name: str, t: torch.Tensor) -> torch.Tensor:
    """Row digests of ``t``'s logical form (GTP: gathered digests, not the rows; see ``state_layout``)."""
    lay = dl.state_layout
    return row_digests(t) if lay is None else lay.logical_row_digests(name, t)


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


def _chunks(dl: StreamingDiLoCo, name: str, t: torch.Tensor) -> Any:
    """``t`` (a tensor of parameter ``name``'s local shape) as rank-local chunks of its logical tensor."""
    lay = dl.state_layout
    return t if lay is None else lay.to_chunks(name, t)


def _from_saved(dl: StreamingDiLoCo, name: str, v: Any) -> torch.Tensor:
    """A loaded value of parameter ``name`` (rank-local chunks, or a whole logical tensor) in local shape."""
    if isinstance(v, LocalChunks):
        v = whole_or_chunks(v)
    lay = dl.state_layout
    if lay is not None and name in lay.weights:
        return lay.from_saved(name, v)
    if isinstance(v, LocalChunks):
        raise ValueError(f"diloco load_state_dict: {name!r} does not hold the whole parameter (pass the template "
                         "state_dict() returned, filled by dcp.load)")
    return v


def _replica_row(v: Any, replica: int | None) -> Any:
    """This replica's row of a per-replica value: a lifted ``LocalChunks`` (rank-local form), a ``DTensor``
    row (:func:`per_replica`, the gathered form and earlier files) or a plain ``(R, *shape)`` tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        return row(v)
    if replica is None:
        raise RuntimeError("diloco load_state_dict: per-replica values need the replica-major (replica, dp) "
                           "layout of lowband.diloco.replica_mesh to find this replica's row")
    if isinstance(v, LocalChunks):
        return lower_chunks(v, replica)
    return v[replica]


def _layout_or_raise(dl: StreamingDiLoCo) -> tuple[int, int, int]:
    layout = replica_layout(dl.comm)
    if layout is None:
        raise RuntimeError("diloco state_dict: error-feedback residuals are per replica and need the "
                           "replica-major (replica, dp) layout of lowband.diloco.replica_mesh to be labeled "
                           f"for torch.distributed.checkpoint; the cross-replica group {dl.comm.name!r} "
                           f"(size {dl.comm.size}) is laid out otherwise")
    return layout


def inflight_keys(dl: StreamingDiLoCo) -> bool:
    """Whether the rank-local form stores an in-flight fragment per parameter (``inflight_avg.<fqn>``):
    with row-sharded parameters (``state_layout`` set) and ``delay > 0`` (only then can a fragment be in
    flight at a checkpoint)."""
    return dl.state_layout is not None and dl.delay > 0


def _outer_entries(dl: StreamingDiLoCo, i: int, convert: Any) -> dict[str, Any]:
    """Fragment ``i``'s outer-optimizer state: per parameter the SGD momentum (``convert(name, tensor)``:
    rank-local chunks or the logical tensor), or another outer optimizer's serialized ``state_dict()``."""
    frag, gs, outer = dl.frags[i], dl.globals[i], dl.outer[i]
    out: dict[str, Any] = {}
    if _is_sgd(outer):
        if any(grp["momentum"] != 0 for grp in outer.param_groups):
            for name, g in zip(frag.names, gs, strict=True):
                mom = outer.state.get(g, {}).get("momentum_buffer")
                out[f"outer.{name}.momentum_buffer"] = convert(name, mom.detach() if mom is not None
                                                               else torch.zeros_like(g))
        return out
    if dl.state_layout is not None and dl.state_layout.weights:
        raise RuntimeError("diloco state_dict: outer optimizers other than torch.optim.SGD are saved as "
                           "their serialized state, which cannot hold sharded (GTP) parameters")
    buf = io.BytesIO()
    torch.save(outer.state_dict(), buf)
    out[f"outer_opt.{i}"] = buf.getvalue()
    return out


@torch.no_grad()
def diloco_state_dict(dl: StreamingDiLoCo, *, rank_local: bool = False) -> dict[str, Any]:
    """The state of ``dl`` in the format of this module (see the module docstring).

    ``rank_local=False`` (:meth:`StreamingDiLoCo.state_dict`): sharded parameters' values gathered to
    logical tensors (collective over the GTP group, ``tag="diloco:state"``), copies, residuals as
    ``DTensor`` rows. ``rank_local=True`` (:class:`DilocoCheckpoint`): every value this rank's own elements
    as views (``LocalChunks``; per-replica values lifted under the replica coordinate), no communication
    but completing an in-flight all-reduce; with row-sharded parameters and ``delay > 0`` the in-flight
    fragment is stored per parameter (``inflight_avg.<fqn>``, zeros for a fragment not in flight)."""
    if not rank_local:
        return _logical_state_dict(dl)
    layout = _layout_or_raise(dl) if dl.error_feedback else None
    per_param = inflight_keys(dl)
    infl = dl._inflight
    if infl is not None:
        dl._wait_inflight()  # same order on every rank; the sync's own wait is then a no-op
    inflight = b""
    if infl is not None:
        if dl.state_layout is not None and not per_param:
            raise RuntimeError(f"diloco state_dict: fragment {infl.fragment} is in flight with delay 0; the "
                               "rank-local form has no place for its row shards")
        # whole parameters: the averaged buffer is the same on every rank (written once); shards: per parameter
        flat = None if per_param else infl.flat.detach().cpu().clone()
        inflight = pickle.dumps((infl.fragment, list(dl.frags[infl.fragment].names), flat))
    out: dict[str, Any] = {"counters": {"committed": dl.committed, "local_step": dl.local_step},
                           "inflight": inflight}
    for i, (frag, gs, outer) in enumerate(zip(dl.frags, dl.globals, dl.outer, strict=True)):
        out[f"outer_started.{i}"] = any(bool(outer.state.get(g)) for g in gs)
        for name, g in zip(frag.names, gs, strict=True):
            out[f"global.{name}"] = _chunks(dl, name, g.detach())
        out.update(_outer_entries(dl, i, lambda name, t: _chunks(dl, name, t)))
        if per_param:
            device = frag.params[0].device
            mine = infl is not None and infl.fragment == i
            flat = (infl.flat.detach() if mine else  # type: ignore[union-attr]
                    torch.zeros(frag.numel, dtype=dl.buffer_dtypes[i], device=device))
            for name, x in zip(frag.names, _split(flat, frag.params), strict=True):
                out[f"inflight_avg.{name}"] = _chunks(dl, name, x)
        res = dl.residuals[i]
        if res is not None:
            assert layout is not None
            r_count, _dp, replica = layout
            pending = (infl.residual if infl is not None and infl.fragment == i and infl.residual is not None
                       else torch.zeros_like(res))
            for name, r, q in zip(frag.names, _split(res, gs), _split(pending.to(res.device), gs), strict=True):
                out[f"residual.{name}"] = lift_chunks(_chunks(dl, name, r), r_count, replica)
                out[f"inflight_residual.{name}"] = lift_chunks(_chunks(dl, name, q), r_count, replica)
    return out


def _logical_state_dict(dl: StreamingDiLoCo) -> dict[str, Any]:
    layout = _layout_or_raise(dl) if dl.error_feedback else None
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
        out.update(_outer_entries(dl, i, lambda name, t: _logical(dl, name, t.clone())))
        res = dl.residuals[i]
        if res is not None:
            assert layout is not None
            pending = (infl.residual if infl is not None and infl.fragment == i and infl.residual is not None
                       else torch.zeros_like(res))
            for name, r, q in zip(frag.names, _split(res, gs), _split(pending.to(res.device), gs), strict=True):
                out[f"residual.{name}"] = per_replica(_logical(dl, name, r), layout[0], layout[1], dl.dcp_meshes)
                out[f"inflight_residual.{name}"] = per_replica(_logical(dl, name, q), layout[0], layout[1],
                                                               dl.dcp_meshes)
    owner = layout if layout is not None else replica_layout(dl.comm)
    if owner is not None:  # torch.save keeps only the saving rank's DTensor row: name whose it is
        out["saved_by_replica"] = per_replica(torch.tensor(owner[2], dtype=torch.int64, device=dl.backup_device),
                                              owner[0], owner[1], dl.dcp_meshes)
        dl.wait_for_inner_writes()
        for frag in dl.frags:  # which weights this state goes with (checked at the first step after a load)
            for name, p in zip(frag.names, frag.params, strict=True):
                digests = _logical_row_digests(dl, name, p.detach()).to(dl.backup_device)
                out[f"weights_digest.{name}"] = per_replica(digests, owner[0], owner[1], dl.dcp_meshes)
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

    layout = replica_layout(dl.comm)
    replica = None if layout is None else layout[2]

    def local(name: str, v: Any) -> torch.Tensor:
        return _from_saved(dl, name, v)

    saved_by = state.get("saved_by_replica", state.get("residual_owner"))  # the previous version's name
    if replica is not None and saved_by is not None:
        owner = int(torch.as_tensor(_replica_row(saved_by, replica)).reshape(-1)[0])
        if owner != replica:
            own = "inner optimizer state and error-feedback residuals" if dl.error_feedback else "inner optimizer state"
            raise ValueError(
                f"diloco load_state_dict: this state was saved by replica {owner}, and this is replica {replica} "
                "(a state_dict() saved by one rank and loaded on every replica): replicas differ between syncs "
                f"(weights, {own}), so loading another replica's state drops this replica's own work. Save and "
                "load each replica's own state (torch.save per rank, or torch.distributed.checkpoint / "
                "lowband.diloco.DilocoCheckpoint, which keep every replica's row)")

    digests = {name: torch.as_tensor(_replica_row(state[f"weights_digest.{name}"], replica)).reshape(-1).cpu()
               for frag in dl.frags for name in frag.names if f"weights_digest.{name}" in state}
    for i, (frag, gs, outer) in enumerate(zip(dl.frags, dl.globals, dl.outer, strict=True)):
        for name, g in zip(frag.names, gs, strict=True):
            g.copy_(local(name, get(f"global.{name}")))
        if _is_sgd(outer):
            if any(grp["momentum"] != 0 for grp in outer.param_groups):
                started = bool(get(f"outer_started.{i}"))
                for name, g in zip(frag.names, gs, strict=True):
                    if started:
                        outer.state[g]["momentum_buffer"] = local(name, get(f"outer.{name}.momentum_buffer")
                                                                  ).to(g.device).clone()
                    else:
                        outer.state.pop(g, None)
        else:
            outer.load_state_dict(torch.load(io.BytesIO(get(f"outer_opt.{i}")), weights_only=True))
        res = dl.residuals[i]
        if res is not None:
            for name, r in zip(frag.names, _split(res, gs), strict=True):
                r.copy_(local(name, _replica_row(get(f"residual.{name}"), replica)))
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
        device = frag.params[0].device
        pending = None
        if dl.residuals[frag_i] is not None:
            pending = torch.cat([local(n, _replica_row(get(f"inflight_residual.{n}"), replica)).reshape(-1)
                                 for n in frag.names])
            pending = pending.to(device=device, dtype=dl.buffer_dtypes[frag_i])
        if flat is None:  # the rank-local form: per parameter
            flat = torch.cat([local(n, get(f"inflight_avg.{n}")).reshape(-1).to(device) for n in frag.names])
        else:  # whole parameters, or the logical form (gathered shards; earlier files)
            flat = _local_flat(dl, frag_i, flat)
        dl._inflight = _InFlight(frag_i, flat.to(device=device, dtype=dl.buffer_dtypes[frag_i]), [], pending,
                                 bool(torch.isfinite(flat).all()))
    dl._saved_digests = digests or None


# ------------------------------------------------------------------------------ DCP checkpoint
class DilocoCheckpoint:
    """Model + inner optimizer + :class:`~lowband.diloco.StreamingDiLoCo` of one rank, for DCP, rank-local.

    ``state_dict()`` = ``{"model": {fqn: row}, "optim": {...}, "diloco": diloco_state_dict(rank_local=True)}``,
    where a *row* is a :class:`~lowband.dcp_chunks.LocalChunks` of shape ``(R, *logical shape)`` holding
    what this rank owns of its replica's value at leading offset ``replica`` (:func:`lowband.dcp_chunks.lift_chunks`:
    the model and the inner optimizer state differ between replicas; ranks of one replica holding the same
    elements write the same chunks, which DCP writes once). Every piece is a view of the live state, so
    ``dcp.save`` writes only what each rank owns and ``dcp.load`` into a fresh ``state_dict()`` reads only
    the saved chunks overlapping what it owns, in place, at any dp / GTP size inside a replica (DCP
    reshards); the replica count must stay (DCP's shape check refuses another). Save with
    ``dcp.save(ckpt.state_dict(), ...)``; resume by ``sd = ckpt.state_dict(); dcp.load(sd, ...);
    ckpt.load_state_dict(sd)``.

    Two sources of the inner part:

    * ``inner=None`` (DDP inside a replica): the inner torch optimizer's own state per parameter,
      ``"optim": {"state.<fqn>.<key>": row, "param_groups.<g>.<hyper>": value}``, every rank of the replica
      holding it whole. It must keep its state per parameter as tensors (torch AdamW / SGD / Adam ...;
      missing state before the first step is written as AdamW-shaped zeros only for AdamW-like optimizers).
    * ``inner=`` an object with ``state_dict()`` / ``load_state_dict(state)`` in the ``{"model": {fqn: ...},
      "optim": {key: ...}}`` shape whose tensors are plain or rank-local ``LocalChunks`` of the logical shape
      (the inner strategy itself: a sharded inner's :class:`~lowband.optim.sharded_state.ShardedStateLayout`,
      GTP's :class:`~lowband.parallel.gtp_state.GTPStateLayout` / ``GTPMuonStateLayout``): its rank-local
      ``state_dict()`` (not the gathered ``logical_state_dict()``) with every tensor lifted to a row;
      other values (hyperparameters) stay plain. Loading lowers each row back to this rank's part
      (:func:`~lowband.dcp_chunks.lower_chunks`; a part that is the whole tensor as a plain tensor) and hands
      it to ``inner.load_state_dict``. The DiLoCo hooks are paused meanwhile (``StreamingDiLoCo.paused``),
      so a zero-lr initialization step of torch's ``get_state_dict`` is not counted as an inner step.

    Files of the earlier gathered format (rows as ``DTensor`` ``[Shard(0), Replicate()]``, the same keys
    and logical shapes) load into this template; with GTP inside and ``delay > 0`` they lack the
    per-parameter in-flight keys (``diloco.inflight_avg.<fqn>``): pass the template through
    :meth:`fit_template` with the file's keys first (the trainer does).

    Communication: none of its own (DCP's planning collectives only), except that saving completes an
    in-flight all-reduce.

    Args:
        model: the plain replica model (not a DDP wrapper).
        optimizer: the inner optimizer.
        diloco: the StreamingDiLoCo driving it.
        num_replicas, dp_size, replica: the mesh (``dp_size`` = ranks per replica) and this rank's replica
            (replica-major ranks).
        inner: the inner state layout (see above), or ``None``.
        inner_comm: unused (earlier versions gathered ``Shard(0)`` DTensors of the inner through it); kept
            so existing callers keep working.
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

    def _row(self, v: torch.Tensor, key: str) -> LocalChunks:
        from torch.distributed.tensor import DTensor

        if isinstance(v, DTensor):
            raise TypeError(f"DilocoCheckpoint: inner state {key!r} is a DTensor; the inner state_dict() must give "
                            "plain tensors or rank-local LocalChunks of the logical shape")
        return lift_chunks(v, self.r, self.replica)

    def _unrow(self, v: Any) -> Any:
        """This replica's part of a row (a plain tensor when it is the whole tensor); other values as they are."""
        if not isinstance(v, torch.Tensor):
            return v
        part = _replica_row(v, self.replica)
        return whole_or_chunks(part) if isinstance(part, LocalChunks) else part

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        diloco = diloco_state_dict(self.diloco, rank_local=True)  # first: completes an in-flight all-reduce
        if self.inner is not None:
            with self.diloco.paused():
                sd = self.inner.state_dict()
            model = {n: self._row(v, f"model.{n}") for n, v in sd["model"].items()}
            optim = {k: self._row(v, f"optim.{k}") if isinstance(v, torch.Tensor) else v
                     for k, v in sd.get("optim", {}).items()}
            return {"model": model, "optim": optim, "diloco": diloco}
        model = {n: self._row(p, f"model.{n}") for n, p in self.model.named_parameters()}
        optim: dict[str, Any] = {}
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                for k, v in self._inner_state(p).items():
                    key = f"state.{self.names[id(p)]}.{k}"
                    optim[key] = self._row(v, f"optim.{key}")
        optim.update(group_hyperparams(self.optimizer.param_groups))
        return {"model": model, "optim": optim, "diloco": diloco}

    @staticmethod
    def fit_template(state: dict[str, Any], saved_keys: set[str]) -> list[str]:
        """Fit a fresh :meth:`state_dict` (the load template) to a checkpoint written before the in-flight
        fragment was stored per parameter: drop the ``diloco.inflight_avg.<fqn>`` entries the checkpoint
        does not have (``saved_keys``: its flattened DCP keys, relative to this state), so ``dcp.load``
        does not stop at a missing key; :meth:`load_state_dict` then takes the in-flight fragment from
        the ``inflight`` blob, where those files kept it in logical form. Returns the dropped keys. No
        communication (every rank reads the same metadata and drops the same keys)."""
        diloco = state.get("diloco", {})
        dropped = [k for k in diloco if k.startswith("inflight_avg.") and f"diloco.{k}" not in saved_keys]
        for k in dropped:
            del diloco[k]
        return dropped

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.inner is not None:
            model = {n: self._unrow(v) for n, v in state["model"].items()}
            optim = {k: self._unrow(v) for k, v in state["optim"].items()}
            with self.diloco.paused():
                self.inner.load_state_dict({"model": model, "optim": optim})
            self.diloco.load_state_dict(state["diloco"])
            return
        for n, p in self.model.named_parameters():
            p.copy_(self._whole(state["model"][n], f"model.{n}"))
        optim = state["optim"]
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                prefix = f"state.{self.names[id(p)]}."
                self.optimizer.state[p] = {k[len(prefix):]: self._whole(v, f"optim.{k}").clone()
                                           for k, v in optim.items() if k.startswith(prefix)}
        for gi, g in enumerate(self.optimizer.param_groups):
            for k in list(g):
                key = f"param_groups.{gi}.{k}"
                if k != "params" and key in optim:
                    g[k] = optim[key]
        self.diloco.load_state_dict(state["diloco"])

    def _whole(self, v: Any, key: str) -> torch.Tensor:
        out = self._unrow(v)
        if isinstance(out, LocalChunks):
            raise ValueError(f"DilocoCheckpoint: {key!r} does not hold this replica's whole tensor (pass the "
                             "template state_dict() returned, filled by dcp.load)")
        return out
