"""Your own text as training data: UTF-8 files, byte-tokenized into cached ``.bin`` shards.

* **Files**: ``pattern`` is one file or a glob (``data/*.txt``, ``books/**/*.md``; ``**`` recurses); the
  matching regular files are read in sorted path order. A directory, a pattern that matches no file, an
  empty file, or bytes that are not UTF-8 raise :class:`TextSourceError` naming the file (and, for bad
  bytes, the byte offset).
* **Tokens**: the byte tokenizer (:class:`~lowband.data.tokenizer.ByteTokenizer`), as the built-in corpus
  does: each file becomes ``[BOS] + its UTF-8 bytes`` and the files are concatenated into one stream.
* **Split**: the last ``round(val_fraction x N)`` tokens of the stream (at least 1, at most ``N - 1``) are
  the validation split, the rest the training split: with several files, validation is the end of the
  last file(s) in path order, never a slice from the middle of the training text.
* **Cache**: ``train.bin`` and ``val.bin`` (:mod:`lowband.data.shards` format) plus ``source.json`` in
  ``<cache root>/text-<key>/``; the cache root is ``$LOWBAND_CACHE_DIR`` or ``~/.cache/lowband``. The key
  is a SHA-256 of the files' *contents* (each file's size and SHA-256, in path order),
  ``val_fraction`` and :data:`BUILDER_VERSION`: any edit, also one that keeps the size and the modification
  time (``cp -p``, ``rsync -a``, ``tar x``, ``touch -r``), and adding, removing or reordering files, gives a
  new key and a new cache; renaming or moving the files does not. Every lookup therefore reads every file
  once to hash it: 0.10-0.17 s per 100 MB from the page cache on one core of a CPU with SHA instructions
  (SHA-256 measured faster than BLAKE2b's 0.18-0.38 s there), plus the disk read when cold; a build hashes
  the very bytes it tokenizes, so a file edited during the build cannot be cached under its new contents.
  Old caches are left for you to delete; nothing here deletes a file. ``source.json`` is written last: a
  folder without it is incomplete and rebuilt. Writes are atomic, so concurrent builders of the same key
  are safe.

Building reads every file into memory once (2 bytes per token while it runs). No communication.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from lowband.data.shards import ShardError, read_shard, write_shard
from lowband.data.tokenizer import ByteTokenizer

BUILDER_VERSION = 2
"""Bump when the tokenization or split changes: old caches are then ignored."""


class TextSourceError(ValueError):
    """A text source file is missing, empty or not UTF-8; the message names the file (and byte offset)."""


def text_files(pattern: str | os.PathLike) -> list[Path]:
    """The regular files ``pattern`` names (one file, or a glob; ``**`` recurses), sorted by path.

    Raises:
        TextSourceError: ``pattern`` is a directory, or names no file.
    """
    pattern = os.fspath(pattern)
    p = Path(pattern).expanduser()
    if p.is_dir():
        raise TextSourceError(f"data.path {pattern!r} is a directory; name a file or a glob such as "
                              f"'{pattern.rstrip('/')}/*.txt'")
    if p.is_file():
        return [p]
    files = sorted(Path(m) for m in glob.glob(os.path.expanduser(pattern), recursive=True) if Path(m).is_file())
    if not files:
        raise TextSourceError(f"data.path {pattern!r}: no such file, and no file matches it as a glob")
    return files


def _digest() -> hashlib._Hash:
    return hashlib.sha256()


def file_digest(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes, streamed (``hashlib.file_digest``).

    Raises:
        TextSourceError: the file cannot be read.
    """
    try:
        with path.open("rb") as f:
            return hashlib.file_digest(f, _digest).hexdigest()
    except OSError as e:
        raise TextSourceError(f"data.path: cannot read {str(path)!r} ({e.strerror or e})") from e


def file_tokens(path: Path, tokenizer: ByteTokenizer | None = None) -> np.ndarray:
    """``[BOS] + bytes`` of one UTF-8 file as uint16 ids.

    Raises:
        TextSourceError: the file is empty, unreadable, or not valid UTF-8 (the message gives the byte
            offset of the first invalid byte).
    """
    return _file_tokens(_read_file(path), path, tokenizer)


def _read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise TextSourceError(f"data.path: cannot read {str(path)!r} ({e.strerror or e})") from e


def _file_tokens(data: bytes, path: Path, tokenizer: ByteTokenizer | None = None) -> np.ndarray:
    tok = tokenizer or ByteTokenizer()
    if not data:
        raise TextSourceError(f"data.path: {str(path)!r} is empty")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TextSourceError(f"data.path: {str(path)!r} is not UTF-8 text: byte 0x{data[e.start]:02x} at byte "
                              f"offset {e.start} ({e.reason}); convert it to UTF-8 (e.g. iconv -t UTF-8)") from e
    out = np.empty(len(data) + 1, dtype=np.uint16)
    out[0] = tok.BOS
    out[1:] = np.frombuffer(data, dtype=np.uint8)
    return out


def tokenize_files(paths: list[Path], tokenizer: ByteTokenizer | None = None) -> np.ndarray:
    """The token stream of ``paths`` in the given order: ``[BOS] + bytes`` per file, concatenated."""
    return np.concatenate([file_tokens(p, tokenizer) for p in paths])


def split_sizes(n_tokens: int, val_fraction: float) -> tuple[int, int]:
    """``(n_train, n_val)`` with ``n_val = round(val_fraction x n_tokens)`` clamped to ``[1, n_tokens - 1]``.

    Raises:
        ValueError: ``n_tokens < 2`` or ``val_fraction`` outside ``(0, 1)``.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if n_tokens < 2:
        raise ValueError(f"a train/validation split needs at least 2 tokens, got {n_tokens}")
    n_val = min(max(round(val_fraction * n_tokens), 1), n_tokens - 1)
    return n_tokens - n_val, n_val


def split_tokens(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)``: val is the last :func:`split_sizes` tokens of ``tokens``, train the rest."""
    n_train, _ = split_sizes(int(tokens.size), val_fraction)
    return tokens[:n_train], tokens[n_train:]


def cache_root() -> Path:
    """``$LOWBAND_CACHE_DIR`` or ``~/.cache/lowband``."""
    return Path(os.environ.get("LOWBAND_CACHE_DIR", Path.home() / ".cache" / "lowband"))


def cache_key(paths: list[Path], val_fraction: float) -> dict:
    """What the cache is keyed by: builder version, ``val_fraction``, and each file's size and
    :func:`file_digest` (its contents), in the given order. Reads every file once.

    Raises:
        TextSourceError: a file cannot be read.
    """
    return _key([(p.stat().st_size, file_digest(p)) for p in paths], val_fraction)


def _key(files: list[tuple[int, str]], val_fraction: float) -> dict:
    return {"version": BUILDER_VERSION, "val_fraction": float(val_fraction),
            "files": [[size, f"sha256-{digest}"] for size, digest in files]}


def cache_dir_for(key: dict, root: str | os.PathLike | None = None) -> Path:
    """``<root>/text-<first 20 hex digits of sha256(key)>`` (root: :func:`cache_root`)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(root if root is not None else cache_root()) / f"text-{digest}"


def read_cache(folder: str | os.PathLike, key: dict | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """``(train, val)`` memory-mapped from a complete cache folder, else ``None`` (missing, incomplete,
    malformed, or its ``source.json`` records another key than ``key``)."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / "source.json").read_text())
        if key is not None and meta.get("key") != key:
            return None
        train, val = read_shard(folder / "train.bin"), read_shard(folder / "val.bin")
    except (OSError, ValueError, ShardError):
        return None
    if int(train.size) != meta.get("train_tokens") or int(val.size) != meta.get("val_tokens"):
        return None
    return train, val


def _write_json(path: Path, obj: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def text_corpus(pattern: str | os.PathLike, val_fraction: float = 0.05,
                cache_root_dir: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray, Path]:
    """``(train_tokens, val_tokens, cache_folder)`` for the text files ``pattern`` names.

    Reads the cache when its key matches (no file is read then), else tokenizes every file, validating
    it, and writes the cache. The token arrays are uint16, memory-mapped from the cache.

    Args:
        pattern: a file or a glob (:func:`text_files`).
        val_fraction: share of the token stream, from its end, for validation (:func:`split_sizes`).
        cache_root_dir: where ``text-<key>/`` folders go (default :func:`cache_root`).

    Raises:
        TextSourceError: no file, an empty file, or a file that is not UTF-8.
    """
    paths = text_files(pattern)
    key = cache_key(paths, val_fraction)
    folder = cache_dir_for(key, cache_root_dir)
    cached = read_cache(folder, key)
    if cached is not None:
        return cached[0], cached[1], folder
    # A miss: read each file once, and key the cache by the very bytes tokenized (an edit since the lookup
    # lands under the new contents' key, never under the old one).
    parts, files = [], []
    for p in paths:
        data = _read_file(p)
        parts.append(_file_tokens(data, p))
        h = _digest()
        h.update(data)
        files.append((len(data), h.hexdigest()))
    key = _key(files, val_fraction)
    folder = cache_dir_for(key, cache_root_dir)
    train, val = split_tokens(np.concatenate(parts), val_fraction)
    folder.mkdir(parents=True, exist_ok=True)
    write_shard(folder / "train.bin", train)
    write_shard(folder / "val.bin", val)
    _write_json(folder / "source.json", {"key": key, "train_tokens": int(train.size), "val_tokens": int(val.size),
                                         "pattern": os.fspath(pattern),
                                         "paths": [str(p.resolve()) for p in paths]})
    cached = read_cache(folder, key)
    if cached is None:  # pragma: no cover - the folder was changed under us
        raise ShardError(f"{folder}: the text cache just written cannot be read back")
    return cached[0], cached[1], folder
