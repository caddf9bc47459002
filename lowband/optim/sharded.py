"""ZeRO-style sharded data-parallel optimizer: AdamW and Muon that reduce-scatter gradients, update
only the slice each rank owns, and all-gather the updated parameters, overlapped with backward.

Communication pattern (per step, per unit, N = data-parallel world size; see
:mod:`lowband.optim.buckets` for the layout):

1. **Backward.** A post-accumulate-grad hook per parameter copies ``p.grad`` into its unit's flat
   gradient buffer. When every member of a unit has been copied, and every earlier unit has been
   launched, the unit's ``reduce_scatter(op="avg", wire_dtype=fp32|bf16, async_op=True, tag="grad:*")``
   starts, so it overlaps the rest of backward. Units launch strictly in unit order on every rank,
   so all ranks issue the same collectives in the same order whatever their gradients.
2. **step().** Units not launched yet (a member got no gradient on this rank, or gradients were
   produced under :meth:`ShardedOptimizer.no_sync`) are launched in unit order: a member's slot
   takes ``p.grad`` if it exists, zeros otherwise. Then, unit by unit: wait for its reduce-scatter,
   update the owned slice (AdamW on a flat shard; Muon on whole owned matrices), launch
   ``all_gather(async_op=True, tag="param:*")`` of the updated slice straight into the flat
   parameter buffer, and move on while it is in flight. AdamW and Muon units share one loop, so
   their communication overlaps instead of running one kind after the other.
3. **Next forward.** ``param_gather="step"`` (default) waits for every all-gather at the end of
   ``step()``. ``param_gather="forward"`` (needs ``module=``) returns from ``step()`` with the gathers
   in flight and waits per unit in a forward pre-hook of each module that owns a member directly,
   i.e. just before first use; the next ``step()``, ``state_dict()`` and :meth:`wait_for_params`
   also wait. (A parameter used functionally by another module than its owner is not covered by
   the hooks; use ``"step"`` for such models.)

Bytes per rank per step (ring model): reduce-scatter ``(N-1)/N * numel * grad_wire_esize`` plus
all-gather ``(N-1)/N * numel * param_wire_esize`` per unit: the same as one all-reduce in fp32, 0.75x
of it with bf16 gradients, 0.5x with bf16 gradients and bf16 parameter gathers. Optional clipping
adds one all-reduce of one scalar.

State layout per rank: AdamW ``exp_avg``/``exp_avg_sq`` of ``numel / N`` elements per bucket (the
owned shard, accumulation dtype: fp32, or fp64 for fp64 parameters) plus an integer step; Muon a
``momentum_buffer`` ``[real_owned, rows, cols]`` per unit. ``self.state`` is keyed by unit index.
Parameters become views into the flat parameter buffers (``p.data`` is re-pointed at construction),
so the all-gather writes the parameters in place; gradients stay in ``p.grad`` (local, not averaged;
the averaged, possibly clipped, gradient lives in the owned shard).

Gradient accumulation: wrap every microbatch's backward but the last in ``with opt.no_sync():`` (or set
``opt.require_backward_grad_sync = False``); hooks then do nothing and ``p.grad`` accumulates as
usual; the last backward (outside ``no_sync``) launches the reduce-scatters. If the last one is also
inside ``no_sync``, ``step()`` still reduces everything, without overlap.

Frozen parameters (``requires_grad=False`` at construction) are left out of every unit and never
updated. A parameter that requires grad but gets none this step is treated as a zero gradient on
that rank (identically to DDP); unlike ``torch.optim.AdamW`` (which skips a parameter whose grad is
``None``), its moments decay and weight decay applies. With ``lr = 0`` and zero gradients a step
changes no parameter (checkpoint loaders rely on this).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lowband.comm import Comm, CommHandle
from lowband.optim.adamw import adamw_update_, validate_adamw_hparams
from lowband.optim.buckets import (
    ParamSpec,
    UnitLayout,
    layout_id,
    order_units,
    plan_adamw_buckets,
    plan_muon_units,
)
from lowband.optim.muon import muon_update_, validate_muon_hparams
from lowband.optim.sparse_rows import SparseTable, SparseTableUnit, plan_row_units, validate_sparse_tables

ALGORITHMS = ("adamw", "muon")
PARAM_GATHER = ("step", "forward")
GRAD_WIRE_DTYPES = (None, torch.float32, torch.bfloat16)
_WIRE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
               "bfloat16": torch.bfloat16}


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Unit:
    """Runtime buffers and per-step flags of one communication unit."""

    def __init__(self, layout: UnitLayout, params: list[torch.Tensor]) -> None:
        self.layout = layout
        self.params = params
        dev, dt = layout.device, layout.dtype
        self.grad_buf = torch.zeros(layout.numel, dtype=dt, device=dev)
        self.param_buf = torch.zeros(layout.numel, dtype=dt, device=dev)
        self.grad_shard = torch.zeros(layout.shard_numel, dtype=_acc_dtype(dt), device=dev)
        with torch.no_grad():
            for m, p in zip(layout.members, params, strict=True):
                view = self.param_buf[m.offset:m.offset + m.numel]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(m.shape)
        self.reset()

    def reset(self) -> None:
        self.copied = [False] * len(self.params)
        self.n_copied = 0
        self.launched = False
        self.rs: CommHandle | None = None
        self.reduced = False

    def grad_slot(self, i: int) -> torch.Tensor:
        m = self.layout.members[i]
        return self.grad_buf[m.offset:m.offset + m.numel]


class ShardedOptimizer(torch.optim.Optimizer):
    """Sharded data-parallel AdamW and/or Muon (one ``torch.optim.Optimizer``); see module docstring.

    Each param group has ``algorithm`` ``"adamw"`` (keys ``lr``, ``betas``, ``eps``, ``weight_decay``)
    or ``"muon"`` (keys ``lr``, ``momentum``, ``nesterov``, ``weight_decay``, ``ns_method``,
    ``ns_steps``, ``ns_dtype``; 2-D parameters only). Hyperparameters are read from the group at step
    time, so LR schedulers work. Groups cannot be added after construction.

    Args:
        params: tensors or param-group dicts.
        lr, betas, eps, weight_decay: AdamW defaults (``weight_decay`` also Muon's default).
        algorithm: default algorithm of a group that does not name one.
        momentum, nesterov, ns_method, ns_steps, ns_dtype: Muon defaults (see :mod:`lowband.optim.muon`).
        comm: the data-parallel :class:`lowband.comm.Comm` (default: world, or 1 rank if
            ``torch.distributed`` is not initialized).
        bucket_mb: unit size cap in MiB (> 0).
        grad_wire_dtype: ``None`` (parameter dtype), ``torch.float32`` or ``torch.bfloat16`` (or the
            names ``"fp32"``, ``"bf16"``): the dtype gradients travel in; the owner always
            accumulates in fp32 (fp64 for fp64 parameters).
        param_wire_dtype: same choices, for the parameter all-gather. ``bf16`` with fp32 parameters
            halves the gather bytes: the owner keeps an fp32 master copy of its slice
            (``state["master"]``, 1/N of the parameters) and every rank, the owner included, computes
            with the bf16-rounded values (modded-nanogpt's bf16 weights with fp32 master, PR #190).
        module: the model; needed for ``param_gather="forward"``.
        param_gather: ``"step"`` or ``"forward"`` (when the next forward waits for the all-gathers).
        sparse_tables: :class:`lowband.optim.sparse_rows.SparseTable` entries (2-D AdamW parameters):
            each becomes a row-aligned unit whose gradient reduce-scatter is the row-sparse exchange
            of :mod:`lowband.comm.sparse` (see :meth:`observe_tokens`, docs/sparse.md).
        sparse_mode: ``"auto"`` | ``"sparse"`` | ``"dense"`` for those tables.
        sparse_count_comm: gloo :class:`Comm` for their count all-gather (default ``comm``).

    Raises:
        ValueError: bad hyperparameters, a parameter in two groups, ``bucket_mb <= 0``, Muon on a
            tensor that is not 2-D (all before any collective), or parameters that differ between
            ranks (checked once with ``comm.agree``, on every rank alike).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, *, algorithm: str = "adamw",
                 momentum: float = 0.95, nesterov: bool = True, ns_method: str = "ns5", ns_steps: int = 5,
                 ns_dtype: torch.dtype = torch.bfloat16, comm: Comm | None = None, bucket_mb: float = 25.0,
                 grad_wire_dtype: torch.dtype | str | None = None,
                 param_wire_dtype: torch.dtype | str | None = None, module: nn.Module | None = None,
                 param_gather: str = "step", sparse_tables: Iterable[SparseTable] = (),
                 sparse_mode: str = "auto", sparse_count_comm: Comm | None = None) -> None:
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0 \
                or not math.isfinite(bucket_mb):
            raise ValueError(f"ShardedOptimizer: bucket_mb must be a positive number of MiB "
                             f"(got {bucket_mb!r})")
        if isinstance(grad_wire_dtype, str) and grad_wire_dtype in _WIRE_NAMES:
            grad_wire_dtype = _WIRE_NAMES[grad_wire_dtype]
        if grad_wire_dtype not in GRAD_WIRE_DTYPES:
            raise ValueError(f"ShardedOptimizer: grad_wire_dtype={grad_wire_dtype!r} is not allowed; "
                             "allowed: None (parameter dtype), torch.float32 ('fp32'), torch.bfloat16 ('bf16')")
        if isinstance(param_wire_dtype, str) and param_wire_dtype in _WIRE_NAMES:
            param_wire_dtype = _WIRE_NAMES[param_wire_dtype]
        if param_wire_dtype not in GRAD_WIRE_DTYPES:
            raise ValueError(f"ShardedOptimizer: param_wire_dtype={param_wire_dtype!r} is not allowed; "
                             "allowed: None (parameter dtype), torch.float32 ('fp32'), torch.bfloat16 ('bf16')")
        if param_gather not in PARAM_GATHER:
            raise ValueError(f"ShardedOptimizer: param_gather={param_gather!r} is not allowed; "
                             f"allowed: {list(PARAM_GATHER)}")
        if param_gather == "forward" and module is None:
            raise ValueError("ShardedOptimizer: param_gather='forward' needs module= (the model whose "
                             "forward pre-hooks wait for the all-gathers)")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"ShardedOptimizer: algorithm={algorithm!r} is not allowed; "
                             f"allowed: {list(ALGORITHMS)}")
        sparse_tables = list(sparse_tables)
        validate_sparse_tables(sparse_tables, sparse_mode, "ShardedOptimizer")
        groups = self._normalize_groups(params)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, algorithm=algorithm,
                        momentum=momentum, nesterov=nesterov, ns_method=ns_method, ns_steps=ns_steps,
                        ns_dtype=ns_dtype)
        self._constructed = False
        super().__init__(groups, defaults)
        self._validate_groups()

        self.comm = comm if comm is not None else Comm()
        self.bucket_mb = float(bucket_mb)
        self.grad_wire_dtype = grad_wire_dtype
        self.param_wire_dtype = param_wire_dtype
        self.param_gather = param_gather
        self.require_backward_grad_sync = True
        self.last_grad_norm: torch.Tensor | None = None

        all_params = [p for g in self.param_groups for p in g["params"]]
        fingerprint = ([(gi, g["algorithm"], tuple(p.shape), str(p.dtype), p.device.type, p.requires_grad)
                        for gi, g in enumerate(self.param_groups) for p in g["params"]],
                       [repr(sorted((k, repr(v)) for k, v in g.items() if k != "params"))
                        for g in self.param_groups],
                       self.bucket_mb, str(grad_wire_dtype), str(param_wire_dtype), param_gather,
                       [(t.name, tuple(t.param.shape), t.hash, t.vocab_size) for t in sparse_tables], sparse_mode)
        self.comm.agree(fingerprint, "ShardedOptimizer parameters (group, algorithm, shape, dtype, "
                                     "requires_grad) and settings")

        n = self.comm.size
        cap = max(1, int(self.bucket_mb * 2**20))
        adam_specs, muon_specs, row_specs = [], [], []
        table_of = {id(t.param): t for t in sparse_tables}
        idx = 0
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                if id(p) in table_of and (g["algorithm"] != "adamw" or not p.requires_grad):
                    raise ValueError(f"ShardedOptimizer: sparse table {table_of[id(p)].name!r} must be a "
                                     "trainable parameter of an algorithm='adamw' group")
                if p.requires_grad:
                    spec = ParamSpec(idx, gi, tuple(p.shape), p.dtype, p.device)
                    (row_specs if id(p) in table_of else muon_specs if g["algorithm"] == "muon"
                     else adam_specs).append(spec)
                idx += 1
        if len(row_specs) != len(sparse_tables):
            raise ValueError("ShardedOptimizer: every sparse table must be one of the optimizer's parameters")
        layouts = (plan_adamw_buckets(adam_specs, n, cap) + plan_muon_units(muon_specs, n, cap)
                   + plan_row_units(row_specs, n))
        layouts = order_units(layouts)
        self._layout_id = layout_id(layouts)
        self._units = [_Unit(lay, [all_params[m.index] for m in lay.members]) for lay in layouts]
        self._sparse: dict[int, SparseTableUnit] = {}
        for ui, unit in enumerate(self._units):
            t = table_of.get(id(unit.params[0])) if len(unit.params) == 1 else None
            if t is not None:
                self._sparse[ui] = SparseTableUnit(t, self.comm, count_comm=sparse_count_comm, mode=sparse_mode,
                                                   wire_dtype=grad_wire_dtype)
        self._next_launch = 0
        self._gathers: dict[int, CommHandle] = {}
        self._hooks: list[Any] = []
        for ui, unit in enumerate(self._units):
            for mi, p in enumerate(unit.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(ui, mi)))
        if module is not None and param_gather == "forward":
            owner = {id(p): ui for ui, u in enumerate(self._units) for p in u.params}
            for mod in module.modules():
                uis = sorted({owner[id(p)] for p in mod.parameters(recurse=False) if id(p) in owner})
                if uis:
                    self._hooks.append(mod.register_forward_pre_hook(self._make_forward_hook(uis)))
        self._constructed = True

    # ------------------------------------------------------------------------------ validation
    @staticmethod
    def _normalize_groups(params: Iterable) -> list[dict]:
        if isinstance(params, torch.Tensor):
            raise TypeError("ShardedOptimizer: params must be an iterable of tensors or of dicts, "
                            "not a single tensor")
        items = list(params)
        if not items:
            raise ValueError("ShardedOptimizer: params is an empty list")
        if all(isinstance(x, dict) for x in items):
            groups = [dict(x) for x in items]
        elif all(isinstance(x, torch.Tensor) for x in items):
            groups = [{"params": items}]
        else:
            raise TypeError("ShardedOptimizer: params must be all tensors or all param-group dicts")
        seen: dict[int, int] = {}
        for gi, g in enumerate(groups):
            if "params" not in g:
                raise ValueError(f"ShardedOptimizer: param_groups[{gi}] has no 'params' key")
            ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            g["params"] = ps
            for pi, p in enumerate(ps):
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"ShardedOptimizer: param_groups[{gi}]['params'][{pi}] is a "
                                    f"{type(p).__name__}, expected a torch.Tensor")
                if id(p) in seen:
                    raise ValueError(f"ShardedOptimizer: a parameter of shape {tuple(p.shape)} appears "
                                     f"twice (param_groups[{seen[id(p)]}] and param_groups[{gi}]); each "
                                     "parameter must be in exactly one group, once")
                seen[id(p)] = gi
        return groups

    def _validate_groups(self) -> None:
        for gi, g in enumerate(self.param_groups):
            where = f"ShardedOptimizer param_groups[{gi}]"
            if g["algorithm"] not in ALGORITHMS:
                raise ValueError(f"{where}: algorithm={g['algorithm']!r} is not allowed; "
                                 f"allowed: {list(ALGORITHMS)}")
            for pi, p in enumerate(g["params"]):
                if not p.is_floating_point():
                    raise TypeError(f"{where}: params[{pi}] has dtype {p.dtype}; expected a floating dtype")
            if g["algorithm"] == "adamw":
                validate_adamw_hparams(g["lr"], g["betas"], g["eps"], g["weight_decay"], where)
            else:
                validate_muon_hparams(g["lr"], g["momentum"], g["nesterov"], g["weight_decay"],
                                      g["ns_method"], g["ns_steps"], g["ns_dtype"], where)
                for pi, p in enumerate(g["params"]):
                    if p.dim() != 2:
                        raise ValueError(f"{where}: algorithm='muon' handles 2-D matrices, but params[{pi}] "
                                         f"has shape {tuple(p.shape)}; give embeddings, heads and "
                                         "1-D parameters to an algorithm='adamw' group")

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_constructed", False):
            raise ValueError("ShardedOptimizer: param groups cannot be added after construction (the "
                             "bucket layout is fixed); pass every group to the constructor")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------------- hooks and launch
    def _make_grad_hook(self, ui: int, mi: int):
        def hook(p: torch.Tensor) -> None:
            if not self.require_backward_grad_sync:
                return
            self._on_grad_ready(ui, mi, p)
        return hook

    def _make_forward_hook(self, uis: list[int]):
        def hook(_module: nn.Module, _args: Any) -> None:
            self._wait_gathers(uis)
        return hook

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within this context backward hooks do not communicate (gradient accumulation)."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    @torch.no_grad()
    def _on_grad_ready(self, ui: int, mi: int, p: torch.Tensor) -> None:
        unit = self._units[ui]
        if unit.launched:
            raise RuntimeError("ShardedOptimizer: a gradient arrived for a bucket whose reduce-scatter "
                               "already started this step; run all but the last microbatch's backward "
                               "inside optimizer.no_sync(), and call step() or zero_grad() between steps")
        assert p.grad is not None
        unit.grad_slot(mi).copy_(p.grad.reshape(-1))
        if not unit.copied[mi]:
            unit.copied[mi] = True
            unit.n_copied += 1
        while (self._next_launch < len(self._units)
               and self._units[self._next_launch].n_copied == len(self._units[self._next_launch].params)):
            self._launch(self._next_launch)

    def _launch(self, ui: int) -> None:
        unit = self._units[ui]
        assert ui == self._next_launch and not unit.launched
        wire = self.grad_wire_dtype or unit.layout.dtype
        if ui in self._sparse:  # row-sparse exchange of an embedding table (lowband.optim.sparse_rows)
            m = unit.layout.members[0]
            unit.rs = self._sparse[ui].launch(unit.grad_shard, unit.grad_buf[:m.numel].view(m.shape))
        else:
            unit.rs = self.comm.reduce_scatter(unit.grad_shard, unit.grad_buf, op="avg", wire_dtype=wire,
                                               async_op=True, tag=f"grad:{unit.layout.kind}")
        unit.launched = True
        self._next_launch += 1

    @torch.no_grad()
    def _launch_remaining(self) -> None:
        for ui in range(self._next_launch, len(self._units)):
            unit = self._units[ui]
            for mi, p in enumerate(unit.params):
                if not unit.copied[mi]:
                    slot = unit.grad_slot(mi)
                    if p.grad is not None:
                        slot.copy_(p.grad.reshape(-1))
                    else:
                        slot.zero_()
            self._launch(ui)

    def _reduce(self, unit: _Unit) -> None:
        if not unit.reduced:
            assert unit.rs is not None
            unit.rs.wait()
            unit.reduced = True

    def _wait_gathers(self, uis: Iterable[int] | None = None) -> None:
        keys = list(self._gathers) if uis is None else [u for u in uis if u in self._gathers]
        for ui in keys:
            self._gathers.pop(ui).wait()

    def wait_for_params(self) -> None:
        """Wait for every in-flight parameter all-gather (``param_gather="forward"`` mode)."""
        self._wait_gathers()

    def _reset_step(self) -> None:
        for unit in self._units:
            unit.reset()
        for su in self._sparse.values():
            su.reset()
        self._next_launch = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``p.grad`` and drop any reduce-scatter launched since the last step."""
        for unit in self._units:
            if unit.rs is not None:
                unit.rs.wait()
        self._reset_step()
        super().zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------------------ clipping
    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the averaged gradient to global L2 norm ``max_norm``; return the norm before clipping.

        Call after backward and before :meth:`step`. Waits for every reduce-scatter (launching any
        not yet launched), sums the squares of the owned shards, and all-reduces that one scalar
        (``tag="grad_norm"``). Scales the shards by ``min(1, max_norm / (norm + 1e-6))`` as
        ``torch.nn.utils.clip_grad_norm_`` does. ``max_norm=inf`` only measures.
        """
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ValueError(f"clip_grad_norm: max_norm must be a positive number (got {max_norm!r})")
        self._wait_gathers()
        self._launch_remaining()
        wide = any(u.grad_shard.dtype == torch.float64 for u in self._units)
        acc = torch.float64 if wide else torch.float32
        device = self._units[0].grad_shard.device if self._units else torch.device("cpu")
        total = torch.zeros(1, dtype=acc, device=device)
        for unit in self._units:
            self._reduce(unit)
            g = unit.grad_shard if unit.grad_shard.dtype == acc else unit.grad_shard.to(acc)
            total += torch.dot(g, g)
        self.comm.all_reduce(total, "sum", tag="grad_norm")
        norm = total.sqrt()[0]
        if math.isfinite(max_norm):
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            if float(coef) < 1.0:  # multiplying by exactly 1 would change nothing: skip the pass
                for unit in self._units:
                    unit.grad_shard.mul_(coef.to(unit.grad_shard.dtype))
        self.last_grad_norm = norm
        return norm

    # ---------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Reduce, update the owned slices, gather; returns ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._wait_gathers()
        self._launch_remaining()
        rank = self.comm.rank
        for ui, unit in enumerate(self._units):
            self._reduce(unit)
            group = self.param_groups[unit.layout.group]
            if unit.layout.kind == "adamw":
                self._adamw_step(ui, unit, group, rank)
            else:
                self._muon_step(ui, unit, group, rank)
            lo, hi = unit.layout.owner_range(rank)
            self._gathers[ui] = self.comm.all_gather(unit.param_buf, unit.param_buf[lo:hi], async_op=True,
                                                     wire_dtype=self._param_wire(unit),
                                                     tag=f"param:{unit.layout.kind}")
        if self.param_gather == "step":
            self._wait_gathers()
        self._reset_step()
        return loss

    def _param_wire(self, unit: _Unit) -> torch.dtype:
        return self.param_wire_dtype or unit.layout.dtype

    def _master(self, unit: _Unit, own: torch.Tensor, state: dict) -> torch.Tensor:
        """The tensor the update is applied to: the owned slice itself, or, when parameters travel
        narrower than they are stored (bf16 gather of fp32 params) or are stored narrower than fp32,
        an fp32 master copy of the owned slice kept in ``state["master"]``."""
        acc = unit.grad_shard.dtype
        if own.dtype == acc and self._param_wire(unit) == own.dtype:
            return own
        if "master" not in state:
            state["master"] = own.to(acc).clone()
        return state["master"]

    def _adamw_step(self, ui: int, unit: _Unit, group: dict, rank: int) -> None:
        lo, hi = unit.layout.owner_range(rank)
        shard = unit.param_buf[lo:hi]
        state = self.state[ui]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(unit.grad_shard)
            state["exp_avg_sq"] = torch.zeros_like(unit.grad_shard)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        target = self._master(unit, shard, state)
        adamw_update_(target, unit.grad_shard, state["exp_avg"], state["exp_avg_sq"], step=state["step"],
                      lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                      weight_decay=group["weight_decay"])
        if target is not shard:
            shard.copy_(target)

    def _muon_step(self, ui: int, unit: _Unit, group: dict, rank: int) -> None:
        lay = unit.layout
        assert lay.matrix_shape is not None and lay.real_per_rank is not None
        rows, cols = lay.matrix_shape
        c = lay.slots_per_rank
        real = lay.real_per_rank[rank]
        state = self.state[ui]
        if not state:
            state["momentum_buffer"] = torch.zeros(real, rows, cols, dtype=unit.grad_shard.dtype,
                                                   device=unit.grad_shard.device)
        if real == 0:
            return
        own = unit.param_buf.view(-1, rows, cols)[rank * c:rank * c + real]
        grads = unit.grad_shard.view(c, rows, cols)[:real]
        target = self._master(unit, own, state)
        muon_update_(target, grads, state["momentum_buffer"], lr=group["lr"], momentum=group["momentum"],
                     nesterov=group["nesterov"], weight_decay=group["weight_decay"],
                     ns_method=group["ns_method"], ns_steps=group["ns_steps"], ns_dtype=group["ns_dtype"])
        if target is not own:
            own.copy_(target)

    # -------------------------------------------------------------------------- sparse tables
    @property
    def sparse_units(self) -> dict[str, SparseTableUnit]:
        """The row-sparse table units by table name."""
        return {su.table.name: su for su in self._sparse.values()}

    def observe_tokens(self, tokens: torch.Tensor) -> None:
        """Record this step's host token ids (a batch or one microbatch; call before forward) for the
        sparse tables' touched rows. No communication."""
        for su in self._sparse.values():
            su.observe(tokens)

    def plan_sparse(self) -> None:
        """Run the count all-gather of every sparse table with observed tokens now (before forward),
        in unit order; raises the out-of-range-token ``ValueError`` on every rank alike. Optional (the
        launch does it otherwise); call it on every rank alike."""
        for su in self._sparse.values():
            su.plan()

    def sparse_stats(self) -> dict[str, Any]:
        """Last step's :class:`lowband.comm.sparse.SparseStats` per sparse table (density, bytes, mode)."""
        return {su.table.name: su.stats for su in self._sparse.values() if su.stats is not None}

    # ------------------------------------------------------------------------- introspection
    @property
    def units(self) -> list[UnitLayout]:
        """The communication units (layouts), in launch order."""
        return [u.layout for u in self._units]

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors held by this rank (moments / momentum of owned slices)."""
        return sum(v.numel() * v.element_size() for st in self.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor))

    def _packed_groups(self) -> list[dict]:
        out, idx = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(idx, idx + len(g["params"])))
            idx += len(g["params"])
            out.append(packed)
        return out

    def _load_groups(self, groups: list[dict], what: str) -> None:
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise ValueError(f"{what}: param_groups do not match this optimizer's (number of groups or "
                             "parameters per group differ)")
        for saved, g in zip(groups, self.param_groups):
            for k, v in saved.items():
                if k != "params":
                    g[k] = tuple(v) if k == "betas" else v

    # ---------------------------------------------------------------------------- state dicts
    def state_dict(self) -> dict:  # type: ignore[override]
        """This rank's shard of the state (no communication).

        ``{"state": {unit_index: {...}}, "param_groups": [...], "sharding": {"world_size", "rank",
        "layout"}}``. Load it with :meth:`load_state_dict` into an optimizer with the same layout
        (same world size, parameters, groups and ``bucket_mb``); to change the world size use
        :meth:`full_state_dict` / :meth:`load_full_state_dict`.
        """
        self._wait_gathers()
        state = {ui: dict(st) for ui, st in self.state.items()}
        return {"state": state, "param_groups": self._packed_groups(),
                "sharding": {"world_size": self.comm.size, "rank": self.comm.rank, "layout": self._layout_id}}

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        """Load a :meth:`state_dict` taken on this rank of an identically laid-out optimizer."""
        sh = state_dict.get("sharding") if isinstance(state_dict, dict) else None
        if sh is None:
            raise ValueError("load_state_dict: not a sharded state dict (no 'sharding' key); for a "
                             "torch-format (full) state dict use load_full_state_dict")
        if (sh["world_size"], sh["rank"], sh["layout"]) != (self.comm.size, self.comm.rank, self._layout_id):
            raise ValueError(f"load_state_dict: saved with world_size={sh['world_size']}, rank={sh['rank']}, "
                             f"layout={sh['layout']}; this optimizer has world_size={self.comm.size}, "
                             f"rank={self.comm.rank}, layout={self._layout_id}; use full_state_dict / "
                             "load_full_state_dict to reshard")
        self._load_groups(state_dict["param_groups"], "load_state_dict")
        self.state.clear()
        for ui, st in state_dict["state"].items():
            unit = self._units[int(ui)]
            dev, acc = unit.grad_shard.device, unit.grad_shard.dtype
            self.state[int(ui)] = {k: (v.to(device=dev, dtype=acc).clone() if isinstance(v, torch.Tensor) else v)
                                   for k, v in st.items()}

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """The whole optimizer state in ``torch.optim`` format, identical on every rank (collective).

        ``{"state": {param_index: {"step", "exp_avg", "exp_avg_sq"} | {"momentum_buffer"}},
        "param_groups": [...]}``, parameter indices in param-group order, as
        ``torch.optim.AdamW.state_dict()`` numbers them. Every rank must call it; it issues one
        all-gather per state tensor per unit (``tag="state"``).
        """
        self._wait_gathers()
        rank = self.comm.rank
        out: dict[int, dict] = {}
        for ui, unit in enumerate(self._units):
            st = self.state.get(ui)
            lay = unit.layout
            if not st:
                continue
            if lay.kind == "adamw":
                fulls = {}
                for key in ("exp_avg", "exp_avg_sq"):
                    full = torch.empty(lay.numel, dtype=st[key].dtype, device=st[key].device)
                    self.comm.all_gather(full, st[key], tag="state")
                    fulls[key] = full
                for m in lay.members:
                    out[m.index] = {"step": torch.tensor(float(st["step"]), dtype=torch.float32),
                                    **{k: f[m.offset:m.offset + m.numel].view(m.shape).clone()
                                       for k, f in fulls.items()}}
            else:
                assert lay.matrix_shape is not None and lay.real_per_rank is not None
                rows, cols = lay.matrix_shape
                c = lay.slots_per_rank
                mom = st["momentum_buffer"]
                chunk = torch.zeros(c, rows, cols, dtype=mom.dtype, device=mom.device)
                chunk[:lay.real_per_rank[rank]].copy_(mom)
                full = torch.empty(lay.numel, dtype=mom.dtype, device=mom.device)
                self.comm.all_gather(full, chunk, tag="state")
                full3 = full.view(-1, rows, cols)
                for m in lay.members:
                    out[m.index] = {"momentum_buffer": full3[m.offset // (rows * cols)].clone()}
        return {"state": dict(sorted(out.items())), "param_groups": self._packed_groups()}

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`full_state_dict` (or a ``torch.optim.AdamW`` state dict for AdamW groups),
        taking this rank's slices; no communication, any world size. A parameter missing from
        ``state`` starts from zeros; AdamW members of one bucket must share one step count."""
        self._load_groups(state_dict["param_groups"], "load_full_state_dict")
        saved = {int(k): v for k, v in state_dict["state"].items()}
        rank = self.comm.rank
        self.state.clear()
        for ui, unit in enumerate(self._units):
            lay = unit.layout
            present = [m for m in lay.members if m.index in saved]
            if not present:
                continue
            acc, dev = unit.grad_shard.dtype, unit.grad_shard.device
            if lay.kind == "adamw":
                steps = {int(float(saved[m.index]["step"])) for m in present}
                if len(steps) != 1:
                    raise ValueError(f"load_full_state_dict: parameters {[m.index for m in present]} share a "
                                     f"bucket but have different steps {sorted(steps)}")
                lo, hi = lay.owner_range(rank)
                st: dict[str, Any] = {"step": steps.pop()}
                for key in ("exp_avg", "exp_avg_sq"):
                    shard = torch.zeros(lay.shard_numel, dtype=acc, device=dev)
                    for m in present:
                        a, b = max(lo, m.offset), min(hi, m.offset + m.numel)
                        if a < b:
                            src = saved[m.index][key].reshape(-1)
                            shard[a - lo:b - lo].copy_(src[a - m.offset:b - m.offset])
                    st[key] = shard
                self.state[ui] = st
            else:
                assert lay.matrix_shape is not None and lay.real_per_rank is not None
                rows, cols = lay.matrix_shape
                c = lay.slots_per_rank
                real = lay.real_per_rank[rank]
                mom = torch.zeros(real, rows, cols, dtype=acc, device=dev)
                for m in present:
                    slot = m.offset // (rows * cols) - rank * c
                    if 0 <= slot < real:
                        mom[slot].copy_(saved[m.index]["momentum_buffer"])
                self.state[ui] = {"momentum_buffer": mom}

    def remove_hooks(self) -> None:
        """Remove the gradient and forward hooks this optimizer registered."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


class ShardedAdamW(ShardedOptimizer):
    """:class:`ShardedOptimizer` with every group on AdamW (torch ``AdamW`` defaults)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, **kwargs: Any) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, algorithm="adamw",
                         **kwargs)


class ShardedMuon(ShardedOptimizer):
    """Muon for ``muon_params`` (2-D hidden matrices) and AdamW for ``adamw_params`` (embeddings,
    head, 1-D parameters), driven by one :class:`ShardedOptimizer` (group 0 Muon, group 1 AdamW).

    Use :func:`split_params_for_muon` to split a model.
    """

    def __init__(self, muon_params: Iterable[torch.Tensor], adamw_params: Iterable[torch.Tensor], *,
                 lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True, weight_decay: float = 0.0,
                 ns_method: str = "ns5", ns_steps: int = 5, ns_dtype: torch.dtype = torch.bfloat16,
                 adamw_lr: float = 3e-4, adamw_betas: tuple[float, float] = (0.9, 0.95),
                 adamw_eps: float = 1e-8, adamw_weight_decay: float = 0.0, **kwargs: Any) -> None:
        groups = []
        mp, ap = list(muon_params), list(adamw_params)
        if mp:
            groups.append({"params": mp, "algorithm": "muon", "lr": lr, "momentum": momentum,
                           "nesterov": nesterov, "weight_decay": weight_decay, "ns_method": ns_method,
                           "ns_steps": ns_steps, "ns_dtype": ns_dtype})
        if ap:
            groups.append({"params": ap, "algorithm": "adamw", "lr": adamw_lr, "betas": tuple(adamw_betas),
                           "eps": adamw_eps, "weight_decay": adamw_weight_decay})
        super().__init__(groups, ns_method=ns_method, ns_steps=ns_steps, ns_dtype=ns_dtype, **kwargs)


MUON_EXCLUDE = ("embed", "wte", "wpe", "head", "lm_head", "output")


def split_params_for_muon(model: nn.Module, exclude: Iterable[str] = MUON_EXCLUDE) -> tuple[list, list]:
    """Split ``model``'s parameters into (Muon, AdamW) lists.

    Muon gets the 2-D weights of ``nn.Linear`` modules whose qualified name contains none of
    ``exclude`` (substrings); AdamW gets everything else (embeddings, head, biases, norms, other
    parameters). Tied parameters are listed once.
    """
    excl = tuple(exclude)
    muon_ids: set[int] = set()
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and not any(e in name for e in excl):
            muon_ids.add(id(mod.weight))
    muon, adamw = [], []
    for p in model.parameters():
        (muon if id(p) in muon_ids and p.dim() == 2 else adamw).append(p)
    return muon, adamw
