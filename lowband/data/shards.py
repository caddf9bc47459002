"""Token shards in the modded-nanogpt ``.bin`` format.

Layout: a header of 256 little-endian int32 — ``[0]`` magic 20240520, ``[1]`` version 1, ``[2]`` token
count, the rest zero — followed by the tokens as little-endian uint16. :func:`read_shard` memory-maps the
tokens; :func:`write_shard` writes atomically (temporary file in the same folder, then rename), so
readers never see a half-written shard even when several ranks write the same file at once.
"""

from __future__ import annotations

import glob
import os
import tempfile
from pathlib import Path

import numpy as np

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")


class ShardError(ValueError):
    """A token shard is missing or malformed; the message names the file and what was expected."""


VAL_TAIL_DIVISOR = 20
"""Without a validation set of its own, the last ``1/VAL_TAIL_DIVISOR`` of the training tokens is held out."""


def val_tail_len(n_train: int) -> int:
    """Tokens held out of ``n_train`` training tokens as the validation tail (at least one)."""
    return max(n_train // VAL_TAIL_DIVISOR, 1)


def write_shard(path: str | os.PathLike, tokens: np.ndarray | list[int]) -> Path:
    """Write ``tokens`` (1-D, integer ids in ``[0, 65536)``) as a ``.bin`` shard at ``path``, atomically.

    Returns:
        The path written.

    Raises:
        TypeError: tokens are not integers.
        ValueError: tokens are not 1-D or hold an id outside ``[0, 65536)``.
    """
    arr = np.asarray(tokens)
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"tokens must be integer ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 65536):
        raise ValueError(f"tokens must lie in [0, 65536) for a uint16 shard, got min {int(arr.min())} "
                         f"max {int(arr.max())}")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, arr.size
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a shared cache should be readable by others
        with os.fdopen(fd, "wb") as f:
            f.write(header.tobytes())
            f.write(arr.astype(TOKEN_DTYPE, copy=False).tobytes())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def read_shard(path: str | os.PathLike) -> np.ndarray:
    """Tokens of a ``.bin`` shard as a read-only uint16 array (memory-mapped).

    Raises:
        ShardError: missing file, file shorter than the header, bad magic, bad version, or a token count
            that does not match the file size.
    """
    path = Path(path)
    if not path.is_file():
        raise ShardError(f"{path}: no such token shard file")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: file is {size} bytes, shorter than the {HEADER_BYTES}-byte shard header")
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    if int(header[0]) != MAGIC:
        raise ShardError(f"{path}: bad magic {int(header[0])}, expected {MAGIC} (not a lowband/modded-"
                         "nanogpt .bin shard)")
    if int(header[1]) != VERSION:
        raise ShardError(f"{path}: unsupported version {int(header[1])}, expected {VERSION}")
    count = int(header[2])
    expected = HEADER_BYTES + 2 * count
    if count < 0 or size != expected:
        raise ShardError(f"{path}: header says {count} tokens ({expected} bytes with header), but the file "
                         f"is {size} bytes")
    if count == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(count,))


def load_tokens(pattern: str | os.PathLike) -> np.ndarray:
    """Read every shard matching the glob ``pattern`` (sorted by path) and concatenate their tokens.

    Raises:
        ShardError: nothing matches ``pattern``, or a matching shard is malformed.
    """
    paths = sorted(glob.glob(os.fspath(pattern)))
    if not paths:
        raise ShardError(f"{pattern}: no token shard files match this pattern")
    arrays = [read_shard(p) for p in paths]
    if len(arrays) == 1:
        return arrays[0]
    return np.concatenate(arrays)


def _stats_cache_dir() -> Path:
    return Path(os.environ.get("LOWBAND_CACHE_DIR", Path.home() / ".cache" / "lowband")) / "shard-stats"


def shard_max_token(path: str | os.PathLike, cache: bool = True) -> int:
    """The largest token id in shard ``path`` (-1 for an empty shard), from one scan, cached.

    The cache is one small JSON file per shard under ``$LOWBAND_CACHE_DIR`` (or ``~/.cache/lowband``)
    ``/shard-stats/``, keyed by the shard's real path, size and modification time, so a rewritten shard
    is scanned again. An unwritable cache only costs the scan.

    Raises:
        ShardError: the shard is missing or malformed.
    """
    import hashlib
    import json

    real = Path(path).resolve()
    tokens = read_shard(real)
    st = real.stat()
    key = {"path": str(real), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    entry = _stats_cache_dir() / (hashlib.sha1(str(real).encode()).hexdigest() + ".json")
    if cache:
        try:
            rec = json.loads(entry.read_text())
            if all(rec.get(k) == v for k, v in key.items()) and isinstance(rec.get("max_id"), int):
                return rec["max_id"]
        except (OSError, ValueError):
            pass
    max_id = int(tokens.max()) if tokens.size else -1
    if cache:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".stats.", dir=entry.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(dict(key, max_id=max_id), f)
            os.replace(tmp, entry)
        except OSError:
            pass
    return max_id


def shard_paths(pattern: str | os.PathLike) -> list[Path]:
    """The shards matching glob ``pattern``, sorted (what :func:`load_tokens` reads).

    Raises:
        ShardError: nothing matches.
    """
    paths = sorted(glob.glob(os.fspath(pattern)))
    if not paths:
        raise ShardError(f"{pattern}: no token shard files match this pattern")
    return [Path(p) for p in paths]
