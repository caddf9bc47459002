"""``torch.compiler.disable`` without importing ``torch._dynamo`` at import time.

``torch.compiler.disable(fn)`` imports ``torch._dynamo`` (about a second per process), which every
lowband process would pay at import although most never compile. :func:`opaque` marks ``fn`` instead:

* the wrapper carries ``_torchdynamo_disable = True``, so dynamo never inlines it (a graph break; dynamo
  checks the attribute when it meets the call in traced code);
* once ``torch._dynamo`` is imported (by ``torch.compile`` or anything else; an import hook notices, or
  it was imported before lowband), every wrapper's code is registered with dynamo's ``skip_code`` (its
  own frame is never compiled) and it calls ``torch._dynamo.disable(fn)`` (nested frames run eagerly
  too), exactly what ``torch.compiler.disable`` does. Before that, it calls ``fn`` directly: no compile
  can be running while dynamo is not imported.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any

_WRAPPERS: list[Any] = []
_ARMED = [False]


def _arm() -> None:
    """Register every wrapper with dynamo (idempotent); called once ``torch._dynamo`` is imported."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None or not hasattr(dynamo, "disable"):
        return
    from torch._dynamo.eval_frame import skip_code

    for w in _WRAPPERS:
        if w._lowband_disabled is None:
            w._lowband_disabled = dynamo.disable(w.__wrapped__)
        skip_code(w.__code__)
    _ARMED[0] = True


def opaque(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.disable(fn)``, armed lazily (see the module docstring)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        disabled = wrapper._lowband_disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            _arm()
            disabled = wrapper._lowband_disabled
            if disabled is None:  # dynamo is still being imported: no compile can be running yet
                return fn(*args, **kwargs)
        return disabled(*args, **kwargs)

    wrapper._torchdynamo_disable = True
    wrapper._lowband_disabled = None
    _WRAPPERS.append(wrapper)
    if _ARMED[0]:
        _arm()
    return wrapper


class _ArmAfterDynamoImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_arm` right after ``torch._dynamo`` finishes importing."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "torch._dynamo":
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                exec_module = loader.exec_module

                def exec_then_arm(module: Any, _exec: Any = exec_module) -> None:
                    _exec(module)
                    _arm()

                spec.loader = _Loader(loader, exec_then_arm)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, exec_module: Callable[[Any], None]) -> None:
        self._inner, self._exec = inner, exec_module

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._exec(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


if "torch._dynamo" in sys.modules:
    _ARMED[0] = True
else:
    sys.meta_path.insert(0, _ArmAfterDynamoImport())
