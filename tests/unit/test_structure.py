"""The package structure: lowband's packages form layers, and a package imports only from layers below it.

Every ``import`` of a lowband module in ``lowband/`` counts, at module level, inside a function or under
``TYPE_CHECKING`` alike (each one is a dependency a reader has to know about). With a strict order no two
files of different packages can import each other in a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lowband

ROOT = Path(lowband.__file__).parent

# lowest first; a top-level module or package of lowband that is not listed here fails the test (place it)
LAYERS = ["plan", "buffers", "dcp_chunks", "sharding", "data", "comm", "consistency", "testing", "model", "parallel",
          "optim", "diloco",
          "train", "sample", "lighthouse", "bench"]


def _unit(path: Path) -> str:
    """The top-level package (or module) of lowband that ``path`` belongs to; ``""`` for lowband/__init__.py."""
    rel = path.relative_to(ROOT).with_suffix("").parts
    return "" if rel == ("__init__",) else rel[0]


def _imported_units(source: str, module: tuple[str, ...]) -> list[tuple[int, str]]:
    """``(line, top-level unit)`` of every lowband module that ``source``, the text of the module ``module``
    (``("lowband", "parallel", "gtp")``; a package's ``__init__`` ends in ``"__init__"``), imports: absolute or
    relative, at module level, in a function or under ``TYPE_CHECKING``."""
    package = module[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[tuple[str, ...]] = []
        if isinstance(node, ast.Import):
            names = [tuple(a.name.split(".")) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = tuple(node.module.split(".")) if node.module else ()
            if node.level:
                base = package[: len(package) - node.level + 1] + base
            names = [(*base, a.name) for a in node.names] if len(base) == 1 else [base]
        found += [(node.lineno, name[1]) for name in names if len(name) > 1 and name[0] == "lowband"]
    return found


def test_every_cross_package_import_goes_to_a_lower_layer() -> None:
    files = sorted(ROOT.rglob("*.py"))
    units = {_unit(f) for f in files} - {""}
    assert units <= set(LAYERS), f"place these in LAYERS: {sorted(units - set(LAYERS))}"
    rank = {u: i for i, u in enumerate(LAYERS)}
    wrong = []
    for f in files:
        unit = _unit(f)
        if not unit:  # lowband/__init__.py: the package's lazy public names, above every layer
            continue
        module = f.relative_to(ROOT.parent).with_suffix("").parts
        for line, target in _imported_units(f.read_text(), module):
            if target != unit and rank.get(target, -1) >= rank[unit]:
                wrong.append(f"{f.relative_to(ROOT.parent)}:{line}: {unit} imports {target}")
    assert not wrong, "imports from a higher (or the same) layer:\n" + "\n".join(wrong)


def test_the_checker_sees_lazy_relative_and_type_checking_imports() -> None:
    """The parser itself: relative imports, one in a function and one under TYPE_CHECKING are all found."""
    src = ("from typing import TYPE_CHECKING\nfrom . import gtp\nfrom .. import optim\nfrom .mesh import X\n"
           "if TYPE_CHECKING:\n    from lowband.train.config import Config\n"
           "def f():\n    import lowband.diloco.state\n    import torch\n")
    found = sorted(t for _, t in _imported_units(src, ("lowband", "parallel", "probe")))
    assert found == ["diloco", "optim", "parallel", "parallel", "train"]
    assert [t for _, t in _imported_units("from . import gtp", ("lowband", "parallel", "__init__"))] == ["parallel"]
