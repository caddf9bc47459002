"""Split a model into Streaming DiLoCo fragments and validate user-given fragments.

A fragment is an ordered list of the model's parameters that is synchronised as one unit. Split
with an int (:func:`split_fragments`): the model's parameters in registration order are grouped into
*units*, then the units are cut into ``n`` consecutive runs of about equal element count. The units
come from the model plan's ``fragment_units`` (:class:`lowband.plan.ModelPlan`, ordered module
prefixes; every trainable parameter must fall under exactly one prefix, by any of its names) when
the model has one, else from the default rule: one unit per block of the model's largest
``nn.ModuleList`` (a transformer's blocks) and one per other module owning parameters directly
(embeddings, final norm, head). User-given fragments (modules or lists of parameters) are checked:
every fragment non-empty, no parameter in two fragments, every trainable parameter in some fragment,
nothing foreign to the model.

Frozen parameters (``requires_grad=False`` when the fragments are cut) are in no fragment, whichever
way the split is given: they never change, so there is nothing to synchronise after the initial
``init_sync`` (which covers them). A user-given fragment that holds only frozen parameters is refused.

Tied / shared parameters (one tensor under several names, e.g. a token embedding tied to the output
head; :func:`lowband.plan.tied_groups`) are one parameter to DiLoCo: they sit in one fragment, under
their first name, and are synced once. A user-given split that puts a tied parameter's modules in two
fragments is refused, naming all of its names.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lowband.plan import ModelPlan, plan_for, tied_names


@dataclass
class Fragment:
    """One fragment: parameters (model order for the default split, user order otherwise).

    Attributes:
        index: position in the fragment list.
        names: the parameters' names in the model.
        params: the parameters themselves (shared with the model).
    """

    index: int
    names: list[str] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def _named_unique(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(model.named_parameters())  # deduplicates shared parameters, first name wins


def _blocks_prefix(model: nn.Module) -> str | None:
    best, best_numel = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2:
            numel = sum(p.numel() for p in mod.parameters())
            if numel > best_numel:
                best, best_numel = name, numel
    return best


def _units(model: nn.Module, params: list[tuple[str, nn.Parameter]]) -> list[list[tuple[str, nn.Parameter]]]:
    prefix = _blocks_prefix(model)
    units: list[list[tuple[str, nn.Parameter]]] = []
    keys: list[str] = []
    for name, p in params:
        key = name.rsplit(".", 1)[0] if "." in name else name  # the owning module
        if prefix is not None and name.startswith(prefix + "."):
            key = prefix + "." + name[len(prefix) + 1:].split(".", 1)[0]
        if keys and keys[-1] == key:
            units[-1].append((name, p))
        else:
            keys.append(key)
            units.append([(name, p)])
    return units


def _balanced_cuts(sizes: list[int], n: int) -> list[int]:
    """Cut points c_1 < ... < c_{n-1} so the runs sizes[c_i:c_{i+1}] have about equal sums."""
    total = sum(sizes)
    cum = [0]
    for s in sizes:
        cum.append(cum[-1] + s)
    cuts, prev = [], 0
    for i in range(1, n):
        target = total * i / n
        lo, hi = prev + 1, len(sizes) - (n - i)
        best = min(range(lo, hi + 1), key=lambda j: (abs(cum[j] - target), j))
        cuts.append(best)
        prev = best
    return cuts


def _plan_units(model: nn.Module, params: list[tuple[str, nn.Parameter]],
                units: Sequence[str]) -> list[list[tuple[str, nn.Parameter]]]:
    """Group ``params`` by the plan's ordered unit prefixes (a parameter goes to the first unit any of
    its names falls under); ``ValueError`` naming a parameter under no unit, or an empty unit."""
    all_names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        all_names.setdefault(id(p), []).append(name)
    groups: list[list[tuple[str, nn.Parameter]]] = [[] for _ in units]
    for name, p in params:
        hit = None
        for nm in all_names[id(p)]:
            for j, u in enumerate(units):
                if nm == u or nm.startswith(u + "."):
                    hit = j if hit is None else min(hit, j)
        if hit is None:
            raise ValueError(f"diloco fragments: parameter {name!r} is under none of the plan's fragment_units "
                             f"{list(units)}; every trainable parameter must be in one unit")
        groups[hit].append((name, p))
    empty = [u for u, g in zip(units, groups, strict=True) if not g]
    if empty:
        raise ValueError(f"diloco fragments: the plan's fragment_units {empty} hold no trainable parameter of "
                         "their own (tied parameters count once, under their first unit)")
    return groups


def split_fragments(model: nn.Module,
                    fragments: int | Sequence[nn.Module | Iterable[nn.Parameter]],
                    plan: ModelPlan | None = None) -> list[Fragment]:
    """Return the model's fragments.

    Args:
        model: the model (its weights as they will be trained).
        fragments: the number of fragments for the consecutive split, or a list of modules and/or
            lists of parameters, one per fragment.
        plan: the model's plan (default :func:`lowband.plan.plan_for`); its ``fragment_units``, when
            set, replace the default unit rule of the consecutive split.

    Raises:
        ValueError: naming the problem (too many fragments for the model's units, an empty fragment or
            one of frozen parameters only, overlapping fragments, trainable parameters left out, a
            parameter not in the model).
        TypeError: ``fragments`` of the wrong type.
    """
    named = _named_unique(model)
    name_of = {id(p): n for n, p in named}
    if isinstance(fragments, bool) or not isinstance(fragments, int | Sequence):
        raise TypeError("diloco fragments must be an int or a list of modules / parameter lists, got "
                        f"{type(fragments).__name__}")
    if isinstance(fragments, int):
        trainable = [(n, p) for n, p in named if p.requires_grad]
        plan = plan if plan is not None else plan_for(model)
        units = (_units(model, trainable) if plan.fragment_units is None
                 else _plan_units(model, trainable, plan.fragment_units))
        if fragments < 1 or fragments > len(units):
            raise ValueError(f"diloco num_fragments={fragments} must be in [1, {len(units)}] for this model "
                             f"({len(units)} consecutive units: blocks and other parameters)")
        cuts = [0, *_balanced_cuts([sum(p.numel() for _, p in u) for u in units], fragments), len(units)]
        out = []
        for i in range(fragments):
            frag = Fragment(i)
            for unit in units[cuts[i]:cuts[i + 1]]:
                for n, p in unit:
                    frag.names.append(n)
                    frag.params.append(p)
            out.append(frag)
        return out
    if len(fragments) == 0:
        raise ValueError("diloco fragments: the list is empty; give at least one fragment")
    out = []
    owner: dict[int, int] = {}
    for i, spec in enumerate(fragments):
        if isinstance(spec, nn.Module):
            params = list(spec.parameters())
        elif isinstance(spec, Iterable) and not isinstance(spec, torch.Tensor):
            params = list(spec)
        else:
            raise TypeError(f"diloco fragments[{i}] must be an nn.Module or a list of parameters, got "
                            f"{type(spec).__name__}")
        frag = Fragment(i)
        seen: set[int] = set()
        frozen = 0
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"diloco fragments[{i}] holds a {type(p).__name__}, not a parameter")
            if id(p) not in name_of:
                raise ValueError(f"diloco fragments[{i}] holds a parameter of shape {tuple(p.shape)} that is "
                                 "not a parameter of the model")
            if not p.requires_grad:  # frozen: synced once by init_sync, never again
                frozen += 1
                continue
            if id(p) in seen:
                continue
            seen.add(id(p))
            if id(p) in owner:
                tied = tied_names(model).get(name_of[id(p)])
                also = f" (tied: {tied}; a tied parameter is synced once, so give its modules one fragment)" \
                    if tied else ""
                raise ValueError(f"diloco fragments overlap: parameter {name_of[id(p)]!r}{also} is in fragments "
                                 f"{owner[id(p)]} and {i}")
            owner[id(p)] = i
            frag.names.append(name_of[id(p)])
            frag.params.append(p)
        if not frag.params:
            what = f"only frozen parameters ({frozen}, requires_grad=False; init_sync covers them)" if frozen \
                else "no parameters"
            raise ValueError(f"diloco fragments[{i}] has {what}; give every fragment a trainable parameter")
        out.append(frag)
    missing = [n for n, p in named if p.requires_grad and id(p) not in owner]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"diloco fragments leave {len(missing)} trainable parameter(s) out: {shown}; "
                         "every trainable parameter must be in exactly one fragment")
    return out
