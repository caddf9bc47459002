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
from lowband.comm.sparse import HASHES, MODES, RowTracker, SparsePlan, SparseRowExchange, SparseStats
from lowband.optim.buckets import Member, ParamSpec, UnitLayout


@dataclass
class SparseTable:
    """A table whose gradient travels row-sparse.

    Attributes:
        name: short name for tags, errors and logs (``"bigram"``, ``"tok_emb"``).
        param: the 2-D ``rows x dim`` parameter.
        hash: ``"none"`` (rows are token ids) or ``"bigram"`` (bigram hash of the tokens).
        vocab_size: valid token ids ``[0, vocab_size)`` (``None``: ``rows`` for ``"none"``, any for
            ``"bigram"``).
    """

    name: str
    param: torch.Tensor
    hash: str = "none"
    vocab_size: int | None = None

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
        self.tracker = RowTracker(table.name, rows, hash=table.hash, vocab_size=table.vocab_size)
        self.exchange = SparseRowExchange(table.name, rows, dim, comm, count_comm=count_comm, mode=mode,
                                          wire_dtype=wire_dtype)
        self.plan_: SparsePlan | None = None
        self.observed = False

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
        handle = self.exchange.reduce_scatter(grad_shard, grad, plan, op="avg", async_op=True)
        self.reset()
        return handle

    def reset(self) -> None:
        self.plan_ = None
        self.observed = False

    @property
    def stats(self) -> SparseStats | None:
        return self.exchange.last_stats


def sparse_tables_for_model(model: torch.nn.Module, names: list[str]) -> list[SparseTable]:
    """Map config names to the reference GPT's tables: ``"bigram"`` -> ``model.bigram.weight`` (bigram
    hash), ``"tok_emb"`` -> ``model.tok_emb.weight`` (token ids).

    Raises:
        ValueError: an unknown name, or ``"bigram"`` on a model without a bigram table.
    """
    allowed = ("bigram", "tok_emb")
    out = []
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    for name in names:
        if name not in allowed:
            raise ValueError(f"strategy.sparse_embeddings: {name!r} is not allowed; allowed: {list(allowed)}")
        if name == "bigram":
            if getattr(model, "bigram", None) is None:
                raise ValueError("strategy.sparse_embeddings: 'bigram' needs model.bigram_rows >= 2 "
                                 "(the model has no bigram table)")
            out.append(SparseTable("bigram", model.bigram.weight, hash="bigram", vocab_size=vocab))
        else:
            out.append(SparseTable("tok_emb", model.tok_emb.weight, hash="none", vocab_size=vocab))
    return out
