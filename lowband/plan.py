"""Model plans: what a strategy needs to know about a model, stated once, next to the model.

lowband's components never spell out a model's attribute names. A model that wants tensor
parallelism, sparse embedding tables, Muon, or a hand-made DiLoCo fragment split ships a
:class:`ModelPlan` (lowband's GPT ships :func:`lowband.model.gpt_plan`); everything a plan leaves
out falls back to rules that hold for any ``nn.Module``:

* **tied / shared parameters** are detected, never declared: :func:`tied_groups` lists every
  parameter reachable under more than one name (``named_parameters(remove_duplicate=False)``), so a
  component can handle or refuse them by name.
* **Muon** takes every 2-D parameter except those in ``plan.adamw_only`` or ``plan.sparse_tables``
  and except any parameter of an ``nn.Embedding`` or tied to one (:func:`muon_split`).
* **fragments** default to the DiLoCo rule (blocks of the largest ``nn.ModuleList``); a plan can give
  its own ordered unit prefixes in ``fragment_units``.

A plan holds names only (module and parameter paths as ``named_modules()`` / ``named_parameters()``
print them); it holds no tensors and is cheap to build and to compare. No communication happens here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

SPARSE_HASHES = ("none", "bigram")


@dataclass(frozen=True)
class ParallelLinear:
    """One ``nn.Linear`` that tensor parallelism may split.

    Attributes:
        module: module path, e.g. ``"blocks.0.attn.qkv"``.
        style: ``"column"`` (output rows split; the output stays sharded) or ``"row"`` (input columns
            split; the partial outputs are all-reduced).
        sections: column only: the output rows are this many equal, concatenated sections that are
            each split across ranks (a fused ``[q | k | v]`` projection has 3), so every rank holds its
            part of every section.
        granule: rows (column) or columns (row) that must stay together on one rank: a head's width
            for attention projections, 1 otherwise. ``rows_per_section / tp`` must be a multiple.
    """

    module: str
    style: str
    sections: int = 1
    granule: int = 1

    def __post_init__(self) -> None:
        if self.style not in ("column", "row"):
            raise ValueError(f"ParallelLinear({self.module!r}): style must be 'column' or 'row', got {self.style!r}")
        if self.sections < 1 or self.granule < 1:
            raise ValueError(f"ParallelLinear({self.module!r}): sections and granule must be >= 1")
        if self.style == "row" and self.sections != 1:
            raise ValueError(f"ParallelLinear({self.module!r}): a row-parallel linear has one section")


@dataclass(frozen=True)
class SparseTableSpec:
    """An embedding table whose gradient may travel row-sparse.

    Attributes:
        name: short name used in configs, logs and ledger tags (``"tok_emb"``, ``"bigram"``).
        param: the table's parameter path, e.g. ``"tok_emb.weight"``.
        hash: how rows follow from input token ids: ``"none"`` (row = token id) or ``"bigram"``
            (:func:`lowband.model.bigram.bigram_hash_np` of consecutive tokens).
    """

    name: str
    param: str
    hash: str = "none"

    def __post_init__(self) -> None:
        if self.hash not in SPARSE_HASHES:
            raise ValueError(f"SparseTableSpec({self.name!r}): hash must be one of {SPARSE_HASHES}, got {self.hash!r}")


@dataclass(frozen=True)
class ModelPlan:
    """What strategies need to know about one model.

    Attributes:
        parallel_linears: linears tensor parallelism splits (empty: the model does not support TP).
        sparse_tables: tables a sparse embedding exchange may serve, by name.
        adamw_only: 2-D parameters Muon must not take (e.g. an untied output head).
        fragment_units: ordered module prefixes, each one DiLoCo fragment unit (``None``: the default
            rule of :func:`lowband.diloco.fragments.split_fragments`).
        vocab_size: the input vocabulary (token ids must be below it); ``None`` if unknown.
        tp_divisors: named sizes that the TP degree must divide, e.g. ``{"n_head": 4}``, checked by
            :meth:`check_tp` before any collective.
    """

    parallel_linears: tuple[ParallelLinear, ...] = ()
    sparse_tables: tuple[SparseTableSpec, ...] = ()
    adamw_only: tuple[str, ...] = ()
    fragment_units: tuple[str, ...] | None = None
    vocab_size: int | None = None
    tp_divisors: dict[str, int] = field(default_factory=dict)

    def sparse_table(self, name: str) -> SparseTableSpec:
        """The table called ``name``; ``KeyError`` naming the tables the plan has."""
        for t in self.sparse_tables:
            if t.name == name:
                return t
        raise KeyError(f"the model plan has no sparse table {name!r}; it has {[t.name for t in self.sparse_tables]}")

    def check_tp(self, tp: int) -> None:
        """Raise ``ValueError`` naming the first size that ``tp`` does not divide (or that TP is unplanned)."""
        if tp > 1 and not self.parallel_linears:
            raise ValueError("tensor parallelism: the model plan lists no parallel_linears")
        for name, value in self.tp_divisors.items():
            if value % tp:
                raise ValueError(f"tensor parallelism: {name} ({value}) must be divisible by the TP size {tp}")


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Every set of names that reach one parameter object, in registration order (singletons left out)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """Map each name of a tied parameter to all names of that parameter."""
    return {n: g for g in tied_groups(model) for n in g}


def embedding_params(model: nn.Module) -> set[int]:
    """``id()`` of every parameter that belongs to an ``nn.Embedding`` (and hence to whatever it is tied to)."""
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def muon_split(model: nn.Module, plan: ModelPlan | None = None) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon params, AdamW params) in registration order, each parameter once.

    Muon gets trainable 2-D parameters that are not embeddings (nor tied to one), not sparse tables
    of the plan and not in ``plan.adamw_only``; AdamW gets everything else.
    """
    plan = plan or ModelPlan()
    emb = embedding_params(model)
    excluded = set(plan.adamw_only) | {t.param for t in plan.sparse_tables}
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dim() == 2 and id(p) not in emb and name not in excluded:
            muon.append(p)
        else:
            adamw.append(p)
    return muon, adamw


PlanFactory = Callable[[nn.Module], ModelPlan]


def plan_for(model: nn.Module) -> ModelPlan:
    """The model's plan: ``model.lowband_plan()`` if it defines one, else an empty plan (generic rules)."""
    fn = getattr(model, "lowband_plan", None)
    if callable(fn):
        plan = fn()
        if not isinstance(plan, ModelPlan):
            raise TypeError(f"{type(model).__name__}.lowband_plan() must return a lowband.plan.ModelPlan, "
                            f"got {type(plan).__name__}")
        return plan
    return ModelPlan()
