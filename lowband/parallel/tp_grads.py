"""What torch code does to tensor-parallel gradients between backward and ``optimizer.step()``.

A TP parameter (one whose :class:`~lowband.sharding.Placement` has a ``"tp"`` cut,
:func:`~lowband.parallel.tensor.mark_partition`)
holds one rank's slice of a dense weight, and its ``.grad`` the slice of the dense gradient. Code that
reduces over "all gradients" per rank then reduces over *different* slices on every TP rank, and the
ranks step differently while every value still looks plausible. Two such habits of a DDP script, and
what this module does about each (no user call needed):

**Norm clipping.** ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` clips each TP rank
by the norm of its own slices. It is refused at the next ``optimizer.step()``
(:class:`TPGradEditError`, nothing stepped); the exact call is :func:`lowband.parallel.clip_grad_norm_`
(the norm of the whole logical gradient, as under DDP):

* a post-accumulate-grad hook on every TP slice records ``(.grad, .grad._version)`` each time autograd
  accumulates into it (by weak reference: a record never keeps a gradient alive);
* lowband's own edits (the data-parallel :func:`~lowband.parallel.gtp.reduce_grads`,
  :func:`lowband.parallel.clip_grad_norm_`, the inf/NaN sharing below) refresh the record
  (:func:`note_tp_grads`);
* a global optimizer step pre-hook raises when a TP slice the optimizer holds has a ``.grad`` that is
  not the recorded tensor at the recorded version (changed in place or replaced outside lowband); a
  step post-hook forgets the records of the parameters it stepped (a later ``.grad`` that no backward
  wrote is not an edit of one).

``zero_grad()`` (either mode), ``torch.amp.GradScaler``'s ``unscale_`` (its kernel does not bump the
version) and an optimizer skipping a parameter with no gradient pass. Elementwise edits that are the
same on every rank (``torch.nn.utils.clip_grad_value_``, a uniform scale) are exact under TP but are
refused too: ``shard_tp(..., check_grad_edits=False)`` (or ``param.tp_check_grad_edits = False`` on a
layer built directly) allows them. Not caught: edits that keep both the tensor and its version
(``.data`` writes).

**Overflow under a GradScaler.** Under DDP an inf/NaN anywhere in a gradient reaches every rank through
the gradient all-reduce, so ``GradScaler.unscale_`` finds it on every rank and all of them skip the step
and back off the scale. An overflow confined to one TP rank's slice would be found there only (that
rank skips, its peers step). At the end of every backward that accumulated into a TP slice, each rank
flags its slices whose gradient holds inf/NaN (one inf-norm read of each slice gradient) and the flags
are max-reduced over the TP group (one all-reduce of one float32 per TP slice, tag ``tp:nonfinite``, on
the TP layers' own process group, after their last backward collective); a slice flagged on some rank
and finite here gets NaN written into its first element, so every rank's scaler skips alike. No host
sync: each slice's first element is rewritten on the device with ``where(flag, nan, itself)`` (bitwise
itself when not flagged), so a CUDA stream runs on into the optimizer step.
``shard_tp(..., share_nonfinite=False)`` (or ``param.tp_share_nonfinite = False``) leaves a slice out
(then no collective runs if none is left). Without a GradScaler a non-finite gradient makes the
update non-finite anyway; the NaN lands in one more element of it.

**Optimizer state of the dense shape.** :func:`~lowband.parallel.tp_shard.shard_tp` keeps the user's
``Parameter`` objects (their ``.data`` becomes the slice), so an optimizer built before sharding steps the
slices. If that optimizer already holds state for such a parameter (it stepped, or loaded a state, before
sharding), the state has the dense shape; the same step pre-hook refuses it (:class:`TPOptimizerStateError`,
nothing stepped, on every rank of the TP group alike, since every rank's state has the same shapes) when every
non-scalar tensor of the parameter's state has the dense shape (an elementwise optimizer's moments; TP-REKLS
state, whose factors have other shapes, passes). ``optimizer.state.clear()`` starts the slices afresh.

**Optimizers that need the whole tensor.** The same pre-hook refuses, for any optimizer, a part of a sharded
weight (a TP slice or a GTP row shard) that the optimizer updates from statistics of the whole tensor it is given
(torch's ``Muon``, ``Adafactor``, ``LBFGS``; lowband's Muon, REKLS and the sharded optimizer's Muon groups:
:func:`lowband.sharding.refuse_sharded_whole_tensor_updates`), before anything steps; ``TpRekls`` (TP slices) and
``GTPMuon`` (GTP shards) handle their parts.

GTP shards (a ``"gtp"`` cut) are left to GTP's own check and sharing
(:meth:`lowband.parallel.gtp.GTPRuntime.check_grad_edits`, ``share_nonfinite``); a TP group of one
rank is left alone. Every rank of a TP group must run the same TP layers in the same backward (as the
TP layers' own collectives already require). Imports only :mod:`lowband.sharding` from lowband.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from lowband.comm import finite_probe
from lowband.sharding import Split, cut_of, placement_of, refuse_sharded_whole_tensor_updates


class TPGradEditError(RuntimeError):
    """Code outside lowband changed a tensor-parallel gradient between backward and ``optimizer.step()``."""


class TPOptimizerStateError(RuntimeError):
    """An optimizer holds state of a parameter's dense shape for the TP slice it became (:func:`note_adopted`)."""


# Keyed by identity (a tensor's == is elementwise): param -> (weak reference to the .grad autograd or
# lowband wrote, that tensor's _version); and the parameters that carry the hook.
_RECORDS = WeakIdKeyDictionary()
_HOOKED = WeakIdKeyDictionary()
# id(tp_comm) -> (tp_comm, weak references to its TP slices in creation order: the same on every rank)
_BY_COMM: dict[int, tuple[object, list[weakref.ref]]] = {}
_FIRED: dict[int, None] = {}  # the TP groups whose slices autograd accumulated into in this backward
_QUEUED = [-1]  # the graph task whose end runs _share_nonfinite
_ADOPTED = WeakIdKeyDictionary()  # a user's parameter made a TP slice in place -> its dense shape before


def is_tp_slice(p: torch.Tensor) -> bool:
    """True if ``p`` is a TP slice (a ``"tp"`` cut in its placement, of any group size)."""
    return cut_of(p, "tp") is not None


def _tp_only(p: torch.Tensor) -> Split | None:
    """The ``"tp"`` cut of a TP slice that is not also a GTP shard (GTP's runtime checks those)."""
    return cut_of(p, "tp") if cut_of(p, "gtp") is None else None


def _checked(p: torch.Tensor) -> bool:
    cut = _tp_only(p)
    return cut is not None and cut.group is not None and cut.size > 1


def _record(p: torch.Tensor) -> None:
    g = p.grad
    if g is None:
        _RECORDS.pop(p, None)
    else:
        _RECORDS[p] = (weakref.ref(g), g._version)


def _after_accumulate(p: torch.Tensor) -> None:
    """Post-accumulate-grad hook: autograd just wrote ``p.grad``."""
    if not _checked(p):
        return
    _record(p)
    if getattr(p, "tp_share_nonfinite", True):
        _FIRED[id(cut_of(p, "tp").group)] = None
        task = torch._C._current_graph_task_id()
        if _QUEUED[0] != task:
            _QUEUED[0] = task
            torch.autograd.Variable._execution_engine.queue_callback(_share_nonfinite)


@torch.no_grad()
def _share_nonfinite() -> None:
    """End of a backward: make a TP slice gradient holding inf/NaN on some rank of its TP group show
    it on every rank (see the module docstring). One all-reduce per TP group that got gradients."""
    fired = set(_FIRED)
    _FIRED.clear()
    _QUEUED[0] = -1
    for key, (comm, refs) in list(_BY_COMM.items()):  # creation order: the same on every rank
        if key not in fired:
            continue
        params = [p for p in (r() for r in refs) if p is not None and getattr(p, "tp_share_nonfinite", True)
                  and _tp_only(p) is not None]  # a GTP shard is GTP's (GTPRuntime.share_nonfinite)
        if not params:
            continue
        device = params[0].device
        mine = torch.zeros(len(params), dtype=torch.float32, device=device)
        idx = [i for i, p in enumerate(params) if p.grad is not None]
        if idx:
            bad = [~torch.isfinite(finite_probe(params[i].grad)) for i in idx]
            mine[idx] = torch.stack(bad).to(device=device, dtype=torch.float32)
        anywhere = mine.clone()
        comm.all_reduce(anywhere, "max", tag="tp:nonfinite")
        # Without a host sync (a CUDA stream keeps running): every slice's first element is rewritten with
        # itself (bitwise, -0.0 and NaN payloads included) or, flagged on another rank only, with NaN.
        poison = (anywhere > 0) & (mine == 0)
        nan = torch.full((), math.nan, dtype=torch.float32, device=device)
        for i in idx:
            g = params[i].grad
            first = (0,) * g.dim()
            g[first] = torch.where(poison[i], nan.to(g.dtype), g[first])
            _record(params[i])


def track(param: torch.Tensor) -> None:
    """Watch the gradient of a TP slice (idempotent; a parameter that does not require grad is skipped).
    Called by :func:`~lowband.parallel.tensor.mark_partition`, in the same order on every TP rank."""
    if param in _HOOKED or not param.requires_grad or not param.is_leaf:
        return
    param.register_post_accumulate_grad_hook(_after_accumulate)
    _HOOKED[param] = True
    comm = cut_of(param, "tp").group
    for key in [k for k, (_, refs) in _BY_COMM.items() if all(r() is None for r in refs)]:
        del _BY_COMM[key]  # a model (and its process group) gone: forget it
    _BY_COMM.setdefault(id(comm), (comm, []))[1].append(weakref.ref(param))


def note_adopted(param: torch.Tensor, dense_shape: tuple[int, ...]) -> None:
    """``param`` was a dense parameter of shape ``dense_shape`` and now holds a TP slice of another shape
    (:func:`~lowband.parallel.tensor.adopt_slice`): an optimizer step over it whose state for it is an
    elementwise optimizer's state of the dense shape (every non-scalar state tensor of ``dense_shape``:
    the optimizer stepped, or loaded a state, before sharding) raises :class:`TPOptimizerStateError`."""
    _ADOPTED[param] = tuple(dense_shape)


def _check_adopted_state(optimizer: torch.optim.Optimizer) -> None:
    for p in _optimizer_params(optimizer):
        dense = _ADOPTED.get(p)
        st = optimizer.state.get(p) if dense is not None else None
        if not st:
            continue
        shaped = [tuple(v.shape) for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        if shaped and all(s == dense for s in shaped):
            raise TPOptimizerStateError(
                f"tensor parallelism: {type(optimizer).__name__} holds state ({', '.join(sorted(st))}) of dense "
                f"shape {dense} for {_name(p)}, now this rank's slice of shape {tuple(p.shape)}: the optimizer "
                "stepped (or loaded a state) before shard_tp; build its state after sharding (an optimizer "
                "built before shard_tp but first stepped after it is fine), or clear it: optimizer.state.clear()")


def note_tp_grads(params: Iterable[torch.Tensor]) -> None:
    """lowband code rewrote the ``.grad`` of ``params``: make their current gradients the recorded ones."""
    for p in params:
        if p in _HOOKED and _checked(p):
            _record(p)


def _name(p: torch.Tensor) -> str:
    pl = placement_of(p)
    what = f"{pl.name!r}" if pl.name else f"of dense shape {pl.shape}"
    return f"the tensor-parallel parameter {what} (partition_dim={pl.split('tp').dim})"


def _optimizer_params(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


def _step_pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _ADOPTED:
        _check_adopted_state(optimizer)
    refuse_sharded_whole_tensor_updates(optimizer)
    if not _RECORDS:
        return
    for p in _optimizer_params(optimizer):
        rec = _RECORDS.get(p)
        g = p.grad
        if rec is None or g is None or not getattr(p, "tp_check_grad_edits", True):
            continue
        if rec[0]() is not g or g._version != rec[1]:
            raise TPGradEditError(
                f"tensor parallelism: the gradient of {_name(p)} was changed after backward by code outside "
                "lowband (e.g. torch.nn.utils.clip_grad_norm_, which clips each TP rank by the norm of its own "
                "slices, so TP ranks step differently); use lowband.parallel.clip_grad_norm_(model, max_norm) "
                "(the global norm, as under DDP), or shard_tp(..., check_grad_edits=False) for elementwise "
                "edits that are the same on every rank (clip_grad_value_, a scale)")


def _step_post_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _RECORDS:
        return
    for p in _optimizer_params(optimizer):
        _RECORDS.pop(p, None)


register_optimizer_step_pre_hook(_step_pre_hook)
register_optimizer_step_post_hook(_step_post_hook)
