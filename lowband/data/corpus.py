"""Built-in offline corpus: Python's own documentation, gathered at run time, byte-tokenized.

Documents, in this order:

* ``pydoc:<topic>`` — every value of ``pydoc_data.topics.topics`` (sorted by topic name);
* ``stdlib:<relative/path.py>`` — for each stdlib source file (the tree under
  ``sysconfig.get_paths()["stdlib"]`` walked in sorted order, skipping ``test``, ``tests``, ``idlelib``,
  ``site-packages`` and ``__pycache__`` folders), its module, class and function docstrings
  (``ast.get_docstring``, in source order, nested definitions included) joined by blank lines.
  Files that fail to read or parse are skipped, as are files without docstrings.

A document goes to validation when ``blake2b(key) % 20 == 0`` (stable across runs, unlike the salted
``hash()``), else to training. Each split is the concatenation of ``[BOS] + utf8(document)``.

The token arrays are cached as ``.bin`` shards (``train.bin``, ``val.bin``) under ``cache_dir``
(default ``$LOWBAND_CACHE_DIR`` or ``~/.cache/lowband``, then ``corpus-<python version>-v<builder
version>``), written atomically, so concurrent ranks may all call :func:`builtin_corpus`: each either
reads a complete cache or builds the identical arrays and renames them into place.

The text changes across Python versions; keep golden numbers on synthetic text.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from lowband.data.shards import ShardError, read_shard, write_shard
from lowband.data.tokenizer import ByteTokenizer

BUILDER_VERSION = 2
VAL_MODULUS = 20
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})


def is_val_document(key: str, modulus: int = VAL_MODULUS) -> bool:
    """True if the document ``key`` belongs to the validation split (stable 64-bit blake2b hash)."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % modulus == 0


_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_STMT_LISTS = ("body", "handlers", "orelse", "finalbody", "cases")
_STMT_TYPES = (ast.stmt, ast.excepthandler, ast.match_case)


def _docstrings(tree: ast.Module) -> list[str]:
    """Module, class and function docstrings in source order (pre-order over statements only: every
    ``def``/``class`` is a statement, so expressions, which are most of the tree, are never visited)."""
    docs: list[str] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, _DOC_NODES):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                docs.append(doc)
        children: list[ast.AST] = []
        for field in _STMT_LISTS:
            value = getattr(node, field, None)
            if isinstance(value, list):
                children.extend(v for v in value if isinstance(v, _STMT_TYPES))
        stack.extend(reversed(children))
    return docs


def _file_docstrings(path: Path) -> str | None:
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError, OSError, RecursionError, MemoryError):
        return None
    docs = _docstrings(tree)
    return "\n\n".join(docs) if docs else None


def iter_documents(stdlib_dir: str | os.PathLike | None = None) -> Iterator[tuple[str, str]]:
    """Yield ``(key, text)`` for every corpus document, in the deterministic corpus order.

    Args:
        stdlib_dir: the standard-library folder to walk (default ``sysconfig.get_paths()["stdlib"]``).
    """
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - stripped Python builds
        topics = {}
    for name in sorted(topics):
        text = topics[name]
        if text.strip():
            yield f"pydoc:{name}", text
    root = Path(stdlib_dir if stdlib_dir is not None else sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for fname in sorted(filenames):
            if not fname.endswith(".py"):
                continue
            path = Path(dirpath) / fname
            text = _file_docstrings(path)
            if text:
                yield f"stdlib:{path.relative_to(root).as_posix()}", text


def build_corpus(stdlib_dir: str | os.PathLike | None = None,
                 tokenizer: ByteTokenizer | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Build the (train, val) uint16 token arrays from scratch (no cache)."""
    tok = tokenizer or ByteTokenizer()
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    bos = np.array([tok.BOS], dtype=np.uint16)
    for key, text in iter_documents(stdlib_dir):
        body = np.frombuffer(text.encode("utf-8", "surrogatepass"), dtype=np.uint8).astype(np.uint16)
        parts[is_val_document(key)].extend((bos, body))
    empty = np.zeros(0, dtype=np.uint16)
    train = np.concatenate(parts[False]) if parts[False] else empty
    val = np.concatenate(parts[True]) if parts[True] else empty
    return train, val


def default_cache_dir() -> Path:
    """``$LOWBAND_CACHE_DIR`` (or ``~/.cache/lowband``) / ``corpus-<major.minor.micro>-v<builder>``."""
    base = Path(os.environ.get("LOWBAND_CACHE_DIR", Path.home() / ".cache" / "lowband"))
    v = sys.version_info
    return base / f"corpus-{v.major}.{v.minor}.{v.micro}-v{BUILDER_VERSION}"


def builtin_corpus(cache_dir: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The built-in corpus as ``(train_tokens, val_tokens)``, uint16 arrays (memory-mapped from the cache).

    The first call builds the corpus (a few seconds) and writes ``train.bin`` and ``val.bin`` under
    ``cache_dir``; later calls read them. A missing or malformed cache is rebuilt.

    Args:
        cache_dir: where to cache the shards (default :func:`default_cache_dir`).
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    train_path, val_path = cache / "train.bin", cache / "val.bin"
    if train_path.is_file() and val_path.is_file():
        try:
            return read_shard(train_path), read_shard(val_path)
        except ShardError:
            pass  # rebuild below
    train, val = build_corpus()
    if train.size == 0:
        raise RuntimeError(f"the built-in corpus is empty: no pydoc topics and no stdlib docstrings found "
                           f"under {sysconfig.get_paths()['stdlib']}")
    write_shard(train_path, train)
    write_shard(val_path, val)
    return read_shard(train_path), read_shard(val_path)
