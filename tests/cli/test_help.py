"""``python -m lowband.train --help`` and ``--help-strategy NAME``: generated from the config dataclasses."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import subprocess
import sys
import typing

import pytest

from lowband.train import help as help_mod
from lowband.train.__main__ import main
from lowband.train.config import CHOICES, Config
from lowband.train.strategies import available, get_strategy_class
from tests.cli.cli_util import ROOT, cli_env

SECTIONS = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _blocks(text: str) -> dict[str, list[str]]:
    """``{section: its lines}`` from the ``[section]`` blocks of a help text."""
    blocks: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("[") and line.endswith("]") and line[1:-1] in SECTIONS:
            current = blocks.setdefault(line[1:-1], [])
        elif not line.strip():
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def _expected_head(section: str, f: dataclasses.Field) -> str:
    """``  key: type = default`` computed from the dataclass itself (not from lowband.train.help)."""
    tp = typing.get_type_hints(SECTIONS[section])[f.name]
    type_name = tp.__name__ if isinstance(tp, type) and not typing.get_args(tp) else str(tp)
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return f"  {f.name}: {type_name} = {json.dumps(default)}"


def _attribute_docstrings(cls: type) -> dict[str, str]:
    """Field docstrings read with ``inspect.getsource`` of the class (independent of help's module parse)."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {a.target.id: inspect.cleandoc(b.value.value) for a, b in itertools.pairwise(body)
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)}


def test_help_lists_every_key_with_type_default_and_doc(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _help(capsys, "--help")
    assert code == 0 and err == ""
    blocks = _blocks(out)
    assert list(blocks) == list(SECTIONS)  # every section, in Config order
    for section, cls in SECTIONS.items():
        lines = blocks[section]
        docs = _attribute_docstrings(cls)
        assert lines[0].startswith("  ") and lines[0].strip(), f"[{section}] has no heading text"
        for f in dataclasses.fields(cls):
            head = _expected_head(section, f)
            idx = [i for i, ln in enumerate(lines) if ln == head or ln.startswith(head + "  {")]
            assert len(idx) == 1, f"{section}.{f.name}: no line {head!r}"
            doc = lines[idx[0] + 1]
            assert doc.startswith("      ") and doc.strip() and doc.strip() != "(no description)", \
                f"{section}.{f.name} has no description"
            # the description is the field's attribute docstring (the single source), re-flowed
            assert docs.get(f.name), f"{section}.{f.name} has no attribute docstring in {cls.__module__}"
            shown = []
            for ln in lines[idx[0] + 1:]:
                if not ln.startswith("      "):
                    break
                shown.append(ln.strip())
            # shown with RST literals and roles (``x``, :mod:`x`) as `x`
            expected = re.sub(r":[a-z]+:`([^`]+)`", r"`\1`", " ".join(docs[f.name].replace("``", "`").split()))
            assert " ".join(shown) == expected, f"{section}.{f.name}"


def test_help_section_headings_are_class_docstrings(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = _help(capsys, "--help")
    blocks = _blocks(out)
    for section, cls in SECTIONS.items():
        assert cls.__doc__ and cls.__doc__.strip(), f"{cls.__name__} has no class docstring"
        first_words = " ".join(cls.__doc__.split()[:4]).replace("``", "`")
        assert blocks[section][0].strip().startswith(first_words), section


def test_help_shows_choices_strategies_overrides_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = _help(capsys, "--help")
    blocks = _blocks(out)
    for dotted, allowed in CHOICES.items():
        section, key = dotted.split(".", 1)
        line = next(ln for ln in blocks[section] if ln.startswith(f"  {key}: "))
        assert line.endswith("  {" + ", ".join(allowed) + "}"), line
    strategies = out.split("Strategies (strategy.name", 1)[1].split("\n\n", 1)[0]
    for name in available():
        assert f"\n  {name} " in strategies, name
    assert "--section.key=value" in out and "--run.steps=200" in out
    exit_block = out.split("Exit codes:", 1)[1].split("\n\n", 1)[0]
    for code in ("0", "1", "2", "128+N"):
        assert f"\n  {code} " in exit_block
    assert "130 SIGINT, 143 SIGTERM" in exit_block
    # --config and --debug keep their help
    assert "--config FILE" in out and "TOML config file" in out and "--debug" in out
    assert max(len(ln) for ln in out.splitlines()) <= help_mod.WIDTH


@pytest.mark.parametrize(("name", "full", "absent"), [
    ("gtp", ["strategy", "gtp"], ["diloco", "tp", "sharded"]),
    ("ddp", ["strategy"], ["gtp", "diloco", "sharded"]),
    ("sharded-muon", ["strategy", "sharded", "sparse"], ["gtp", "diloco"]),
    ("tp", ["tp"], ["strategy", "gtp"]),
    ("single", [], ["strategy", "gtp", "tp"]),
])
def test_help_strategy_prints_only_its_sections(capsys: pytest.CaptureFixture[str], name: str, full: list[str],
                                                absent: list[str]) -> None:
    code, out, err = _help(capsys, "--help-strategy", name)
    assert code == 0 and err == ""
    blocks = _blocks(out)
    assert list(blocks) == full
    for s in absent:
        assert f"\n[{s}]\n" not in out
    # the common sections by key name only
    assert "Every strategy also reads these sections" in out
    for s in help_mod.COMMON_SECTIONS:
        keys = ", ".join(f.name for f in dataclasses.fields(SECTIONS[s]))
        assert " ".join(ln.strip() for ln in out.split(f"\n[{s}] ", 1)[1].split("\n[", 1)[0].splitlines()) \
            .startswith(keys)


def test_help_strategy_diloco_adds_its_inner_strategies_sections(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _help(capsys, "--help-strategy", "diloco")
    assert code == 0
    expected = ["strategy", "diloco", "ft"]
    for inner in CHOICES["diloco.inner"]:
        expected += [s for s in get_strategy_class(inner).config_sections if s not in expected]
    assert list(_blocks(out)) == expected
    assert out.count("\n[sharded]\n") == 1  # sharded-adamw and sharded-muon add it once, together
    assert "With diloco.inner = sharded-adamw or sharded-muon, also:" in out


def test_help_strategy_unknown_exits_2_with_the_list(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _help(capsys, "--help-strategy", "fsdp")
    assert code == 2 and out == ""
    assert err.splitlines() == [f"lowband.train: error: --help-strategy: strategy.name must be one of "
                                f"{', '.join(available())}; got 'fsdp'"]


def test_every_strategy_names_existing_sections_and_every_section_is_read() -> None:
    read: set[str] = set(help_mod.COMMON_SECTIONS)
    for name in available():
        secs = get_strategy_class(name).config_sections
        assert isinstance(secs, tuple) and set(secs) <= set(SECTIONS), (name, secs)
        read |= set(secs)
    assert read == set(SECTIONS)


def test_help_subprocess_exits_0_without_stderr() -> None:
    proc = subprocess.run([sys.executable, "-m", "lowband.train", "--help"], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0
    assert proc.stderr == ""
    assert "\n[guard]\n" in proc.stdout and "Traceback" not in proc.stdout
