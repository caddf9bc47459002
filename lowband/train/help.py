"""The trainer's ``--help`` and ``--help-strategy NAME`` text, generated from the config section dataclasses.

The single source of every key's description is its attribute docstring (the string literal right after
the field) in the module that defines the section's class: :mod:`lowband.train.config` for the sections
every strategy reads, the strategy's own module (``lowband/train/strategies/<name>.py``) for a strategy's
section; and of every section's heading the section class's docstring. This module reads them from that
module's source with :mod:`ast`, never from a second copy.
Types and defaults come from the dataclass fields, allowed values from :data:`~lowband.train.config.CHOICES`,
the strategies from :func:`lowband.train.strategies.available` and each strategy's ``config_sections``.

Output is plain text wrapped at :data:`WIDTH` columns. No communication.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import json
import re
import sys
import textwrap
import typing
from dataclasses import dataclass
from functools import cache

from lowband.train import errors
from lowband.train.config import CHOICES, Config, ConfigError

WIDTH = 100
COMMON_SECTIONS = ("run", "model", "data", "optim", "checkpoint", "guard")
"""Sections every strategy reads (``--help-strategy`` lists their keys by name only)."""


@dataclass(frozen=True)
class KeyDoc:
    """One config key as the help shows it."""

    section: str
    key: str
    type_name: str
    default: str
    """The default as a TOML literal (``"cosine"``, ``0.003``, ``true``, ``[]``)."""
    doc: str
    """The attribute docstring, whitespace-normalized paragraphs joined by blank lines ("" if none)."""
    choices: tuple[str, ...] = ()


@cache
def _module_docs(module_name: str) -> dict[str, tuple[str, dict[str, str]]]:
    """``{class name: (class docstring, {field: attribute docstring})}`` from the source of the module
    ``module_name`` (already imported)."""
    tree = ast.parse(inspect.getsource(sys.modules[module_name]))
    out: dict[str, tuple[str, dict[str, str]]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, str] = {}
        for stmt, nxt in itertools.pairwise(node.body):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                fields[stmt.target.id] = inspect.cleandoc(nxt.value.value)
        out[node.name] = (ast.get_docstring(node) or "", fields)
    return out


def _class_docs(cls: type) -> tuple[str, dict[str, str]]:
    """``(class docstring, {field: attribute docstring})`` of the section class ``cls``, read from the source
    of the module that defines it (``("", {})`` if that source has no such class)."""
    return _module_docs(cls.__module__).get(cls.__name__, ("", {}))


def sections() -> dict[str, type]:
    """``{section name: its dataclass}`` in :class:`Config` order."""
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def _toml_literal(value: object) -> str:
    return json.dumps(value)


def _type_name(tp: object) -> str:
    return tp.__name__ if isinstance(tp, type) and not typing.get_args(tp) else str(tp)


def section_doc(section: str) -> str:
    """The docstring of ``section``'s class ("" if none)."""
    return _class_docs(sections()[section])[0]


def section_keys(section: str) -> list[KeyDoc]:
    """Every key of ``section`` in field order, with type, default, docstring and allowed values."""
    cls = sections()[section]
    hints = typing.get_type_hints(cls)
    docs = _class_docs(cls)[1]
    out = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        out.append(KeyDoc(section, f.name, _type_name(hints[f.name]), _toml_literal(default),
                          docs.get(f.name, ""), tuple(CHOICES.get(f"{section}.{f.name}", ()))))
    return out


def _plain(text: str) -> str:
    """RST inline literals and roles as single backticks (``x`` and :mod:`x` -> `x`)."""
    return re.sub(r":[a-z]+:`([^`]+)`", r"`\1`", text.replace("``", "`"))


def _wrap(text: str, indent: str) -> list[str]:
    """Each paragraph of ``text`` re-flowed to :data:`WIDTH` columns under ``indent``."""
    lines: list[str] = []
    for para in _plain(text).split("\n\n"):
        para = " ".join(para.split())
        if para:
            lines += textwrap.wrap(para, WIDTH, initial_indent=indent, subsequent_indent=indent,
                                   break_on_hyphens=False, break_long_words=False)
    return lines


def render_section(section: str) -> str:
    """``[section]``, its class docstring, then one entry per key: ``key: type = default  {choices}`` and the
    key's docstring indented below it."""
    lines = [f"[{section}]"]
    lines += _wrap(section_doc(section), "  ")
    for k in section_keys(section):
        head = f"  {k.key}: {k.type_name} = {k.default}"
        if k.choices:
            head += f"  {{{', '.join(k.choices)}}}"
        lines.append(head)
        lines += _wrap(k.doc, "      ") or ["      (no description)"]
    return "\n".join(lines)


def render_section_short(section: str) -> str:
    """``[section] key, key, ...`` wrapped: the keys by name only."""
    keys = ", ".join(k.key for k in section_keys(section))
    return "\n".join(textwrap.wrap(f"[{section}] {keys}", WIDTH, subsequent_indent="    "))


def strategy_sections(name: str) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
    """The config sections strategy ``name`` reads besides :data:`COMMON_SECTIONS`: its own
    ``config_sections``, and for a section with an ``<section>.inner`` choice (diloco), the sections the
    inner strategies add, as ``{"<section>.inner = <choice> or <choice>": (sections...)}`` (choices that add
    the same sections share one entry).

    Raises:
        ConfigError: no strategy is called ``name`` (the message lists them).
    """
    from lowband.train.strategies import available, get_strategy_class

    own = tuple(get_strategy_class(name).config_sections)
    extra: dict[str, tuple[str, ...]] = {}
    for sec in own:
        by_sections: dict[tuple[str, ...], list[str]] = {}
        for choice in (c for c in CHOICES.get(f"{sec}.inner", ()) if c in available()):
            added = tuple(s for s in get_strategy_class(choice).config_sections if s not in own)
            if added:
                by_sections.setdefault(added, []).append(choice)
        for added, choices in by_sections.items():
            extra[f"{sec}.inner = {' or '.join(choices)}"] = added
    return own, extra


def _strategy_lines() -> list[str]:
    from lowband.train.strategies import available

    names = available()
    pad = max(len(n) for n in names) + 2
    lines = []
    for n in names:
        own, extra = strategy_sections(n)
        reads = " ".join(f"[{s}]" for s in own) or "no strategy section"
        for cond, secs in extra.items():
            reads += f"; with {cond} also " + " ".join(f"[{s}]" for s in secs)
        lines += textwrap.wrap(f"{n:<{pad}}reads {reads}", WIDTH, initial_indent="  ",
                               subsequent_indent="  " + " " * (pad + 6))
    return lines


OVERRIDES = """\
Config: a TOML file (--config, e.g. configs/demo.toml) with [section] tables of key = value, then
overrides after the options, each --section.key=value (applied in order, after the file):
  python -m lowband.train --config configs/demo.toml --run.steps=200 --strategy.name=sharded-adamw
  booleans: true/false (or 1/0); lists: comma-separated (--sparse.tables=bigram,tok_emb, or TOML's
  [bigram, tok_emb]; empty: --sparse.tables= or --sparse.tables=[]); an unknown section or key, a
  wrong type or a value outside the {allowed values} below is an error (exit 2)."""


def exit_codes() -> str:
    """The exit codes, one line each (:mod:`lowband.train.errors`)."""
    return "\n".join([
        "Exit codes:",
        f"  {errors.EXIT_OK}        done",
        f"  {errors.EXIT_FAILED}        the run failed (non-finite steps, a save failed, a peer died, a bug); "
        "traceback in",
        "           <run.out_dir>/<run.name>/logs/",
        f"  {errors.EXIT_INPUT}        bad config, data or checkpoint, or the run directory is in use "
        "(before training)",
        "  128+N    stopped by signal N (130 SIGINT, 143 SIGTERM) at a step boundary",
    ])


def full_help(options: str) -> str:
    """``--help``: ``options`` (argparse's usage and options), the override syntax, the strategies, the exit
    codes, then every config section and key."""
    parts = [options.rstrip(), OVERRIDES,
             "Strategies (strategy.name; --help-strategy NAME shows only the sections it reads):\n"
             + "\n".join(_strategy_lines()),
             exit_codes(),
             "Config sections and keys (key: type = default  {allowed values}):"]
    parts += [render_section(s) for s in sections()]
    return "\n\n".join(parts) + "\n"


def strategy_help(name: str, usage: str = "") -> str:
    """``--help-strategy NAME``: the sections strategy ``name`` reads in full, the common ones by key name.

    Raises:
        ConfigError: unknown strategy (the message lists the available ones).
    """
    own, extra = strategy_sections(name)
    parts = [usage.rstrip()] if usage.strip() else []
    head = f"Strategy {name!r} (strategy.name = {json.dumps(name)})"
    if own or extra:
        head += " reads these sections:"
    else:
        head += " reads no strategy-specific section."
    parts.append(head)
    parts += [render_section(s) for s in own]
    shown = set(own)
    for cond, secs in extra.items():
        parts.append(f"With {cond}, also:")
        parts += [render_section(s) if s not in shown else f"[{s}] (above)" for s in secs]
        shown |= set(secs)
    parts.append("Every strategy also reads these sections (python -m lowband.train --help shows them in full):\n"
                 + "\n".join(render_section_short(s) for s in COMMON_SECTIONS))
    return "\n\n".join(parts) + "\n"


__all__ = ["COMMON_SECTIONS", "ConfigError", "KeyDoc", "exit_codes", "full_help", "render_section",
           "section_doc", "section_keys", "sections", "strategy_help", "strategy_sections"]
