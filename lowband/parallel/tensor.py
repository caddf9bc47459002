"""Megatron-style tensor-parallel linear layers over a TP :class:`~lowband.comm.Comm`.

``ColumnParallelLinear`` splits the output features: rank ``r`` of a TP group of size ``T`` holds rows
``[r*out/T, (r+1)*out/T)`` of the dense ``weight`` (out x in) and the same slice of the bias. Its
input is replicated on every TP rank; its output is the rank's slice of the output features.

* forward: identity on the input (no traffic), ``Y_r = X W_r^T + b_r``; with ``gather_output=True``
  one all-gather of the output slices (backward: keep the local slice, no traffic).
* backward: ``dX`` is summed over the group with one all-reduce (``tag="tp:col_dx"``).

``RowParallelLinear`` splits the input features: rank ``r`` holds columns ``[r*in/T, (r+1)*in/T)`` of
``weight``; its input is the rank's slice of the input features (``input_is_parallel=True``, e.g. the
output of a ``ColumnParallelLinear``), or a replicated input that it slices itself (backward: one
all-gather of ``dX``). The bias is replicated.

* forward: partial output ``X_r W_r^T``, summed over the group with one all-reduce
  (``tag="tp:row_y"``), then ``+ b``.
* backward: identity on ``dY`` (no traffic).

Each sliced parameter carries its layout for optimizers and checkpoints (e.g.
:class:`lowband.optim.tp_rekls.TpRekls`): a :class:`lowband.sharding.Placement` (read it with
:func:`lowband.sharding.placement_of`) of the dense shape with one ``"tp"`` cut along dim 0 (rows, column-parallel)
or 1 (columns, row-parallel) whose ``group`` is the TP :class:`Comm`; a replicated bias has none.

Communicator: the layers run their collectives on ``tp_comm.private("tp")``, one process group of
their own shared by every TP layer built on the same ``Comm`` (created, among the TP group's
members, with the first layer), so collectives the user issues on the TP group can never pair with
them; the placement's ``"tp"`` group is that private ``Comm`` (its ``parent`` is the one passed in).

Agreement check: every TP collective of a layer carries the layer's signature, ``SITE_BITS`` (16)
elements of +-1 spelling a number the layer got at construction (layers are built in the same order on
every rank). Summed (all-reduce) each element is +-N exactly when every rank ran the same layer, and
gathered (all-gather) the signatures must be equal; otherwise every rank raises
:class:`TPCollectiveError` naming the layer it was running. So a TP layer run by some ranks only (a branch
chosen by a rank's own data) fails at its first collective on every rank, instead of pairing with
another layer's collective of the same shape and training on silently wrong sums.

Input check: a column-parallel layer's input (and a row-parallel layer's when it slices a replicated input
itself) is replicated, so every rank of the group must hold the same values. Each such layer folds a digest of
its input (:func:`_input_digest`: its rows' float32 sums, plain and position-weighted, as 64 bits; one read of
the input) into its group's pending digest, and the next TP collective on that group carries it as
``DIGEST_BITS`` (64) elements of +-1, checked like the signature: ranks whose inputs differ (dropout drawn
from per-rank RNG streams on activations the group holds whole, per-rank batches fed without
:class:`TPInputGather`) raise :class:`TPInputMismatchError` on every rank, naming the layers, at the first
collective after it (before the backward ends, so before any step), instead of training slices of no one
dense layer while the replicated weights drift apart.

Cost: ``CHECK_ELEMS`` (80) elements per TP collective (the all-reduce already worked on a copy: they are
appended to that copy; the all-gathers copy the local piece once more), and the digest's read of each
replicated input.

Initialization: the dense weight is drawn like ``torch.nn.Linear`` from the global RNG (or the given
generator) and sliced, so every TP rank must be in the same RNG state (``torch.manual_seed`` with the
same seed) to build the same dense layer; :meth:`from_dense` slices an existing ``nn.Linear``: into new
parameters, or (``adopt=True``, what :func:`~lowband.parallel.tp_shard.shard_tp` does) into the linear's own
``Parameter`` objects (:func:`adopt_slice`: ``.data`` re-pointed to the slice), so an optimizer built before
sharding trains the slices.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import zlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowband.comm import Comm
from lowband.comm.opaque import opaque
from lowband.parallel.dense import dense_linear, gather_tp
from lowband.parallel.tp_grads import is_tp_slice, note_adopted, track
from lowband.sharding import PLACEMENT_ATTR, Placement, Split, cut_of, place, placement_of

_LOCAL_STATE = [0]


class TPStateError(RuntimeError):
    """``state_dict()`` / ``load_state_dict()`` of a multi-rank TP layer outside :func:`local_state`.

    A TP parameter is one rank's slice stored under the dense weight's name, so a plain state dict
    (e.g. torch DCP's ``get_state_dict``) would label a slice as the whole. Use
    :class:`lowband.optim.tp_state.TPStateLayout` (DCP-ready, reshards across TP sizes) or
    :func:`lowband.parallel.unsharded_copy`.
    """


@contextlib.contextmanager
def local_state() -> Iterator[None]:
    """Allow plain ``state_dict``/``load_state_dict`` of TP layers (raw per-rank slices) in this block."""
    _LOCAL_STATE[0] += 1
    try:
        yield
    finally:
        _LOCAL_STATE[0] -= 1


def _guard_state(module: nn.Module) -> None:
    def check(mod: nn.Module, *args: Any) -> None:
        if mod.tp_comm.size > 1 and not _LOCAL_STATE[0]:
            raise TPStateError(
                f"state_dict()/load_state_dict() of a {type(mod).__name__} on a TP group of "
                f"{mod.tp_comm.size} ranks would label this rank's slice as the dense weight (a mislabeled "
                "checkpoint, e.g. with torch.distributed.checkpoint's get_state_dict); use "
                "lowband.optim.tp_state.TPStateLayout(model, optimizer, tp_size, dp_size) for "
                "checkpoints or lowband.parallel.unsharded_copy(model) for a plain model")

    module.register_state_dict_pre_hook(check)
    module.register_load_state_dict_pre_hook(check)


def permute_sections(x: torch.Tensor, sections: int, tp: int) -> torch.Tensor:
    """Reorder the rows of ``x`` (``sections`` equal concatenated sections, e.g. ``[q; k; v]``) so that
    Megatron chunk ``r`` of the result is ``[s_0 chunk r; s_1 chunk r; ...]``: every TP rank gets its
    part of every section."""
    if sections == 1:
        return x
    parts = [sec.chunk(tp, 0) for sec in x.chunk(sections, 0)]
    return torch.cat([parts[s][r] for r in range(tp) for s in range(sections)], dim=0)


def unpermute_sections(x: torch.Tensor, sections: int, tp: int) -> torch.Tensor:
    """Inverse of :func:`permute_sections`."""
    if sections == 1:
        return x
    per_rank = [c.chunk(sections, 0) for c in x.chunk(tp, 0)]
    return torch.cat([per_rank[r][s] for s in range(sections) for r in range(tp)], dim=0)


def _comm_or_local(tp_comm: Comm | None) -> Comm:
    if tp_comm is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("tensor-parallel layer: tp_comm is required when torch.distributed has "
                             "more than one rank (pass the TP group's Comm)")
        return Comm(name="tp")
    if not isinstance(tp_comm, Comm):
        raise TypeError(f"tensor-parallel layer: tp_comm must be a lowband.comm.Comm, got "
                        f"{type(tp_comm).__name__}")
    return tp_comm.private("tp")


def _check_split(what: str, features: int, size: int) -> None:
    if isinstance(features, bool) or not isinstance(features, int) or features < 1:
        raise ValueError(f"{what} must be a positive int, got {features!r}")
    if features % size:
        raise ValueError(f"{what}={features} is not divisible by the TP group size {size}")


def mark_partition(param: nn.Parameter, partition_dim: int | None, tp_comm: Comm,
                   full_shape: tuple[int, ...]) -> nn.Parameter:
    """Record a TP slice's layout on ``param``: a :class:`~lowband.sharding.Placement` of the dense
    ``full_shape`` cut along ``partition_dim`` over ``tp_comm`` (outermost: a GTP shard of the slice keeps its
    own cut inside), and watch its gradient for edits that make TP ranks step differently
    (:mod:`lowband.parallel.tp_grads`). ``partition_dim = None`` (a replicated bias) records nothing."""
    if partition_dim is None:
        return param
    cut = Split("tp", partition_dim, tp_comm.size, tp_comm.rank, group=tp_comm)
    inner = placement_of(param)
    if inner is None:
        place(param, Placement(tuple(full_shape), (cut,)))
    else:
        setattr(param, PLACEMENT_ATTR, inner.with_outer(cut, full_shape))
    track(param)
    return param


def adopt_slice(param: nn.Parameter, local: torch.Tensor, partition_dim: int, tp_comm: Comm,
                full_shape: tuple[int, ...]) -> nn.Parameter:
    """Make the user's dense ``param`` this rank's TP slice ``local`` (a part of its own values) in place:
    its ``.grad`` dropped (it has the dense shape), its ``.data`` re-pointed to a copy of ``local``, its layout
    recorded (:func:`mark_partition`: watched even while frozen, as a fresh slice is, so unfreezing it later
    is seen). The ``Parameter`` object, its ``requires_grad`` and its other attributes stay, so an optimizer
    that already holds it steps the slice. Optimizer state it already holds has the dense shape: the next
    ``step()`` of that optimizer refuses it (:class:`~lowband.parallel.tp_grads.TPOptimizerStateError`)."""
    dense_shape = tuple(param.shape)
    param.grad = None
    param.data = local.clone(memory_format=torch.contiguous_format)
    frozen = not param.requires_grad
    param.requires_grad_(True)
    try:
        mark_partition(param, partition_dim, tp_comm, full_shape)
    finally:
        param.requires_grad_(not frozen)
    if tuple(param.shape) != dense_shape:
        note_adopted(param, dense_shape)
    return param


def set_tp_layout(param: nn.Parameter, *, sections: int | None = None, name: str | None = None) -> None:
    """Amend a TP slice's placement: its cut dimension is ``sections`` fused sections (rows permuted, see
    :func:`permute_sections`), and/or its name (for messages). No-op for a parameter without a TP cut."""
    pl, cut = placement_of(param), cut_of(param, "tp")
    if pl is None or cut is None:
        return
    if sections is not None:
        cut2 = dataclasses.replace(cut, sections=sections)
        pl = dataclasses.replace(pl, splits=tuple(cut2 if s is cut else s for s in pl.splits))
    if name is not None:
        pl = dataclasses.replace(pl, name=name)
    setattr(param, PLACEMENT_ATTR, pl)


class TPCollectiveError(RuntimeError):
    """Ranks of a TP group paired collectives of different TP layers (a layer run by some ranks only)."""


class TPInputMismatchError(TPCollectiveError):
    """The ranks of a TP group computed a TP layer on different replicated inputs (per-rank dropout masks,
    per-rank batches without :class:`TPInputGather`): their slices no longer belong to one dense layer."""


SITE_BITS = 16
"""Elements of the layer signature each TP collective carries (see :func:`_signature`)."""

DIGEST_BITS = 64
"""Elements of the replicated-input digest each TP collective carries (see :func:`_note_replicated_input`)."""

CHECK_ELEMS = SITE_BITS + DIGEST_BITS
"""Elements every TP collective (of a layer with a signature) adds to its payload: signature and input digest."""


def _next_site(comm: Comm) -> int:
    """A number for a new TP layer on ``comm``: layers are built in the same order on every rank of the
    group (``shard_tp`` walks the model in module order), so a layer has the same number everywhere."""
    site = getattr(comm, "_tp_sites", 0) + 1
    comm._tp_sites = site
    return site


def _signature(site: int, like: torch.Tensor) -> torch.Tensor:
    """``SITE_BITS`` elements of +-1 spelling ``site`` in binary, in ``like``'s dtype and device.

    Summed over a group of N ranks every element is exactly +-N (representable in any float dtype for
    N <= 256, bf16's integer range) if and only if every rank ran the same layer; every rank sees the same
    sums, so every rank reaches the same verdict. Gathered, the signatures are compared directly."""
    bits = [1.0 if (site >> k) & 1 else -1.0 for k in range(SITE_BITS)]
    return torch.tensor(bits, dtype=like.dtype, device=like.device)


def _input_digest(x: torch.Tensor) -> torch.Tensor:
    """One int64 (a 1-element tensor on ``x``'s device) from ``x``'s values: its rows' float32 sums over the
    last dimension, summed plainly and with position weights, the two float32 results' bits read as one int64.
    Equal tensors give equal digests on every rank of a TP group (same kernel, same shape); a dropout mask or a
    batch that differs changes them. One read of ``x``, no copy of it, no host sync."""
    rows = x.detach().sum(dim=-1, dtype=torch.float32).reshape(-1)
    w = (torch.arange(rows.numel(), device=rows.device) % 7919 + 1).to(torch.float32)
    return torch.stack([rows.sum(), (rows * w).sum()]).view(torch.int64)


def _note_replicated_input(x: torch.Tensor, comm: Comm, site: int | None, name: str) -> None:
    """Fold the digest of the replicated input of TP layer ``name`` into ``comm``'s pending digest, which the
    next TP collective on ``comm`` (forward or backward, of any layer) carries and checks
    (:func:`_take_digest_bits`). Every rank of the group runs the same layers in the same order (the signature
    checks that), so every rank folds the same inputs and the digests must agree bit for bit."""
    if site is None or comm.size == 1:
        return
    d = _input_digest(x)
    prev = getattr(comm, "_tp_digest", None)
    if prev is not None:  # rotate left by one, then xor: order-sensitive, exact integer arithmetic
        d = ((prev << 1) | ((prev >> 63) & 1)) ^ d
    comm._tp_digest = d
    comm._tp_digest_names = [*getattr(comm, "_tp_digest_names", []), name]


def _take_digest_bits(comm: Comm, like: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """``DIGEST_BITS`` elements of +-1 spelling ``comm``'s pending input digest (all -1 when none is pending),
    in ``like``'s dtype and device, and the names of the layers whose inputs it covers; clears it."""
    d = getattr(comm, "_tp_digest", None)
    names = getattr(comm, "_tp_digest_names", [])
    comm._tp_digest, comm._tp_digest_names = None, []
    if d is None:
        return -torch.ones(DIGEST_BITS, dtype=like.dtype, device=like.device), []
    bits = (d.to(like.device) >> torch.arange(DIGEST_BITS, device=like.device)) & 1
    return (bits * 2 - 1).to(like.dtype), names


def _input_mismatch(comm: Comm, name: str, inputs: list[str]) -> TPInputMismatchError:
    layers = ", ".join(repr(n) for n in inputs[:4]) + (f" (and {len(inputs) - 4} more)" if len(inputs) > 4 else "")
    return TPInputMismatchError(
        f"TP: the ranks of TP group {comm.name!r} (size {comm.size}) computed layer {layers} on different inputs "
        f"(found at {name!r}'s collective): a TP layer's input is replicated, every rank of the group must hold "
        "the same values (each rank computes one slice of one dense layer; different inputs train a model that "
        "no single device would, and the ranks' replicated weights drift apart). Usual causes: a dropout (or "
        "another random op) on activations the TP group holds whole, drawn from each rank's own RNG (per-rank "
        "seeds): seed the ranks of a TP group alike (torch.manual_seed(seed + dp_rank)) so their masks agree, and "
        "draw per-rank batches from a torch.Generator of their own; or per-rank batches fed to the TP model: wrap "
        "it in TPInputGather(model, tp_comm) (the group computes on the union of its ranks' batches) or give every "
        "rank of a TP group the same batch")


def _mismatch(comm: Comm, name: str, what: str) -> TPCollectiveError:
    return TPCollectiveError(
        f"TP: layer {name!r} ran its {what} while another rank of TP group {comm.name!r} (size {comm.size}) "
        "ran a different TP layer's: every rank of a TP group must run every TP layer together, in the same "
        "order (a layer used by some ranks only, e.g. a branch chosen by the rank's own data, cannot be "
        "tensor-parallel: keep it out of the plan's parallel_linears so it stays replicated)")


def _check_tail(agrees: torch.Tensor, comm: Comm, name: str, what: str, inputs: list[str]) -> None:
    """``agrees``: one bool per check element (``CHECK_ELEMS``, signature first); one host read of both verdicts,
    the layer signature's before the input digest's."""
    layer_ok, inputs_ok = torch.stack([agrees[:SITE_BITS].all(), agrees[SITE_BITS:].all()]).tolist()
    if not layer_ok:
        raise _mismatch(comm, name, what)
    if not inputs_ok:
        raise _input_mismatch(comm, name, inputs)


def _summed_with_signature(x: torch.Tensor, comm: Comm, site: int | None, name: str, tag: str,
                           what: str) -> torch.Tensor:
    """All-reduce (sum) a copy of ``x`` with the layer signature appended; check it; return the sum."""
    if site is None:
        out = x.contiguous().clone()
        comm.all_reduce(out, "sum", tag=tag)
        return out
    bits, inputs = _take_digest_bits(comm, x)
    flat = torch.cat([x.reshape(-1), _signature(site, x), bits])
    comm.all_reduce(flat, "sum", tag=tag)
    _check_tail(flat[-CHECK_ELEMS:].abs() == comm.size, comm, name, what, inputs)
    return flat[:-CHECK_ELEMS].view(x.shape)


def _gathered_with_signature(x: torch.Tensor, comm: Comm, site: int | None, name: str, tag: str,
                             what: str) -> torch.Tensor:
    """All-gather ``x`` (``[n, *x.shape]``) with the layer signature appended to each rank's piece; check
    that every rank's signature equals this rank's."""
    xc = x.contiguous()
    n = comm.size
    if site is None:
        buf = torch.empty((n, *xc.shape), dtype=xc.dtype, device=xc.device)
        comm.all_gather(buf, xc, tag=tag)
        return buf
    sig = _signature(site, xc)
    bits, inputs = _take_digest_bits(comm, xc)
    piece = torch.cat([xc.reshape(-1), sig, bits])
    buf = torch.empty((n, piece.numel()), dtype=xc.dtype, device=xc.device)
    comm.all_gather(buf, piece, tag=tag)
    _check_tail((buf[:, -CHECK_ELEMS:] == torch.cat([sig, bits])).all(dim=0), comm, name, what, inputs)
    return buf[:, :-CHECK_ELEMS].reshape(n, *xc.shape)


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, site: int | None = None, name: str = "") -> torch.Tensor:
        ctx.comm, ctx.site, ctx.name = comm, site, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = _summed_with_signature(grad, ctx.comm, ctx.site, ctx.name, "tp:col_dx",
                                      "input-gradient all-reduce (backward)")
        return grad, None, None, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, site: int | None = None, name: str = "") -> torch.Tensor:
        return _summed_with_signature(x, comm, site, name, "tp:row_y", "output all-reduce (forward)")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; keep the local slice backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, site: int | None = None, name: str = "") -> torch.Tensor:
        ctx.comm = comm
        buf = _gathered_with_signature(x, comm, site, name, "tp:gather_y", "output all-gather (forward)")
        return torch.cat(list(buf.unbind(0)), dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm = ctx.comm
        return grad.chunk(comm.size, dim=-1)[comm.rank].contiguous(), None, None, None


class _ScatterToTP(torch.autograd.Function):
    """Keep the local slice of the last dim forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, site: int | None = None, name: str = "") -> torch.Tensor:
        ctx.comm, ctx.site, ctx.name = comm, site, name
        return x.chunk(comm.size, dim=-1)[comm.rank].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        buf = _gathered_with_signature(grad, ctx.comm, ctx.site, ctx.name, "tp:row_dx",
                                       "input-gradient all-gather (backward)")
        return torch.cat(list(buf.unbind(0)), dim=-1), None, None, None


# ``torch.compile``: each TP collective (with its autograd Function) is opaque to dynamo, a graph break
# that runs eagerly; the GEMMs and everything between the collectives are compiled. (The Functions' backward
# runs in the eager autograd engine, compiled autograd being off by default.)
@opaque
def copy_to_tp(x: torch.Tensor, comm: Comm, site: int | None = None, name: str = "") -> torch.Tensor:
    """Identity forward; all-reduce (sum, ``tp:col_dx``) of the gradient backward. ``x`` is replicated: its
    digest rides on the next TP collective (:func:`_note_replicated_input`)."""
    _note_replicated_input(x, comm, site, name)
    return _CopyToTP.apply(x, comm, site, name)


@opaque
def reduce_from_tp(x: torch.Tensor, comm: Comm, site: int | None = None, name: str = "") -> torch.Tensor:
    """All-reduce (sum, ``tp:row_y``) forward; identity backward."""
    return _ReduceFromTP.apply(x, comm, site, name)


@opaque
def gather_from_tp(x: torch.Tensor, comm: Comm, site: int | None = None, name: str = "") -> torch.Tensor:
    """All-gather along the last dim (``tp:gather_y``) forward; the local slice backward."""
    return _GatherFromTP.apply(x, comm, site, name)


@opaque
def scatter_to_tp(x: torch.Tensor, comm: Comm, site: int | None = None, name: str = "") -> torch.Tensor:
    """The local slice of the last dim forward; all-gather of the gradient (``tp:row_dx``) backward. ``x`` is
    replicated: its digest rides on the next TP collective (:func:`_note_replicated_input`)."""
    _note_replicated_input(x, comm, site, name)
    return _ScatterToTP.apply(x, comm, site, name)


def _dense_init(out_features: int, in_features: int, bias: bool, dtype: torch.dtype | None,
                device: torch.device | str | None,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``nn.Linear``'s default init (kaiming-uniform a=sqrt(5); bias U(-1/sqrt(in), 1/sqrt(in)))."""
    bound = 1.0 / in_features ** 0.5
    w = torch.empty(out_features, in_features, dtype=dtype, device=device)
    w.uniform_(-bound, bound, generator=generator)  # == kaiming_uniform_(a=sqrt(5)) for Linear
    b = None
    if bias:
        b = torch.empty(out_features, dtype=dtype, device=device).uniform_(-bound, bound,
                                                                            generator=generator)
    return w, b


_TP_PARAM_ATTRS = (PLACEMENT_ATTR, "tp_check_grad_edits", "tp_share_nonfinite")


class _CopyKeepsLayout:
    """``copy.deepcopy`` of a TP layer (an EMA copy of the model) keeps its parameters' TP layout.

    ``torch.nn.Parameter``'s own deep copy drops Python attributes, so the copied slices would lose
    their placement (and with it the global clip and :func:`unsharded_copy`). The copy
    shares the layer's TP group (:meth:`lowband.comm.Comm.__deepcopy__`), so every rank of the group must
    run it, as for the original; its slices' gradients are watched like the original's."""

    def __deepcopy__(self, memo: dict) -> Any:
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            object.__setattr__(new, k, copy.deepcopy(v, memo))
        for name, p in self.named_parameters(recurse=False):  # type: ignore[attr-defined]
            q = getattr(new, name)
            for attr in _TP_PARAM_ATTRS:
                if hasattr(p, attr):
                    setattr(q, attr, getattr(p, attr))
            if is_tp_slice(q):
                track(q)
        return new


class ColumnParallelLinear(_CopyKeepsLayout, nn.Module):
    """``Y = X W^T + b`` with ``W`` split by rows (output features) over the TP group.

    Args:
        in_features: dense input features (replicated input).
        out_features: dense output features; divisible by the TP size.
        tp_comm: the TP group's :class:`Comm` (``None`` only without a multi-rank default group).
        bias: add a bias (split like the output).
        gather_output: all-gather the output slices so every rank returns the dense output.
        dtype, device: of the parameters.
        generator: RNG for the dense init (default: the global RNG).

    Communication: backward all-reduces ``dX`` (one call, numel = input numel); forward is
    traffic-free unless ``gather_output`` (one all-gather of the output).
    """

    def __init__(self, in_features: int, out_features: int, tp_comm: Comm | None = None, *,
                 bias: bool = True, gather_output: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.tp_comm = _comm_or_local(tp_comm)
        n, r = self.tp_comm.size, self.tp_comm.rank
        _check_split("ColumnParallelLinear: out_features", out_features, n)
        _check_split("ColumnParallelLinear: in_features", in_features, 1)
        self.in_features, self.out_features, self.gather_output = in_features, out_features, gather_output
        w, b = _dense_init(out_features, in_features, bias, dtype, device, generator)
        self.weight = mark_partition(nn.Parameter(w.chunk(n, 0)[r].clone()), 0, self.tp_comm,
                                     (out_features, in_features))
        self.bias = None if b is None else mark_partition(nn.Parameter(b.chunk(n, 0)[r].clone()), 0,
                                                          self.tp_comm, (out_features,))
        self.tp_site = _next_site(self.tp_comm)
        self.tp_name = f"ColumnParallelLinear #{self.tp_site}"  # shard_tp sets the module's path
        _guard_state(self)

    @classmethod
    def from_dense(cls, linear: nn.Linear, tp_comm: Comm | None = None, *,
                   gather_output: bool = False, adopt: bool = False) -> ColumnParallelLinear:
        """This rank's slice of an existing dense ``nn.Linear`` (same on every TP rank): new parameters
        (``linear`` is left untouched), or with ``adopt=True`` (what :func:`~lowband.parallel.tp_shard.shard_tp`
        does) ``linear``'s own ``Parameter`` objects, their ``.data`` re-pointed to this rank's rows (see
        :func:`adopt_slice`), so an optimizer built before sharding trains them (``linear`` must not be used
        afterwards)."""
        layer = cls(linear.in_features, linear.out_features, tp_comm, bias=linear.bias is not None,
                    gather_output=gather_output, dtype=linear.weight.dtype, device=linear.weight.device)
        n, r = layer.tp_comm.size, layer.tp_comm.rank
        if adopt:
            full = (linear.out_features, linear.in_features)
            layer.weight = adopt_slice(linear.weight, linear.weight.detach().chunk(n, 0)[r], 0, layer.tp_comm, full)
            if linear.bias is not None:
                layer.bias = adopt_slice(linear.bias, linear.bias.detach().chunk(n, 0)[r], 0, layer.tp_comm,
                                         (linear.out_features,))
            return layer
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(n, 0)[r])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.chunk(n, 0)[r])
        layer.weight.requires_grad_(linear.weight.requires_grad)  # a frozen layer stays frozen
        if linear.bias is not None:
            layer.bias.requires_grad_(linear.bias.requires_grad)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_comm.size > 1:
            x = copy_to_tp(x, self.tp_comm, self.tp_site, self.tp_name)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output and self.tp_comm.size > 1:
            y = gather_from_tp(y, self.tp_comm, self.tp_site, self.tp_name)
        return y

    @property
    def sections(self) -> int:
        """Fused sections of the output rows (rows permuted, see :func:`permute_sections`): the weight's
        placement says (set by :func:`~lowband.parallel.tp_shard.shard_tp`); 1 for a plain layer."""
        cut = cut_of(self.weight, "tp")
        return cut.sections if cut is not None else 1

    def lowband_dense(self) -> nn.Linear:
        """The plain ``nn.Linear`` (collective over the TP group: all-gathers of the weight and bias rows,
        sections put back in dense order; see :mod:`lowband.parallel.dense`)."""
        n = self.tp_comm.size
        w = unpermute_sections(gather_tp(self.tp_comm, self.weight, 0), self.sections, n)
        b = None if self.bias is None else unpermute_sections(gather_tp(self.tp_comm, self.bias, 0),
                                                               self.sections, n)
        return dense_linear(w, b, self.weight)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.weight.shape[0]}), tp={self.tp_comm.size}, gather_output={self.gather_output}")


class RowParallelLinear(_CopyKeepsLayout, nn.Module):
    """``Y = X W^T + b`` with ``W`` split by columns (input features) over the TP group.

    Args:
        in_features: dense input features; divisible by the TP size.
        out_features: dense output features (replicated output).
        tp_comm: the TP group's :class:`Comm`.
        bias: add a replicated bias after the reduction.
        input_is_parallel: the input is already this rank's slice of the input features; if
            ``False`` the layer slices a replicated input (backward all-gathers ``dX``).
        dtype, device, generator: as for :class:`ColumnParallelLinear`.

    Communication: forward all-reduces the partial output (one call, numel = output numel);
    backward is traffic-free unless ``input_is_parallel=False``.
    """

    def __init__(self, in_features: int, out_features: int, tp_comm: Comm | None = None, *,
                 bias: bool = True, input_is_parallel: bool = True, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.tp_comm = _comm_or_local(tp_comm)
        n, r = self.tp_comm.size, self.tp_comm.rank
        _check_split("RowParallelLinear: in_features", in_features, n)
        _check_split("RowParallelLinear: out_features", out_features, 1)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        w, b = _dense_init(out_features, in_features, bias, dtype, device, generator)
        self.weight = mark_partition(nn.Parameter(w.chunk(n, 1)[r].contiguous()), 1, self.tp_comm,
                                     (out_features, in_features))
        self.bias = None if b is None else mark_partition(nn.Parameter(b), None, self.tp_comm,
                                                          (out_features,))
        self.tp_site = _next_site(self.tp_comm)
        self.tp_name = f"RowParallelLinear #{self.tp_site}"  # shard_tp sets the module's path
        _guard_state(self)

    @classmethod
    def from_dense(cls, linear: nn.Linear, tp_comm: Comm | None = None, *,
                   input_is_parallel: bool = True, adopt: bool = False) -> RowParallelLinear:
        """This rank's slice of an existing dense ``nn.Linear`` (same on every TP rank): new parameters
        (``linear`` is left untouched), or with ``adopt=True`` (what :func:`~lowband.parallel.tp_shard.shard_tp`
        does) ``linear``'s own ``Parameter`` objects: the weight's ``.data`` re-pointed to this rank's columns
        (see :func:`adopt_slice`), the replicated bias the same object, so an optimizer built before sharding
        trains them (``linear`` must not be used afterwards)."""
        layer = cls(linear.in_features, linear.out_features, tp_comm, bias=linear.bias is not None,
                    input_is_parallel=input_is_parallel, dtype=linear.weight.dtype,
                    device=linear.weight.device)
        n, r = layer.tp_comm.size, layer.tp_comm.rank
        if adopt:
            full = (linear.out_features, linear.in_features)
            layer.weight = adopt_slice(linear.weight, linear.weight.detach().chunk(n, 1)[r], 1, layer.tp_comm, full)
            if linear.bias is not None:
                layer.bias = linear.bias  # replicated: the user's own object, unchanged
            return layer
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(n, 1)[r])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        layer.weight.requires_grad_(linear.weight.requires_grad)  # a frozen layer stays frozen
        if linear.bias is not None:
            layer.bias.requires_grad_(linear.bias.requires_grad)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.tp_comm.size
        if not self.input_is_parallel and n > 1:
            x = scatter_to_tp(x, self.tp_comm, self.tp_site, self.tp_name)
        y = F.linear(x, self.weight)
        if n > 1:
            y = reduce_from_tp(y, self.tp_comm, self.tp_site, self.tp_name)
        if self.bias is not None:
            y = y + self.bias
        return y

    def lowband_dense(self) -> nn.Linear:
        """The plain ``nn.Linear`` (collective over the TP group: one all-gather of the weight columns)."""
        w = gather_tp(self.tp_comm, self.weight, 1)
        return dense_linear(w, None if self.bias is None else self.bias.detach(), self.weight)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), "
                f"out_features={self.out_features}, tp={self.tp_comm.size}, "
                f"input_is_parallel={self.input_is_parallel}")


_HEADER = 128
"""int64 words of the shape header :class:`TPInputGather` all-gathers before the inputs."""

_DTYPES = {d: i for i, d in enumerate((torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                       torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool))}


def _dtype_code(dtype: torch.dtype) -> int:
    """A dtype's number in the shape header: its index in ``_DTYPES``, else one from its name (the same on every
    rank; a crc32 of the name: two dtypes sharing one is a 2^-32 chance)."""
    return _DTYPES.get(dtype, 1000 + zlib.crc32(str(dtype).encode()))


def _shape_header(tensors: list[torch.Tensor]) -> list[int]:
    """``[count, (dtype code, ndim, *shape) per tensor]`` padded with -1 to ``_HEADER`` words; a description
    longer than that is ``[-1, digest of it, -1, ...]`` (then the ranks must agree exactly)."""
    words = [len(tensors)]
    for t in tensors:
        words += [_dtype_code(t.dtype), t.dim(), *t.shape]
    if len(words) > _HEADER:
        words = [-1, hash(tuple(words)) % 2**62]
    return words + [-1] * (_HEADER - len(words))


def _parse_header(header: list[int]) -> list[tuple[int, tuple[int, ...]]] | None:
    """``[(dtype code, shape)]`` of a :func:`_shape_header`, ``None`` for an over-long one."""
    if header[0] < 0:
        return None
    out, i = [], 1
    for _ in range(header[0]):
        nd = header[i + 1]
        out.append((header[i], tuple(header[i + 2:i + 2 + nd])))
        i += 2 + nd
    return out


def _describe(parsed: list[tuple[int, tuple[int, ...]]] | None) -> str:
    if parsed is None:
        return "too many to list"
    names = {c: str(d).removeprefix("torch.") for d, c in _DTYPES.items()}
    return ", ".join(f"{names.get(code, 'other')}{shape}" for code, shape in parsed) or "none"


class TPInputGather(nn.Module):
    """Calls a TP model on the union of the TP group's input slices (all-gathered in rank order).

    TP peers compute on the same microbatch. When every rank of a run is handed its own slice of the
    global batch (as data parallelism does), this wrapper all-gathers every tensor argument
    (positional or keyword) over the TP group (tag ``"tp:input"``, one all-gather each; other values
    pass through), so the TP group computes on the union. Returns whatever the wrapped model returns.

    The ranks' slices may differ in their first dimension (a last, smaller batch): before the inputs, one
    all-gather of a fixed ``_HEADER``-word int64 header (tag ``"tp:input_shapes"``; the tensors' count, dtypes
    and shapes) lets every rank pad its slices to the largest and keep only the real rows of each. Any other
    difference (another count of tensor arguments, dtype, or size beyond the first dimension) raises
    ``ValueError`` on every rank, naming each rank's shapes, instead of an all-gather of mismatched sizes (gloo
    aborts the process; NCCL's behaviour is undefined). The header costs one small collective and, on a GPU,
    one host read of it per forward.
    """

    def __init__(self, module: nn.Module, comm: Comm) -> None:
        super().__init__()
        self.module = module
        self.comm = comm.private("tp")

    def _rows_per_rank(self, tensors: list[torch.Tensor]) -> list[list[int]] | None:
        """Every rank's first-dimension size of each tensor argument (``[argument][rank]``; ``None`` when the
        arguments are too many to describe and must agree exactly); ``ValueError`` on every rank when anything
        but first sizes differs (one all-gather of the header, tag ``"tp:input_shapes"``)."""
        n = self.comm.size
        dev = tensors[0].device if tensors else torch.device("cpu")
        mine = torch.tensor(_shape_header(tensors), dtype=torch.int64, device=dev)
        buf = torch.empty((n, _HEADER), dtype=torch.int64, device=dev)
        self.comm.all_gather(buf, mine, tag="tp:input_shapes")
        headers = buf.tolist()
        parsed = [_parse_header(h) for h in headers]

        def joinable(p: list[tuple[int, tuple[int, ...]]] | None) -> Any:  # all but the first sizes
            return None if p is None else [(code, len(shape), shape[1:]) for code, shape in p]

        exact = any(p is None for p in parsed)
        if (exact and any(h != headers[0] for h in headers)) or any(joinable(p) != joinable(parsed[0]) for p in parsed):
            per_rank = "; ".join(f"rank {r}: {_describe(p)}" for r, p in enumerate(parsed))
            raise ValueError(
                f"TPInputGather: the ranks of TP group {self.comm.name!r} passed tensor arguments that cannot be "
                f"joined ({per_rank}): the group computes on the union of its ranks' inputs, so every rank must "
                "pass the same tensor arguments with the same dtype and sizes except the first (batch) dimension")
        if exact:
            return None
        return [[p[j][1][0] if p[j][1] else 1 for p in parsed] for j in range(len(tensors))]  # type: ignore[index]

    @opaque
    def _gather(self, x: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        if self.comm.size == 1:
            return x
        x = x.contiguous()
        if rows is None or x.dim() == 0 or len(set(rows)) == 1:
            buf = torch.empty((self.comm.size, *x.shape), dtype=x.dtype, device=x.device)
            self.comm.all_gather(buf, x, tag="tp:input")
            return buf.reshape(-1, *x.shape[1:])
        most = max(rows)  # ragged first dimension: pad to the largest, gather, keep each rank's real rows
        padded = torch.zeros((most, *x.shape[1:]), dtype=x.dtype, device=x.device)
        padded[: x.shape[0]] = x
        buf = torch.empty((self.comm.size, *padded.shape), dtype=x.dtype, device=x.device)
        self.comm.all_gather(buf, padded, tag="tp:input")
        return torch.cat([buf[r, :k] for r, k in enumerate(rows)])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.comm.size == 1:
            return self.module(*args, **kwargs)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        per_arg = self._rows_per_rank(tensors)
        rows = {id(t): None if per_arg is None else per_arg[j] for j, t in enumerate(tensors)}

        def g(a: Any) -> Any:
            return self._gather(a, rows[id(a)]) if isinstance(a, torch.Tensor) else a

        return self.module(*(g(a) for a in args), **{k: g(v) for k, v in kwargs.items()})
