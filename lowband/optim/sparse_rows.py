"""Sparse embedding tables inside :class:`lowband.optim.ShardedOptimizer`: row-aligned units whose
gradient reduce-scatter is the row-sparse exchange of :mod:`lowband.comm.sparse`.

Layout. A designated table (``rows x dim``, an AdamW parameter) gets a unit of its own, padded to
``Vp = ceil(rows / N) * N`` rows, so rank ``r`` owns the whole rows ``[r*Vp/N, (r+1)*Vp/N)`` (the flat
element range ``[r*Vp*dim/N, (r+1)*Vp*dim/N)`` of the unit buffers). Nothing else changes: the owner
runs AdamW on its slice and the parameter all-gather stays dense.

Communication per step (tags ``sparse:<table>:*``): one count all-gather (``plan``), then either two
variable-split all-to-alls (indices, rows) or, when the density-adaptive choice says dense is cheaper,
one dense reduce-scatter of the table. See :mod:`lowband.comm.sparse` for the cost model and the
equality with the dense reduce-scatter.

Where the touched rows come from: the trainer passes each step's host token batch to
:meth:`SparseTableUnit.observe` (``ShardedOptimizer.observe_tokens``) before forward, and may call
``plan`` right away so the count exchange (and a bad-token error) happens before any other collective
of the step. If no tokens were observed in a step (a plain training loop, a checkpoint's zero-grad
step), the rows are read from the gradient itself (non-zero rows; a device-to-host copy on CUDA), so
the result is right either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lowband.comm import Comm
from lowband.comm.sparse import MODES, RowsFn, RowTracker, SparsePlan, SparseRowExchange, SparseStats
from lowband.model.bigram import bigram_hash_np
from lowband.optim.buckets import Member, ParamSpec, UnitLayout
from lowband.plan import SPARSE_HASHES, ModelPlan, plan_for, tied_names

HASHES: dict[str, RowsFn | None] = {"none": None, "bigram": bigram_hash_np}
"""A sparse table's ``hash`` (:class:`lowband.plan.SparseTableSpec`): the rows function its touched rows
follow from the tokens with (``None``: row = token id)."""
assert tuple(HASHES) == SPARSE_HASHES


@dataclass
class SparseTable:
    """A table whose gradient travels row-sparse.

    Attributes:
        name: short name for tags, errors and logs (``"bigram"``, ``"tok_emb"``).
        param: the 2-D ``rows x dim`` parameter.
        hash: ``"none"`` (rows are token ids) or ``"bigram"`` (bigram hash of the tokens).
        vocab_size: valid token ids ``[0, vocab_size)`` (``None``: ``rows`` for ``"none"``, any for
            ``"bigram"``).
        check_rows: at each launch whose rows came from observed tokens, verify that the gradient has
            no non-zero row outside them (one pass over the table gradient; a device-to-host copy of a
            row mask on CUDA) and raise ``RuntimeError`` naming the table otherwise, so a use of the
            table the tokens do not describe (a tied output head, a functional use elsewhere) can
            never drop gradient rows silently. ``False`` skips the pass.

    Build one for any embedding parameter with :func:`sparse_table_for` (refuses tied weights by name)
    or from the model plan with :func:`sparse_tables_from_plan`.
    """

    name: str
    param: torch.Tensor
    hash: str = "none"
    vocab_size: int | None = None
    check_rows: bool = True

    def validate(self, where: str) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"{where}: sparse table name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.param, torch.Tensor) or self.param.dim() != 2:
            shape = tuple(self.param.shape) if isinstance(self.param, torch.Tensor) else type(self.param).__name__
            raise ValueError(f"{where}: sparse table {self.name!r} must be a 2-D (rows x dim) tensor, got {shape}")
        if self.hash not in HASHES:
            raise ValueError(f"{where}: sparse table {self.name!r}: hash={self.hash!r} is not allowed; "
                             f"allowed: {list(HASHES)}")


def validate_sparse_tables(tables: list[SparseTable], mode: str, where: str) -> None:
    """Check names are unique, params distinct, hash and mode allowed (no communication)."""
    if mode not in MODES:
        raise ValueError(f"{where}: sparse_mode={mode!r} is not allowed; allowed: {list(MODES)}")
    names, ids = set(), set()
    for t in tables:
        if not isinstance(t, SparseTable):
            raise TypeError(f"{where}: sparse_tables entries must be SparseTable, got {type(t).__name__}")
        t.validate(where)
        if t.name in names or id(t.param) in ids:
            raise ValueError(f"{where}: sparse table {t.name!r} is listed twice")
        names.add(t.name)
        ids.add(id(t.param))


def plan_row_units(specs: list[ParamSpec], world_size: int) -> list[UnitLayout]:
    """One row-aligned AdamW unit per table: ``Vp * dim`` elements, ``Vp`` = rows padded to ``N``."""
    units = []
    for spec in specs:
        rows, dim = spec.shape
        vp = -(-rows // world_size) * world_size
        unit = UnitLayout("adamw", spec.group, spec.dtype, spec.device, world_size, vp * dim)
        unit.members.append(Member(spec.index, spec.shape, 0, spec.numel))
        units.append(unit)
    return units


class SparseTableUnit:
    """Tracker + exchanger of one table unit; ``launch`` replaces the unit's dense reduce-scatter."""

    def __init__(self, table: SparseTable, comm: Comm, *, count_comm: Comm | None, mode: str,
                 wire_dtype: torch.dtype | None) -> None:
        rows, dim = table.param.shape
        self.table = table
        self.tracker = RowTracker(table.name, rows, rows_fn=HASHES[table.hash], vocab_size=table.vocab_size)
        self.exchange = SparseRowExchange(table.name, rows, dim, comm, count_comm=count_comm, mode=mode,
                                          wire_dtype=wire_dtype)
        self.plan_: SparsePlan | None = None
        self.observed = False
        self.from_tokens = False

    def observe(self, tokens: np.ndarray | torch.Tensor) -> None:
        """Add one batch (or microbatch) of host token ids of this step."""
        self.tracker.add(tokens)
        self.observed = True

    def plan(self, grad: torch.Tensor | None = None) -> SparsePlan | None:
        """Count exchange and choice for this step (idempotent within a step).

        Without observed tokens and without ``grad`` there is nothing to plan yet: returns ``None``
        (the launch will read the rows from the gradient).
        """
        if self.plan_ is None and not self.observed and grad is None:
            return None
        if self.plan_ is None:
            self.from_tokens = self.observed
            if self.observed:
                rows, bad = self.tracker.take()
            else:
                self.tracker.reset()
                rows = np.empty(0, dtype=np.int64) if grad is None else \
                    torch.nonzero(grad.detach().ne(0).any(dim=1)).view(-1).cpu().numpy()
                bad = None
            dtype = grad.dtype if grad is not None else self.table.param.dtype
            valid = (0, self.tracker.vocab_size) if self.tracker.vocab_size is not None else None
            self.plan_ = self.exchange.plan(rows, bad, grad_dtype=dtype, valid_range=valid)
        return self.plan_

    def launch(self, grad_shard: torch.Tensor, grad: torch.Tensor):
        """Start the exchange of ``grad`` (``rows x dim``) into ``grad_shard`` (average); async handle."""
        plan = self.plan(grad)
        assert plan is not None
        if self.table.check_rows and self.from_tokens:
            self._check_rows(grad, plan)
        handle = self.exchange.reduce_scatter(grad_shard, grad, plan, op="avg", async_op=True)
        self.reset()
        return handle

    def _check_rows(self, grad: torch.Tensor, plan: SparsePlan) -> None:
        touched = torch.nonzero(grad.detach().ne(0).any(dim=1)).view(-1).cpu().numpy()
        extra = np.setdiff1d(touched, plan.rows)
        if extra.size:
            raise RuntimeError(
                f"sparse table {self.table.name!r}: the gradient has {extra.size} non-zero rows that this "
                f"step's tokens do not name (first: {extra[:5].tolist()}); the table is used somewhere the "
                "tokens do not describe (a tied output head, a functional use), and a row-sparse exchange "
                "would drop those rows. Leave it out of the sparse tables (dense exchange is exact)")

    def reset(self) -> None:
        self.plan_ = None
        self.observed = False
        self.from_tokens = False

    @property
    def stats(self) -> SparseStats | None:
        return self.exchange.last_stats


def _tied_refusal(model: torch.nn.Module, param_name: str, where: str) -> None:
    """Raise ``ValueError`` if ``param_name`` is reachable under another name too (a tied weight)."""
    names = tied_names(model).get(param_name)
    if names:
        others = [n for n in names if n != param_name]
        raise ValueError(
            f"{where}: sparse table parameter {param_name!r} is tied to {others}: the other use's gradient "
            "touches rows that the input tokens do not name, so a row-sparse exchange would drop them. "
            "Leave this table out of the sparse tables (it then travels in a dense bucket, which is exact), "
            "or untie the weights")


def refuse_renormed_embeddings(module: torch.nn.Module, params: set[int], where: str) -> None:
    """Refuse an ``nn.Embedding(max_norm=...)`` whose weight is sharded: its forward renormalizes the rows this
    rank's batch looks up, in place, and the owner's all-gather then overwrites the rows another rank renormed
    (single-process torch renormalizes every row of the global batch): the ranks would agree on a table no
    single-process run computes."""
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.Embedding) and m.max_norm is not None and id(m.weight) in params:
            raise ValueError(
                f"{where}: embedding {name or type(m).__name__!r} has max_norm={m.max_norm}: its forward renormalizes "
                "the looked-up rows in place on each rank, and the sharded update would keep only the owner's "
                "renorm. Renormalize in the model instead (e.g. F.embedding(idx, w) / clamp of the row norms, "
                "without in-place writes), or keep this table out of the sharded optimizer")


def sparse_table_for(model: torch.nn.Module, param_name: str, *, name: str | None = None, hash: str = "none",
                     vocab_size: int | None = None) -> SparseTable:
    """A :class:`SparseTable` for any embedding parameter of ``model``, by its parameter path.

    Args:
        model: the model holding the table.
        param_name: the parameter's path as ``model.named_parameters()`` prints it, e.g.
            ``"transformer.wte.weight"``.
        name: short table name for tags and errors (default: ``param_name``).
        hash: ``"none"`` (row = token id) or ``"bigram"`` (:func:`lowband.model.bigram.bigram_hash_np`).
        vocab_size: valid token ids (``None``: the table's rows for ``"none"``).

    Raises:
        ValueError: no such parameter, not 2-D, tied to another parameter name (the tied use's
            gradient touches rows the tokens do not name: refused by name, never silently dropped), or an
            ``nn.Embedding`` with ``max_norm`` (its in-place renorm differs per rank).
    """
    where = "sparse_table_for"
    params = dict(model.named_parameters(remove_duplicate=False))
    if param_name not in params:
        raise ValueError(f"{where}: the model has no parameter {param_name!r}")
    _tied_refusal(model, param_name, where)
    refuse_renormed_embeddings(model, {id(params[param_name])}, where)
    table = SparseTable(name or param_name, params[param_name], hash=hash, vocab_size=vocab_size)
    table.validate(where)
    return table


def sparse_tables_from_plan(model: torch.nn.Module, names: list[str] | tuple[str, ...] | None = None, *,
                            plan: ModelPlan | None = None,
                            where: str = "sparse_tables_from_plan") -> list[SparseTable]:
    """The sparse tables a model plan declares (``plan`` default: :func:`lowband.plan.plan_for`).

    Args:
        model: the model.
        names: table names to use (``None``: every table of the plan).
        plan: the model's :class:`lowband.plan.ModelPlan`.
        where: prefix of error messages (e.g. the config key that named the tables).

    Raises:
        ValueError: a name the plan does not have, or a table tied to another parameter (see
            :func:`sparse_table_for`).
    """
    plan = plan if plan is not None else plan_for(model)
    specs = plan.sparse_tables if names is None else []
    if names is not None:
        for n in names:
            try:
                specs.append(plan.sparse_table(n))
            except KeyError as e:
                raise ValueError(f"{where}: {e.args[0]}") from None
    out = []
    for spec in specs:
        try:
            out.append(sparse_table_for(model, spec.param, name=spec.name, hash=spec.hash,
                                        vocab_size=plan.vocab_size))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return out


def check_untied(model: torch.nn.Module, tables: list[SparseTable], where: str) -> None:
    """Refuse (``ValueError``, by name) any table whose parameter is tied to another name in ``model``."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    for t in tables:
        if id(t.param) in name_of:
            try:
                _tied_refusal(model, name_of[id(t.param)], where)
            except ValueError as e:
                raise ValueError(f"{e} (table {t.name!r})") from None
