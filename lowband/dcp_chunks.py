"""Rank-local chunks of a logical tensor for ``torch.distributed.checkpoint`` (DCP), no gather.

A rank that owns an arbitrary flat range ``[a, b)`` of a row-major tensor (a ZeRO bucket cut through a
parameter, whole matrices of a stacked Muon unit) saves exactly that range, and loads exactly that
range, in the tensor's **logical** shape, so any other layout (another world size, a plain tensor in
one process, a ``Shard(0)`` DTensor) reads the same file:

* :func:`flat_range_boxes` splits the range into at most ``2 * (ndim - 1) + 1`` rectangular boxes,
  each a contiguous flat sub-range, so a box's data is a view ``flat[s:e].view(sizes)`` (no copy).
* :func:`box_pieces` / :func:`box_chunks` take rectangular boxes a layout holds as they are (GTP's real
  rows of a row shard at their row offset, a whole matrix its owner keeps), cut by :func:`split_box`.
* :func:`split_box` caps the size of each saved chunk (``MAX_CHUNK_BYTES``) by cutting a box into
  blocks on a grid fixed in the tensor's own coordinates (independent of the world size and of the
  range), because DCP's file reader loads a whole saved chunk for every read that overlaps it (a load
  transiently holds up to twice the largest chunk it overlaps).
* :class:`LocalChunks` is a ``torch.Tensor`` wrapper subclass of the logical shape holding this rank's
  pieces ``(offsets, view)``; it implements DCP's private ``_Checkpointable`` protocol
  (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``), so ``dcp.save``
  writes each piece as one chunk and ``dcp.load`` copies into the views in place (the default
  planners; ``dcp.async_save``'s stager copies the pieces' storages once through ``new_empty``). A rank
  holding no element of the tensor has no piece and writes nothing for it.
* :func:`lift_chunks` / :func:`lower_chunks` put a value's pieces under a leading dimension and take
  them back out (DiLoCo's per-replica rows: shape ``(R, *S)``, pieces at ``(replica, *offsets)``, views
  of the same memory); :func:`whole_or_chunks` turns pieces that cover the whole tensor into a plain
  tensor.

No communication of its own (DCP's planning collectives only). Imports nothing else from lowband.
The measurements behind it (DCP's chunk protocol, chunk caps, reshard matrix) are in the project's
shared reference notes, ``dcp_local_shards.md`` (mechanism A).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

MAX_CHUNK_BYTES = 16 * 2**20
"""Largest chunk :func:`local_chunks` saves (bytes); a larger box is cut into blocks."""

Box = tuple[tuple[int, ...], tuple[int, ...], int]


def _prod(xs: Sequence[int]) -> int:
    return math.prod(int(x) for x in xs)


def flat_range_boxes(shape: Sequence[int], a: int, b: int) -> list[Box]:
    """The flat range ``[a, b)`` of a row-major tensor of ``shape`` as rectangular boxes.

    Returns ``[(offsets, sizes, flat_start)]`` in flat order: each box covers the contiguous flat
    elements ``[flat_start, flat_start + prod(sizes))``, the boxes tile ``[a, b)`` exactly, and there
    are at most ``2 * (ndim - 1) + 1`` of them (a partial leading row, a block of whole rows, a
    partial trailing row, recursively). An empty range gives ``[]``; a 0-d tensor's range ``[0, 1)``
    gives ``[((), (), 0)]``.
    """
    shape = tuple(int(s) for s in shape)
    numel = _prod(shape)
    if not 0 <= a <= b <= numel:
        raise ValueError(f"flat_range_boxes: range [{a}, {b}) is not inside a tensor of {numel} elements "
                         f"(shape {shape})")
    if a == b:
        return []
    if not shape:
        return [((), (), 0)]
    if len(shape) == 1:
        return [((a,), (b - a,), a)]
    inner = _prod(shape[1:])
    rest = shape[1:]
    r0, c0 = divmod(a, inner)
    r1, c1 = divmod(b, inner)

    def under(row: int, boxes: list[Box]) -> list[Box]:
        return [((row, *o), (1, *s), row * inner + f) for o, s, f in boxes]

    if r0 == r1:  # inside one row
        return under(r0, flat_range_boxes(rest, c0, c1))
    out: list[Box] = []
    if c0:
        out += under(r0, flat_range_boxes(rest, c0, inner))
        r0 += 1
    if r1 > r0:
        out.append(((r0, *(0,) * len(rest)), (r1 - r0, *rest), r0 * inner))
    if c1:
        out += under(r1, flat_range_boxes(rest, 0, c1))
    return out


def split_box(offsets: Sequence[int], sizes: Sequence[int], itemsize: int,
              max_bytes: int = MAX_CHUNK_BYTES) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Cut a box into blocks of at most ``max_bytes`` (unless one element is larger).

    The box is cut along its first dimension of size > 1, at multiples of a block length that depends
    only on the sizes of the dimensions after it (whole in every box :func:`flat_range_boxes` makes),
    so the cuts lie on a grid of the logical tensor, the same whichever range or world size produced
    the box. When one slice along that dimension alone is too big, each slice is cut further the same
    way. Returns ``[(offsets, sizes)]`` in flat order.
    """
    offsets, sizes = tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)
    if _prod(sizes) * itemsize <= max_bytes:
        return [(offsets, sizes)]
    d = next(i for i, s in enumerate(sizes) if s > 1)
    lo, hi = offsets[d], offsets[d] + sizes[d]
    slice_bytes = _prod(sizes[d + 1:]) * itemsize
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if slice_bytes > max_bytes:
        for i in range(lo, hi):
            sub_off = (*offsets[:d], i, *offsets[d + 1:])
            sub_sizes = (*sizes[:d], 1, *sizes[d + 1:])
            out += split_box(sub_off, sub_sizes, itemsize, max_bytes)
        return out
    block = max(1, max_bytes // slice_bytes)
    start = lo
    while start < hi:
        end = min(hi, (start // block + 1) * block)
        out.append(((*offsets[:d], start, *offsets[d + 1:]), (*sizes[:d], end - start, *sizes[d + 1:])))
        start = end
    return out


def flat_range_pieces(shape: Sequence[int], a: int, b: int, data: torch.Tensor,
                      max_bytes: int = MAX_CHUNK_BYTES) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """The pieces of :class:`LocalChunks` for the flat range ``[a, b)`` of a tensor of ``shape``.

    ``data`` holds the elements ``[a, b)`` (1-D, contiguous); each piece is ``(offsets, view of
    data)``, boxes of :func:`flat_range_boxes` cut by :func:`split_box`.
    """
    if data.dim() != 1 or data.numel() != b - a:
        raise ValueError(f"flat_range_pieces: data must be 1-D with {b - a} elements (the range [{a}, {b})), "
                         f"got shape {tuple(data.shape)}")
    pieces = []
    for offsets, sizes, start in flat_range_boxes(shape, a, b):
        pieces += box_pieces(offsets, data[start - a:start - a + _prod(sizes)].view(sizes), max_bytes)
    return pieces


def box_pieces(offsets: Sequence[int], box: torch.Tensor,
               max_bytes: int = MAX_CHUNK_BYTES) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """The pieces of :class:`LocalChunks` for one rectangular box of a logical tensor.

    ``box`` holds the box's elements (a tensor of the box's sizes, usually a view into its owner's
    buffer) and ``offsets`` are the box's coordinates in the logical tensor; each piece is
    ``(offsets, view of box)``, the box cut by :func:`split_box`. An empty box gives ``[]``.
    """
    offsets = tuple(int(o) for o in offsets)
    if len(offsets) != box.dim():
        raise ValueError(f"box_pieces: {len(offsets)} offsets for a box of shape {tuple(box.shape)}")
    if box.numel() == 0:
        return []
    pieces = []
    for sub_off, sub_sizes in split_box(offsets, box.shape, box.element_size(), max_bytes):
        view = box
        for dim, (o, so, s) in enumerate(zip(offsets, sub_off, sub_sizes, strict=True)):
            if so != o or s != view.shape[dim]:
                view = view.narrow(dim, so - o, s)
        pieces.append((sub_off, view))
    return pieces


class LocalChunks(torch.Tensor):
    """A logical tensor of which this rank holds some rectangular pieces, checkpointable by DCP.

    Built with :meth:`torch.Tensor._make_wrapper_subclass`: ``shape`` / ``dtype`` / ``device`` are the
    logical tensor's, and it has no storage of its own; ``pieces`` is a list of ``(offsets, view)``,
    each view a tensor of the piece's sizes (usually a view into a buffer its owner keeps, so
    ``dcp.load`` writes into that buffer). Pieces must not overlap; DCP checks at save that all ranks'
    pieces together cover the tensor exactly once (pieces identical on several ranks, same offsets,
    are written once). Only the operations DCP needs are supported (``detach``, ``new_empty``); read
    the data through :attr:`pieces` or :meth:`to_full`.
    """

    pieces: list[tuple[tuple[int, ...], torch.Tensor]]

    @staticmethod
    def __new__(cls, shape: Sequence[int], pieces: list[tuple[tuple[int, ...], torch.Tensor]], *,
                dtype: torch.dtype, device: torch.device | str) -> LocalChunks:
        self = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device,
                                                   requires_grad=False)
        return self

    def __init__(self, shape: Sequence[int], pieces: list[tuple[tuple[int, ...], torch.Tensor]], *,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = tuple(int(s) for s in shape)
        checked = []
        for offsets, view in pieces:
            offsets = tuple(int(o) for o in offsets)
            if (len(offsets) != len(shape) or view.dim() != len(shape) or view.dtype != dtype
                    or any(o < 0 or o + s > n for o, s, n in zip(offsets, view.shape, shape, strict=True))):
                raise ValueError(f"LocalChunks: piece at {offsets} of shape {tuple(view.shape)} ({view.dtype}) does "
                                 f"not fit a {dtype} tensor of shape {shape}")
            checked.append((offsets, view))
        self.pieces = checked

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        held = sum(v.numel() for _o, v in self.pieces)
        return (f"LocalChunks(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
                f"pieces={len(self.pieces)}, elements={held})")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.detach.default:
            return args[0]
        if func is torch.ops.aten.new_empty.default:  # dcp.async_save's stager; it then copies .pieces
            src = args[0]
            return cls(src.shape, [], dtype=kwargs.get("dtype") or src.dtype,
                       device=kwargs.get("device") or src.device)
        raise NotImplementedError(f"LocalChunks supports only what torch.distributed.checkpoint needs "
                                  f"(detach, new_empty), not {func}; read .pieces or to_full()")

    # ---------------------------------------------------------------- DCP's _Checkpointable protocol
    def __create_write_items__(self, fqn: str, object: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        items = []
        for i, (offsets, view) in enumerate(self.pieces):
            off = torch.Size(offsets)
            items.append(WriteItem(
                index=MetadataIndex(fqn, off, i), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=view.shape),
                                            properties=TensorProperties.create_from_tensor(view),
                                            size=self.shape)))
        return items

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=v.shape) for o, v in self.pieces]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        offsets = tuple(index.offset) if index.offset is not None else None
        i = index.index
        if i is not None and 0 <= i < len(self.pieces) and self.pieces[i][0] == offsets:
            return self.pieces[i][1]
        for o, v in self.pieces:
            if o == offsets:
                return v
        raise ValueError(f"LocalChunks: no piece at offsets {offsets} for {index.fqn!r}")

    # ---------------------------------------------------------------------------------- helpers
    def to_full(self, fill: float = 0.0) -> torch.Tensor:
        """A plain tensor of the logical shape with this rank's pieces filled in, ``fill`` elsewhere."""
        out = torch.full(tuple(self.shape), fill, dtype=self.dtype, device=self.pieces[0][1].device
                         if self.pieces else self.device)
        for offsets, view in self.pieces:
            out[tuple(slice(o, o + s) for o, s in zip(offsets, view.shape, strict=True))] = view
        return out


def local_chunks(shape: Sequence[int], a: int, b: int, data: torch.Tensor, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, max_bytes: int = MAX_CHUNK_BYTES) -> LocalChunks:
    """:class:`LocalChunks` of logical ``shape`` holding the flat range ``[a, b)`` as views of ``data``
    (1-D, the range's elements; ``dtype`` / ``device`` default to ``data``'s)."""
    return LocalChunks(shape, flat_range_pieces(shape, a, b, data, max_bytes), dtype=dtype or data.dtype,
                       device=device if device is not None else data.device)


def box_chunks(shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], torch.Tensor]], *, dtype: torch.dtype,
               device: torch.device | str, max_bytes: int = MAX_CHUNK_BYTES) -> LocalChunks:
    """:class:`LocalChunks` of logical ``shape`` holding the rectangular ``boxes`` ``[(offsets, tensor of the
    box's sizes)]`` as views (each cut by :func:`box_pieces`); ``dtype`` / ``device`` are the logical
    tensor's (given, since ``boxes`` may be empty: a rank holding no element of the tensor)."""
    return LocalChunks(shape, [p for offsets, box in boxes for p in box_pieces(offsets, box, max_bytes)],
                       dtype=dtype, device=device)


def lift_chunks(value: torch.Tensor, size: int, index: int, *, max_bytes: int = MAX_CHUNK_BYTES) -> LocalChunks:
    """``value`` (a :class:`LocalChunks` or a plain tensor of shape ``S``) as the pieces at leading
    coordinate ``index`` of a logical tensor of shape ``(size, *S)``: each piece ``(offsets, view)``
    becomes ``((index, *offsets), view.unsqueeze(0))`` (views of the same memory, so ``dcp.load`` into
    the result fills ``value``'s pieces in place). A plain tensor is one box, cut by :func:`box_pieces`
    (on a grid fixed in the lifted tensor's coordinates); a ``LocalChunks`` keeps its pieces. For
    per-replica values (DiLoCo: a replica's row of an ``(R, *S)`` tensor); no communication."""
    if not 0 <= index < size:
        raise ValueError(f"lift_chunks: index {index} is not in [0, {size})")
    if isinstance(value, LocalChunks):
        pieces = [((index, *o), v.unsqueeze(0)) for o, v in value.pieces]
    else:
        t = value.detach()
        pieces = box_pieces((index, *(0,) * t.dim()), t.unsqueeze(0), max_bytes)
    return LocalChunks((size, *value.shape), pieces, dtype=value.dtype, device=value.device)


def lower_chunks(value: LocalChunks, index: int) -> LocalChunks:
    """The inverse of :func:`lift_chunks`: the parts of ``value``'s pieces at leading coordinate ``index``
    as a :class:`LocalChunks` of shape ``value.shape[1:]`` (views: ``piece[index - offsets[0]]``); pieces at
    other leading coordinates are left out. No communication."""
    if value.dim() == 0:
        raise ValueError("lower_chunks: a 0-d LocalChunks has no leading dimension")
    pieces = [(o[1:], v[index - o[0]]) for o, v in value.pieces if o[0] <= index < o[0] + v.shape[0]]
    return LocalChunks(tuple(value.shape[1:]), pieces, dtype=value.dtype, device=value.device)


def whole_or_chunks(value: LocalChunks) -> torch.Tensor:
    """``value`` as a plain tensor when its pieces cover the whole logical tensor (the piece itself, no
    copy, when it is a single piece of the full shape; else :meth:`LocalChunks.to_full`), else ``value``
    unchanged. Pieces must not overlap (as :class:`LocalChunks` requires)."""
    held = sum(v.numel() for _o, v in value.pieces)
    if held != _prod(value.shape) or (held == 0 and not value.pieces):
        return value
    if len(value.pieces) == 1:
        return value.pieces[0][1]
    return value.to_full()
