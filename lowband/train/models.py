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
from lowband.train.config import ConfigError

if TYPE_CHECKING:
    from lowband.train.config import Config


class ModelContractError(ConfigError, TypeError):
    """A factory or forward that does not return what lowband documents (a ``ConfigError``: exit 2 from the
    CLI, one line naming ``model.factory`` / ``model.forward`` and the type that came back; also a
    ``TypeError`` for callers of the Python API)."""


def type_phrase(obj: object) -> str:
    """What ``obj`` is, for an error line: ``Tensor of shape (2, 3)``, ``tuple (Tensor, NoneType)``, ``dict``."""
    if isinstance(obj, torch.Tensor):
        return f"Tensor of shape {tuple(obj.shape)}"
    if isinstance(obj, tuple | list) and len(obj) <= 6:
        return f"{type(obj).__name__} ({', '.join(type(o).__name__ for o in obj)}{',' if len(obj) == 1 else ''})"
    return type(obj).__name__


def user_frame(exc: BaseException, module_file: str | None = None) -> str:
    """``file:line`` where ``exc`` arose in the user's code: a ``SyntaxError``'s own position, else the
    innermost traceback frame in ``module_file`` (the factory's module), else the innermost frame outside
    lowband; ``""`` when there is none."""
    import traceback
    from pathlib import Path

    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    own = str(Path(__file__).resolve().parents[1])
    if module_file:
        mine = [f for f in frames if Path(f.filename).resolve() == Path(module_file).resolve()]
        if mine:
            return f"{mine[-1].filename}:{mine[-1].lineno}"
    outside = [f for f in frames if not str(Path(f.filename).resolve()).startswith(own)
               and "importlib" not in f.filename]
    return f"{outside[-1].filename}:{outside[-1].lineno}" if outside else ""


def _failure_line(spec: str, what: str, exc: BaseException, module_file: str | None) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, SyntaxError):
        text = exc.msg or text
    where = user_frame(exc, module_file)
    return (f"model.factory = {spec!r}: {what}: {type(exc).__name__}{': ' + text[:300] if text else ''}"
            f"{' (' + where + ')' if where else ''}")

ModelFactory = Callable[["Config"], "nn.Module | tuple[nn.Module, ModelPlan]"]
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def load_factory(spec: str) -> ModelFactory:
    """Import ``"package.module:function"``; ``ConfigError`` naming ``model.factory`` if it cannot."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ConfigError(f"model.factory must look like 'package.module:function'; got {spec!r}")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        raise ConfigError(f"model.factory = {spec!r}: cannot import module {mod_name!r} ({e})") from e
    except Exception as e:  # SyntaxError, or any error the module raises while it is imported
        raise ConfigError(_failure_line(spec, f"importing {mod_name!r} failed", e, None)) from e
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
    spec = cfg.model.factory or _name(factory)
    if factory is gpt_factory:
        out = factory(cfg)
    else:
        try:
            out = factory(cfg)
        except (MemoryError, torch.OutOfMemoryError, ConfigError):
            raise
        except Exception as e:  # the user's code failed: one line naming the factory, its file and line
            import sys

            module_file = getattr(sys.modules.get(getattr(factory, "__module__", "") or ""), "__file__", None)
            raise ConfigError(_failure_line(spec, "calling it failed", e, module_file)) from e
    plan: ModelPlan | None = None
    expected = "must return an nn.Module or (nn.Module, ModelPlan)"
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[0], nn.Module) or not isinstance(out[1], ModelPlan):
            raise ModelContractError(f"model.factory = {spec!r} {expected}; got {type_phrase(out)}")
        out, plan = out
    if not isinstance(out, nn.Module):
        raise ModelContractError(f"model.factory = {spec!r} {expected}; got {type_phrase(out)}")
    model = out.to(device=device, dtype=DTYPES[cfg.run.dtype])
    return model, plan if plan is not None else plan_for(model)


def _name(fn: object) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def plan_example(model: nn.Module) -> str:
    """How to give ``model`` a plan with parallel linears, spelled with its own first ``nn.Linear`` names
    (one clause, for error messages)."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][:2]
    a, b = (linears + ["blocks.0.mlp.fc", "blocks.0.mlp.proj"][len(linears):])[:2]
    return (f"return (model, ModelPlan(parallel_linears=(ParallelLinear({a!r}, 'column'), "
            f"ParallelLinear({b!r}, 'row'), ...))) from the factory, or define model.lowband_plan() "
            "(lowband.plan; docs/adopt.md); strategy gtp needs no plan (it shards every nn.Linear)")


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
                         f"nn.Linear layers to split); the plan of {where} lists none{extra}; "
                         f"{plan_example(model)}")
    for t in plan.sparse_tables:
        if t.param not in params:
            raise ValueError(f"model plan: sparse table {t.name!r} names {t.param!r}, not a parameter of {where}")
    for name in plan.adamw_only:
        if name not in params:
            raise ValueError(f"model plan: adamw_only entry {name!r} is not a parameter of {where}")
    for unit in plan.fragment_units or ():
        if unit not in modules and unit not in params:
            raise ValueError(f"model plan: fragment unit {unit!r} is not a module or parameter of {where}")
