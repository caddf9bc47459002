"""Which model the trainer trains: lowband's reference GPT, or the user's own through a factory.

A *model factory* is any callable ``factory(cfg) -> nn.Module | (nn.Module, ModelPlan)``. The trainer
takes one from the Python API (``train(cfg, model_factory=...)``) or names one in the config
(``model.factory = "package.module:function"``, imported on every rank). It is called on every rank
after ``torch.manual_seed(run.seed)``; a factory that seeds per rank (nanoGPT's ``seed + rank``) is
fine: every strategy makes the ranks agree before training (DDP's and the components' ``init_sync``).

The model's :class:`~lowband.plan.ModelPlan` is the one the factory returns, else
``model.lowband_plan()``, else the empty plan (generic rules: tied weights detected, Muon takes the
2-D non-embedding parameters, DiLoCo fragments from the largest ``nn.ModuleList``).

:func:`check_plan` validates a plan against its model (names exist, parallel linears are
``nn.Linear``) on every rank alike, before any collective. No communication happens here.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from lowband.plan import ModelPlan, plan_for

if TYPE_CHECKING:
    from lowband.train.config import Config

ModelFactory = Callable[["Config"], "nn.Module | tuple[nn.Module, ModelPlan]"]
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def load_factory(spec: str) -> ModelFactory:
    """Import ``"package.module:function"``; ``ConfigError`` naming ``model.factory`` if it cannot."""
    from lowband.train.config import ConfigError

    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ConfigError(f"model.factory must look like 'package.module:function'; got {spec!r}")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"model.factory = {spec!r}: cannot import module {mod_name!r} ({e})") from e
    fn = mod
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"model.factory = {spec!r}: module {mod_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError(f"model.factory = {spec!r}: {attr!r} is not callable")
    return fn


def gpt_factory(cfg: Config) -> nn.Module:
    """lowband's reference GPT from the GPT keys of ``cfg.model`` (the default factory)."""
    from lowband.model import GPT, GPTConfig

    names = {f.name for f in dataclasses.fields(GPTConfig)}
    return GPT(GPTConfig(**{k: v for k, v in dataclasses.asdict(cfg.model).items() if k in names}))


def call_factory(factory: ModelFactory, cfg: Config, device: torch.device) -> tuple[nn.Module, ModelPlan]:
    """Seed with ``run.seed``, call ``factory(cfg)``, move to ``device`` / ``run.dtype``; (model, plan)."""
    torch.manual_seed(cfg.run.seed)
    out = factory(cfg)
    plan: ModelPlan | None = None
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], ModelPlan):
            raise TypeError(f"model factory {_name(factory)} must return an nn.Module or (nn.Module, ModelPlan); "
                            f"got a tuple of {[type(o).__name__ for o in out]}")
        out, plan = out
    if not isinstance(out, nn.Module):
        raise TypeError(f"model factory {_name(factory)} must return an nn.Module or (nn.Module, ModelPlan); "
                        f"got {type(out).__name__}")
    model = out.to(device=device, dtype=DTYPES[cfg.run.dtype])
    return model, plan if plan is not None else plan_for(model)


def _name(fn: object) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def check_plan(model: nn.Module, plan: ModelPlan, *, need_parallel_linears: str | None = None) -> None:
    """Raise ``ValueError`` naming the first entry of ``plan`` that ``model`` does not have.

    Checks that every parallel linear names an ``nn.Linear`` module and every sparse table, ``adamw_only``
    entry and fragment unit names a parameter / module of ``model``. With ``need_parallel_linears`` (a
    strategy name), a plan without parallel linears is refused naming the strategy and the model class.
    Local and deterministic: identical on every rank, before any collective.
    """
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    where = type(model).__name__
    for pl in plan.parallel_linears:
        mod = modules.get(pl.module)
        if mod is None:
            raise ValueError(f"model plan: parallel linear {pl.module!r} is not a module of {where}")
        if not isinstance(mod, nn.Linear):
            raise ValueError(f"model plan: parallel linear {pl.module!r} of {where} is a {type(mod).__name__}, "
                             "not an nn.Linear; tensor parallelism and GTP split nn.Linear layers only")
    if need_parallel_linears and not plan.parallel_linears:
        kinds = sorted({type(m).__name__ for m in modules.values()
                        if not isinstance(m, nn.Linear | nn.Embedding) and getattr(m, "weight", None) is not None
                        and getattr(m.weight, "dim", lambda: 0)() == 2})
        extra = f" (its 2-D weights sit in {', '.join(kinds)} modules, not nn.Linear)" if kinds else ""
        raise ValueError(f"strategy {need_parallel_linears!r} needs the model plan's parallel_linears (the "
                         f"nn.Linear layers to split); the plan of {where} lists none{extra}")
    for t in plan.sparse_tables:
        if t.param not in params:
            raise ValueError(f"model plan: sparse table {t.name!r} names {t.param!r}, not a parameter of {where}")
    for name in plan.adamw_only:
        if name not in params:
            raise ValueError(f"model plan: adamw_only entry {name!r} is not a parameter of {where}")
    for unit in plan.fragment_units or ():
        if unit not in modules and unit not in params:
            raise ValueError(f"model plan: fragment unit {unit!r} is not a module or parameter of {where}")
