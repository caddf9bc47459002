"""Tensor parallelism for any model with a plan: :func:`shard_tp` replaces the plan's linears in place.

The model plan (:class:`lowband.plan.ModelPlan`) lists the ``nn.Linear`` modules TP may split
(``parallel_linears``): ``column`` ones become :class:`~lowband.parallel.tensor.ColumnParallelLinear`
(output rows split; a fused projection of ``sections`` equal parts, e.g. ``[q | k | v]``, has its
rows reordered by :func:`~lowband.parallel.tensor.permute_sections` so that every rank holds its part
of every section, ``granule`` rows kept together, e.g. whole heads), ``row`` ones become
:class:`~lowband.parallel.tensor.RowParallelLinear` (input columns split, ``granule`` columns kept
together). Biases follow the layout (column: sliced like the rows; row: replicated, added after the
reduction). Everything else stays replicated.

Parameter identity: the TP layers keep the user's ``Parameter`` objects (``from_dense(..., adopt=True)``,
:func:`~lowband.parallel.tensor.adopt_slice`): a split weight's or bias's ``.data`` becomes this rank's
slice (its ``.grad`` dropped), a row-parallel bias is the same object, unchanged; ``requires_grad`` stays. So an
optimizer built before ``shard_tp`` (nanoGPT's order) trains every tensor, exactly as one built after. It must
not have stepped yet: state of a dense shape (an elementwise optimizer's moments) is refused at its next
``step()`` on every rank, naming the parameter (:class:`~lowband.parallel.tp_grads.TPOptimizerStateError`).
The replaced ``nn.Linear`` modules must not be used afterwards (their parameters are the slices).

State layout per TP rank ``r`` of ``T``: column weight rows ``[r*out/T, (r+1)*out/T)`` of the
(section-permuted) dense weight, its bias the same rows; row weight columns ``[r*in/T, (r+1)*in/T)``,
its bias whole. Each slice carries its :class:`~lowband.sharding.Placement` (the dense shape, the ``"tp"`` cut
with its sections and group, the parameter's name; see :mod:`lowband.parallel.tensor`).

Checks (before any collective, the same on every rank since they depend only on the model and the
plan): ``plan.check_tp(T)``; every planned module exists and is an ``nn.Linear``; divisibility of
each split by ``T * granule`` (per section); no planned linear shares a parameter with another module
(tied weights: TP would untie them; refused by name); no planned linear's parameter is already sharded
(carries a placement).

Communication: the initial-weight agreement (:mod:`lowband.parallel.init_sync`: by default one
broadcast per dtype from rank 0 of ``sync_comm``, default the TP group), then none; the layers'
own collectives are documented in :mod:`lowband.parallel.tensor`.
"""

from __future__ import annotations

from torch import nn

from lowband.comm import Comm
from lowband.parallel.init_sync import check_module_state, sync_module_state
from lowband.parallel.tensor import ColumnParallelLinear, RowParallelLinear, permute_sections, set_tp_layout
from lowband.plan import ModelPlan, ParallelLinear, tied_names
from lowband.sharding import placement_of


def _check_linear(model: nn.Module, pl: ParallelLinear, tp: int) -> nn.Linear:
    try:
        mod = model.get_submodule(pl.module)
    except AttributeError as e:
        raise ValueError(f"shard_tp: the plan's parallel linear {pl.module!r} is not a module of the model") from e
    if type(mod) is not nn.Linear:
        raise ValueError(f"shard_tp: the plan's parallel linear {pl.module!r} is a {type(mod).__name__}, "
                         "not an nn.Linear")
    if pl.style == "column":
        rows = mod.out_features // pl.sections
        if mod.out_features % pl.sections or rows % (tp * pl.granule):
            raise ValueError(f"shard_tp: column-parallel {pl.module!r}: out_features {mod.out_features} in "
                             f"{pl.sections} section(s) must split into TP {tp} parts of whole granules of "
                             f"{pl.granule} rows")
    elif mod.in_features % (tp * pl.granule):
        raise ValueError(f"shard_tp: row-parallel {pl.module!r}: in_features {mod.in_features} must split into "
                         f"TP {tp} parts of whole granules of {pl.granule} columns")
    for pn, p in mod.named_parameters(recurse=False):
        if placement_of(p) is not None:
            raise ValueError(f"shard_tp: {pl.module}.{pn} is already sharded (it carries a placement); shard_tp "
                             "takes the dense model")
    tied = tied_names(model)
    for pn in ("weight", "bias"):
        others = [n for n in tied.get(f"{pl.module}.{pn}", []) if n != f"{pl.module}.{pn}"]
        if others:
            raise ValueError(f"shard_tp: {pl.module}.{pn} is tied to {others}; tensor parallelism would untie "
                             "them: leave this linear out of the plan's parallel_linears (it then stays "
                             "replicated)")
    return mod


def shard_tp(model: nn.Module, plan: ModelPlan, comm: Comm, *, init_sync: bool = True,
             sync_comm: Comm | None = None, check_grad_edits: bool = True,
             share_nonfinite: bool = True) -> dict[str, nn.Module]:
    """Replace the plan's parallel linears of ``model`` (in place) by TP layers over ``comm``.

    Args:
        model: any module; the plan names its linears by ``named_modules()`` path.
        plan: the model's plan (``lowband.plan.plan_for(model)`` or a hand-written one).
        comm: the TP group.
        init_sync: ``True`` (default): broadcast every parameter and floating buffer from rank 0 of
            ``sync_comm`` first, so ranks seeded differently agree; ``False``: verify with one
            checksum exchange and raise ``ValueError`` on every rank if they differ.
        sync_comm: the group for the agreement (default ``comm``; pass the world's ``Comm`` when
            data parallelism runs across TP groups).
        check_grad_edits: ``True`` (default): ``optimizer.step()`` raises
            :class:`~lowband.parallel.tp_grads.TPGradEditError` when code outside lowband changed a TP
            slice's gradient after backward (``torch.nn.utils.clip_grad_norm_`` clips each TP rank by
            the norm of its own slices: use :func:`lowband.parallel.clip_grad_norm_`); ``False`` allows
            elementwise edits that are the same on every rank (``clip_grad_value_``, a scale).
        share_nonfinite: ``True`` (default): at the end of every backward a TP slice gradient holding
            inf/NaN on one rank is made to hold NaN on every rank of the TP group (one all-reduce of a
            flag per slice, ``tp:nonfinite``), so ``torch.amp.GradScaler`` skips alike, as under DDP;
            ``False`` skips the scan and the collective (:mod:`lowband.parallel.tp_grads`).

    Returns:
        ``{module path: TP layer}``.

    Raises:
        ValueError: the plan does not fit the model or the TP size, or a planned linear is tied
            (see the module docstring), before any collective.
    """
    tp = comm.size
    plan.check_tp(tp)
    mods = {pl.module: _check_linear(model, pl, tp) for pl in plan.parallel_linears}
    agree = (sync_comm if sync_comm is not None else comm).private("tp")  # lowband's own group
    if init_sync:
        sync_module_state(model, agree)
    else:
        check_module_state(model, agree)
    out: dict[str, nn.Module] = {}
    for pl in plan.parallel_linears:
        dense = mods[pl.module]
        if pl.style == "column":
            if pl.sections > 1:  # the fused rows in TP order, then sliced (the user's tensors, in place)
                dense.weight.data = permute_sections(dense.weight.detach(), pl.sections, tp)
                if dense.bias is not None:
                    dense.bias.data = permute_sections(dense.bias.detach(), pl.sections, tp)
            layer: nn.Module = ColumnParallelLinear.from_dense(dense, comm, adopt=True)
        else:
            layer = RowParallelLinear.from_dense(dense, comm, adopt=True)
        layer.tp_name = pl.module  # named in the TP agreement error (lowband.parallel.tensor)
        for pname, p in layer.named_parameters(recurse=False):
            # the placement's name is used in TPGradEditError (lowband.parallel.tp_grads); sections: fused rows
            set_tp_layout(p, sections=pl.sections if pl.style == "column" else 1, name=f"{pl.module}.{pname}")
            p.tp_check_grad_edits = check_grad_edits
            p.tp_share_nonfinite = share_nonfinite
        parent_name, _, child = pl.module.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
        out[pl.module] = layer
    return out
