"""Strategy registry: ``strategy.name`` in the config picks one of these.

Add a strategy by writing a module here that defines a :class:`Strategy` subclass decorated with
``@register_strategy("name")`` and listing the module in ``_MODULES``.
"""

from __future__ import annotations

import importlib

from lowband.train.errors import ConfigError
from lowband.train.strategies.base import Strategy

_REGISTRY: dict[str, type[Strategy]] = {}
_MODULES = (
    "lowband.train.strategies.single",
    "lowband.train.strategies.ddp",
    "lowband.train.strategies.diloco",
    "lowband.train.strategies.gtp",
    "lowband.train.strategies.sharded",
    "lowband.train.strategies.tp",
)
_loaded = False


def register_strategy(name: str):
    def deco(cls: type[Strategy]) -> type[Strategy]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in _MODULES:
            importlib.import_module(mod)


def available() -> list[str]:
    _load()
    return sorted(_REGISTRY)


def get_strategy_class(name: str) -> type[Strategy]:
    _load()
    if name not in _REGISTRY:
        raise ConfigError(f"strategy.name must be one of {', '.join(sorted(_REGISTRY))}; got {name!r}")
    return _REGISTRY[name]


__all__ = ["Strategy", "available", "get_strategy_class", "register_strategy"]
