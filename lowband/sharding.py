"""One record of how a parameter is sharded: :class:`Placement`, written by every sharder, asked by every reader.

A sharder (the TP layers of :mod:`lowband.parallel.tensor` / :func:`lowband.parallel.tp_shard.shard_tp`, GTP's
:class:`~lowband.parallel.gtp.GTPRuntime`, GTP x TP's :mod:`lowband.parallel.gtp_tp`) stores a frozen
:class:`Placement` on the parameter it shards (``param.placement``, via :func:`place`); every reader (the
global clip, init-sync, the replica check, unshard/export, TP-REKLS, GTP-Muon, the state layouts, the
trainer's strategies) asks :func:`placement_of` instead of reading attributes of its own.

A placement is the parameter's **logical** (dense, single-device) shape and the cuts that lead from it to the
tensor this rank holds, outermost first::

    Placement(shape=(3E, E), splits=(Split("tp", dim=0, size=T, rank=t, sections=3),   # fused [q; k; v]
                                     Split("gtp", dim=0, size=G, rank=g, pad=P)))      # GTP rows of that slice

* ``Split(axis, dim, size, rank)`` cuts dimension ``dim`` of the tensor it applies to into ``size`` equal
  parts and this rank holds part ``rank``.
* ``sections = S``: that dimension is ``S`` equal concatenated sections (a fused ``[q; k; v]``), each cut
  separately; the rank holds its part of every section, concatenated in section order.
* ``pad = P``: ``P`` zero rows are appended to the dimension before it is cut (GTP pads its rows to a
  multiple of the group size, and of the fp8 block); those rows are this rank's **padding**, never state.
* ``group``: the object that runs the axis's collectives (a :class:`lowband.comm.Comm`); not part of the
  record's equality (two replicas of a layout compare equal).

What a layout needs from it, with no communication: :meth:`Placement.local_shape`, :func:`logical_boxes`
(where the rank's elements sit in logical coordinates), :func:`to_state` (the local tensor as a
:class:`lowband.dcp_chunks.LocalChunks` of the logical shape holding exactly its real elements, views, for
``torch.distributed.checkpoint``), :func:`from_state` (the local tensor back from such chunks or from a whole
logical tensor; padding zero).

Parameters of tensor-parallel layers lowband did not write may instead carry the TP declaration
``param.partition_dim`` (0, 1 or ``None``), ``param.tp_comm`` and optionally ``param.full_shape`` (see
docs/rekls.md); :func:`placement_of` reads that as a one-split placement.

Imports nothing from lowband but :mod:`lowband.dcp_chunks`. No communication.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lowband.dcp_chunks import LocalChunks, box_chunks

PLACEMENT_ATTR = "placement"
"""The attribute a sharder sets on a parameter (:func:`place`)."""


@dataclass(frozen=True)
class Split:
    """One cut: dimension :attr:`dim` in :attr:`size` equal parts over mesh axis :attr:`axis`; this rank holds
    part :attr:`rank` (of each of :attr:`sections` sections; after :attr:`pad` padding rows are appended)."""

    axis: str
    """The mesh axis (``"tp"``, ``"gtp"``)."""
    dim: int
    size: int
    rank: int
    sections: int = 1
    pad: int = 0
    group: Any = field(default=None, compare=False, repr=False)
    """What runs this axis's collectives (a :class:`lowband.comm.Comm`), or ``None``."""

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"Split({self.axis!r}): rank {self.rank} is not in [0, size={self.size})")
        if self.sections < 1 or self.pad < 0:
            raise ValueError(f"Split({self.axis!r}): sections must be >= 1 and pad >= 0, got {self.sections}, "
                             f"{self.pad}")
        if self.sections > 1 and self.pad:
            raise ValueError(f"Split({self.axis!r}): sections and pad together are not a layout any sharder writes")

    def local_length(self, length: int) -> int:
        """Length of the cut dimension this rank holds when the tensor cut has ``length`` there."""
        padded = length + self.pad
        if padded % (self.size * self.sections):
            raise ValueError(f"Split({self.axis!r}): length {length} + pad {self.pad} is not divisible by "
                             f"size {self.size} x sections {self.sections}")
        return padded // self.size

    def intervals(self, length: int) -> list[tuple[int, int, int]]:
        """``[(local_start, outer_start, n)]``: runs of this rank's indices along the cut dimension and where
        they sit in the tensor cut (of ``length`` there); padding indices are in no run."""
        lo, hi = self.range(length)
        per = hi - lo
        if self.sections > 1:
            sec = length // self.sections
            return [(s * per, s * sec + lo, per) for s in range(self.sections)]
        n = max(0, min(per, length - lo))
        return [(0, lo, n)] if n else []

    def range(self, length: int) -> tuple[int, int]:
        """``(start, stop)`` of this rank's part along the cut dimension of ``length``, padding included (the
        part of each section, in section coordinates, when :attr:`sections` > 1)."""
        per = self.local_length(length) // self.sections
        return self.rank * per, (self.rank + 1) * per


@dataclass(frozen=True)
class Placement:
    """A parameter's logical shape and the cuts (outermost first) that give the tensor this rank holds."""

    shape: tuple[int, ...]
    splits: tuple[Split, ...] = ()
    name: str = ""
    """The parameter's name, for messages (``""`` if the sharder did not know it)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        self.local_shape()  # validates every cut

    def local_shape(self) -> tuple[int, ...]:
        """The shape of the tensor this rank holds (padding included)."""
        shape = list(self.shape)
        for s in self.splits:
            if not 0 <= s.dim < len(shape):
                raise ValueError(f"Placement {self.name or self.shape}: split {s.axis!r} cuts dim {s.dim} of a "
                                 f"{len(shape)}-d tensor")
            shape[s.dim] = s.local_length(shape[s.dim])
        return tuple(shape)

    def split(self, axis: str) -> Split | None:
        """The cut over mesh axis ``axis`` (``None`` if the parameter is whole along it)."""
        return next((s for s in self.splits if s.axis == axis), None)

    def group(self, axis: str) -> Any:
        """The collective group of ``axis`` if the parameter is cut over more than one rank of it, else ``None``."""
        s = self.split(axis)
        return s.group if s is not None and s.size > 1 else None

    @property
    def sharded(self) -> bool:
        """True if ranks of some axis hold different parts (a cut of size > 1)."""
        return any(s.size > 1 for s in self.splits)

    def with_outer(self, split: Split, shape: Sequence[int]) -> Placement:
        """This placement seen from a larger logical tensor of ``shape`` cut by ``split`` first (GTP x TP:
        the GTP shard of a TP slice)."""
        return dataclasses.replace(self, shape=tuple(shape), splits=(split, *self.splits))


def place(param: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Record ``placement`` on ``param`` (checked against its shape) and return ``param``."""
    local = placement.local_shape()
    if tuple(param.shape) != local:
        raise ValueError(f"place: {placement.name or 'parameter'} has shape {tuple(param.shape)}, its placement "
                         f"says {local}")
    setattr(param, PLACEMENT_ATTR, placement)
    return param


def placement_of(param: torch.Tensor) -> Placement | None:
    """The parameter's :class:`Placement`; ``None`` for a whole (replicated) parameter.

    A TP declaration on a parameter lowband did not shard (``partition_dim`` 0/1, ``tp_comm``, optionally
    ``full_shape``; docs/rekls.md) is read as one ``"tp"`` split; ``partition_dim = None`` is whole.
    """
    pl = getattr(param, PLACEMENT_ATTR, None)
    if pl is not None:
        return pl
    dim = getattr(param, "partition_dim", None)
    comm = getattr(param, "tp_comm", None)
    if dim not in (0, 1) or comm is None or not hasattr(comm, "size") or not hasattr(comm, "rank"):
        return None
    shape = list(param.shape)
    full = getattr(param, "full_shape", None)
    if full is not None and len(full) == len(shape):
        shape = [int(x) for x in full]
    elif dim < len(shape):
        shape[dim] *= comm.size
    if dim >= len(shape):
        return None
    return Placement(tuple(shape), (Split("tp", dim, comm.size, comm.rank, group=comm),))


def cut_of(param: torch.Tensor, axis: str) -> Split | None:
    """The cut of ``param``'s placement over mesh axis ``axis`` (``None``: no placement, or whole along it)."""
    pl = placement_of(param)
    return pl.split(axis) if pl is not None else None


def logical_boxes(placement: Placement) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """``[(logical_offsets, local_offsets, sizes)]``: the boxes of real (non-padding) elements this rank holds,
    where each sits in the logical tensor and in the local one. Disjoint; together they cover every real
    element of the local tensor once. No communication."""
    # per dimension: runs (local_start, logical_start, n), composed cut by cut (cuts act on one dim each)
    runs: list[list[tuple[int, int, int]]] = [[(0, 0, n)] if n else [] for n in placement.shape]
    lengths = list(placement.shape)
    for s in placement.splits:
        new: list[tuple[int, int, int]] = []
        for loc, outer, n in s.intervals(lengths[s.dim]):
            for p_loc, p_log, p_n in runs[s.dim]:
                a, b = max(outer, p_loc), min(outer + n, p_loc + p_n)
                if a < b:
                    new.append((loc + a - outer, p_log + a - p_loc, b - a))
        runs[s.dim] = sorted(new)
        lengths[s.dim] = s.local_length(lengths[s.dim])
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = [((), (), ())]
    for dim_runs in runs:
        boxes = [((*lo, g), (*lc, c), (*sz, n)) for lo, lc, sz in boxes for c, g, n in dim_runs]
    return boxes


def padding_mask(placement: Placement) -> torch.Tensor | None:
    """A boolean tensor of the local shape, ``True`` at this rank's padding elements (held, but outside the
    logical tensor: GTP's pad rows); ``None`` when every local element is real. No communication."""
    real = torch.zeros(placement.local_shape(), dtype=torch.bool)
    for _, loc, sizes in logical_boxes(placement):
        real[tuple(slice(c, c + n) for c, n in zip(loc, sizes, strict=True))] = True
    return None if bool(real.all()) else ~real


def _local_view(placement: Placement, local: torch.Tensor, what: str) -> torch.Tensor:
    shape = placement.local_shape()
    if local.numel() != torch.Size(shape).numel():
        raise ValueError(f"{what} has {local.numel()} elements, its placement's local shape is {shape}")
    return local.detach().view(shape)


def to_state(placement: Placement, local: torch.Tensor, *, what: str = "tensor") -> LocalChunks:
    """``local`` (this rank's tensor of ``placement``, or one of its shape) as a
    :class:`~lowband.dcp_chunks.LocalChunks` of the logical shape holding its real elements as views (no copy:
    ``dcp.load`` into it fills ``local``). Padding is never written; ranks that hold the same part (replicas
    of a shard) give the same chunks, which DCP writes once. No communication."""
    view = _local_view(placement, local, what)
    boxes = []
    for log, loc, sizes in logical_boxes(placement):
        idx = tuple(slice(c, c + n) for c, n in zip(loc, sizes, strict=True))
        boxes.append((log, view[idx]))
    return box_chunks(placement.shape, boxes, dtype=view.dtype, device=view.device)


def from_state(placement: Placement, saved: torch.Tensor, *, what: str = "tensor") -> torch.Tensor:
    """This rank's local tensor (padding zero) from ``saved``: a whole logical tensor, or a
    :class:`~lowband.dcp_chunks.LocalChunks` holding exactly this rank's real elements (a :func:`to_state`
    template that ``dcp.load`` filled). No communication.

    Raises:
        ValueError: ``saved`` is not of the logical shape, or its chunks are not this rank's elements; the
            message starts with ``what``.
    """
    if tuple(saved.shape) != placement.shape:
        raise ValueError(f"{what} has shape {tuple(saved.shape)}, expected the logical {placement.shape}")
    boxes = logical_boxes(placement)
    if isinstance(saved, LocalChunks):
        device = saved.pieces[0][1].device if saved.pieces else saved.device
        out = torch.zeros(placement.local_shape(), dtype=saved.dtype, device=device)
        held = 0
        for offsets, piece in saved.pieces:
            box = _box_holding(boxes, offsets, tuple(piece.shape))
            if box is None:
                held = -1
                break
            log, loc, _ = box
            idx = tuple(slice(c + o - g, c + o - g + n)
                        for c, o, g, n in zip(loc, offsets, log, piece.shape, strict=True))
            out[idx].copy_(piece)
            held += piece.numel()
        if held != sum(torch.Size(sz).numel() for _, _, sz in boxes):
            raise ValueError(f"{what} does not hold exactly this rank's elements of {placement.name or 'the tensor'} "
                             "(pass the template its layout's state_dict() returned, filled by dcp.load, or a "
                             "whole logical tensor)")
        return out
    out = torch.zeros(placement.local_shape(), dtype=saved.dtype, device=saved.device)
    for log, loc, sizes in boxes:
        out[tuple(slice(c, c + n) for c, n in zip(loc, sizes, strict=True))].copy_(
            saved[tuple(slice(g, g + n) for g, n in zip(log, sizes, strict=True))])
    return out


def _box_holding(boxes: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]], offsets: Sequence[int],
                 sizes: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """The box of ``boxes`` that contains the logical block ``offsets`` + ``sizes``, or ``None``."""
    for box in boxes:
        log, _, bsz = box
        if all(g <= o and o + n <= g + m for g, o, n, m in zip(log, offsets, sizes, bsz, strict=True)):
            return box
    return None


# ------------------------------------------------------------------------------ optimizers that need whole tensors
_WHOLE_TENSOR_TORCH_OPTIMIZERS = ("Muon", "Adafactor", "LBFGS")
"""torch optimizers that update a parameter from statistics of the whole tensor (an orthogonalization, factored
second moments and a parameter-norm step size, line-search dot products), where a part of a weight is not the
weight."""


def whole_tensor_params(optimizer: Any) -> list[torch.Tensor]:
    """The parameters ``optimizer`` updates from statistics of the whole tensor it is given: what its own
    ``whole_tensor_params()`` returns (lowband's Muon, REKLS, the sharded optimizer's Muon groups), every
    parameter of torch's ``Muon``, ``Adafactor`` and ``LBFGS``, none for another (elementwise) optimizer."""
    own = getattr(optimizer, "whole_tensor_params", None)
    if callable(own):
        return list(own())
    kinds = tuple(k for k in (getattr(torch.optim, n, None) for n in _WHOLE_TENSOR_TORCH_OPTIMIZERS) if k is not None)
    if kinds and isinstance(optimizer, kinds):
        return [p for g in optimizer.param_groups for p in g["params"]]
    return []


def refuse_sharded_whole_tensor_updates(optimizer: Any) -> None:
    """Raise ``ValueError`` when ``optimizer`` would update a part of a sharded weight (a placement cut over more
    than one rank, on an axis not in the optimizer's ``handles_sharded_axes``, e.g. ``("tp",)`` for ``TpRekls``)
    as if it were the whole weight (:func:`whole_tensor_params`):
    torch's ``Muon`` on a GTP row shard orthogonalizes the shard (0.05 off the single-device step after 3 steps on
    2 ranks, silently), ``Adafactor`` takes its column statistics and step size from the shard. Local, no
    communication; every rank of a group holds the same kinds of parameters, so every rank raises alike. Called by
    the GTP and TP step pre-hooks before anything steps."""
    allowed_axes = tuple(getattr(optimizer, "handles_sharded_axes", ()))
    bad = []
    for p in whole_tensor_params(optimizer):
        pl = placement_of(p)
        if pl is not None and any(s.size > 1 and s.axis not in allowed_axes for s in pl.splits):
            bad.append(pl)
    if bad:
        names = [pl.name or f"a parameter of logical shape {pl.shape}" for pl in bad[:3]]
        cuts = sorted({f"{s.axis} over {s.size} ranks" for pl in bad for s in pl.splits if s.size > 1})
        raise ValueError(
            f"{type(optimizer).__name__} updates each parameter from statistics of the whole tensor it holds, but "
            f"{names}{' ...' if len(bad) > 3 else ''} ({len(bad)} parameters) hold one rank's part of a sharded "
            f"weight ({', '.join(cuts)}): every rank would step its part as if it were the weight. Use "
            "lowband.optim.gtp_muon.GTPMuon for GTP weights, lowband.optim.TpRekls for tensor-parallel slices, or an "
            "elementwise optimizer (torch AdamW, SGD) on the parts")
