"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): atomic, keep-last-K, optional async, reshardable.

Layout of ``checkpoint.dir`` (default ``<run.out_dir>/<run.name>/checkpoint``)::

    step-<N>/                  a committed checkpoint after N optimizer steps
        .metadata              DCP's global metadata (written by the coordinator, rank 0)
        __<r>_0.distcp         DCP data written by rank r (replicated tensors once, shards by owner)
        lowband_checkpoint.json   the commit marker: what was saved (see ``expected_meta``) and the
                               size and SHA-256 of every file above; written last, then the folder renamed
    .tmp-step-<N>/             a save in progress, or one that crashed: never loaded, removed by the next save

Save protocol (every rank calls it at the same step): rank 0 clears ``.tmp-step-N``; barrier; every rank
``dcp.save`` (or ``dcp.async_save`` in a background thread, on its own gloo group) into it; then at commit
(at once; for async at the first step after every rank's part finished, agreed in the guard's per-step flags,
or when the next save starts or the run ends) a barrier, rank 0 writes the marker into
the temporary folder and ``os.replace`` s it to ``step-N``, deletes all but the newest ``keep_last``
committed checkpoints *of this run's lineage* (marker first, then the files it lists; a folder holding anything
else is kept) and stale temporary folders, checks that ``step-N`` is on disk,
and a final barrier.

Ownership: every marker records a ``lineage`` id. A fresh run starts a new one, a resumed run continues the
loaded checkpoint's. Before loading or saving, rank 0 lists the committed checkpoints in the folder the run
would not continue (another lineage's, or its own past the resumed step): the run is refused with one line
unless ``checkpoint.overwrite``, which deletes exactly those after the run's first save. Pruning never
touches another lineage. The marker also records ``data_fingerprint`` (:func:`data_fingerprint` of the
training tokens); resuming on other data is refused unless ``checkpoint.allow_data_change``.

A crash at any point before the rename leaves only ``.tmp-step-N``, which no load considers: the previous
checkpoint stays the latest.

Load protocol: rank 0 reads the marker, checks that every recorded file is there with the recorded size
(and SHA-256 when ``checkpoint.verify``), and shares the result with every rank (one ``all_gather_object``),
so a corrupt or mismatched checkpoint raises the same :class:`CheckpointError` on every rank before any
DCP collective. Then every rank builds the state it expects (the same structure it would save) and
``dcp.load`` fills it in place, resharding sharded state to the current world.

What is saved (one DCP state dict):
    ``strategy``: ``Strategy.state_dict()`` (model and optimizer; sharded state as DTensors or as rank-local chunks,
    :mod:`lowband.dcp_chunks`; see
    docs/checkpoints.md for what each strategy provides); ``trainer``: pickled step, LR scheduler, data
    loader position, guard counters and ``extra`` (the trainer's per-rank cumulative wire-byte counters,
    gathered to every rank) (identical on every rank, written once); ``rng_rank<r>``: rank r's
    torch / numpy / python (and CUDA) RNG states; ``buffers_rank<r>``: rank r's persistent module buffers
    (:func:`persistent_buffers`; they may differ per rank: DDP without buffer broadcast, DiLoCo replicas),
    restored after the strategy's state. Resuming at a different world size, rank r reads
    ``rng_rank<r mod saved_world>`` and ``buffers_rank<r mod saved_world>``.

Communication: DCP's own gather/scatter of plans and metadata on the world group (not counted in the
training ledger), plus barriers and one ``all_gather_object`` on the metrics ``Comm`` (one more at the start
for the ownership and data checks, tag ``ckpt``; and, per save, the
trainer's ``extra_state`` gather of its byte counters, also on the metrics ``Comm``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import pickle
import random
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from lowband.buffers import persistent_buffers
from lowband.comm import Comm
from lowband.train.errors import warn

if TYPE_CHECKING:
    from lowband.train.config import Config
    from lowband.train.env import DistEnv
    from lowband.train.guards import NonFiniteGuard
    from lowband.train.strategies.base import Strategy

FORMAT_VERSION = 1
MARKER = "lowband_checkpoint.json"
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"
OLD_PREFIX = ".old-step-"
START_OVER = "start over (checkpoint.resume = none with checkpoint.overwrite = true, or another checkpoint.dir)"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, not committed, corrupt, or from a different run setup.
    The message names the checkpoint and what differs."""


class CheckpointSaveError(CheckpointError):
    """A save failed (disk full, permission, ...) on every rank alike; the message names the cause and the
    previous checkpoint, which stays valid (the failed save's temporary folder is removed)."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint: its folder, step and marker contents."""

    path: Path
    step: int
    meta: dict[str, Any]


# --------------------------------------------------------------------------------------------------
# Folder scanning and the commit marker (pure filesystem; no collectives).

def _step_of(name: str, prefix: str = STEP_PREFIX) -> int | None:
    if not name.startswith(prefix):
        return None
    tail = name[len(prefix):]
    return int(tail) if tail.isdigit() else None


def read_marker(path: str | os.PathLike) -> dict[str, Any]:
    """The commit marker of checkpoint folder ``path``.

    Raises:
        CheckpointError: no such folder, not committed (no marker), or an unreadable marker.
    """
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist (expected a step-<N> folder)")
    marker = p / MARKER
    if not marker.is_file():
        raise CheckpointError(f"checkpoint {str(p)!r} is not committed: {MARKER} is missing (an interrupted "
                              "save, or not a lowband checkpoint)")
    try:
        meta = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {str(p)!r} is corrupt: {MARKER} is not valid JSON ({e})") from e
    if not isinstance(meta, dict) or "format" not in meta or "files" not in meta or "step" not in meta:
        raise CheckpointError(f"checkpoint {str(p)!r} is corrupt: {MARKER} lacks format/step/files")
    if meta["format"] != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {str(p)!r} has format version {meta['format']!r}; this lowband "
                              f"reads version {FORMAT_VERSION}")
    return meta


def list_checkpoints(directory: str | os.PathLike) -> list[CheckpointInfo]:
    """Committed checkpoints in ``directory``, oldest first (folders without a valid marker are ignored)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    out = []
    for child in d.iterdir():
        step = _step_of(child.name)
        if step is None or not child.is_dir():
            continue
        try:
            meta = read_marker(child)
        except CheckpointError:
            continue
        out.append(CheckpointInfo(child, step, meta))
    return sorted(out, key=lambda c: c.step)


def latest_checkpoint(directory: str | os.PathLike) -> CheckpointInfo | None:
    """The newest committed checkpoint in ``directory``, or ``None``."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


UNREADABLE_SUFFIX = ".unreadable"


def unreadable_newer(directory: str | os.PathLike, than: int) -> list[tuple[Path, str]]:
    """``step-<N>`` folders with ``N > than`` whose marker cannot be read, with the reason (oldest first)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    out = []
    for child in sorted(d.iterdir(), key=lambda c: _step_of(c.name) or -1):
        step = _step_of(child.name)
        if step is None or step <= than or not child.is_dir():
            continue
        try:
            read_marker(child)
        except CheckpointError as e:
            out.append((child, str(e)))
    return out


def move_aside(path: Path) -> Path:
    """Rename an unreadable checkpoint folder to ``<name>.unreadable[.k]`` (never considered, never pruned)."""
    target = path.with_name(path.name + UNREADABLE_SUFFIX)
    k = 1
    while target.exists():
        target = path.with_name(f"{path.name}{UNREADABLE_SUFFIX}.{k}")
        k += 1
    os.replace(path, target)
    return target


def check_metadata(path: Path, verify: bool) -> None:
    """DCP's ``.metadata`` of checkpoint ``path`` must unpickle; raise :class:`CheckpointError` naming it."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        FileSystemReader(str(path)).read_metadata()
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        hint = "" if verify else ("; checkpoint.verify = false skips the SHA-256 check that names any altered "
                                  "file before loading")
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: file '.metadata' (DCP's index of the saved "
                              f"tensors) cannot be read ({type(e).__name__}: {first[:200]}){hint}") from e


def _dcp() -> tuple[Any, type[BaseException]]:
    """``torch.distributed.checkpoint`` and its ``CheckpointException`` (a ``BaseException``), imported on
    first use: about a second per process that a run without checkpoints does not pay."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    return dcp, CheckpointException


def _root_cause(e: BaseException) -> str:
    """``Type: message`` of the first failure inside a DCP ``CheckpointException`` (or of ``e`` itself)."""
    if isinstance(e, _dcp()[1]) and e.failures:
        inner = next(iter(e.failures.values()))
        e = inner[0] if isinstance(inner, tuple) else inner
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if "inline_container" in first and "unexpected pos" in first:  # torch's zip writer lost bytes
        return ("a write was cut short: disk full or a file-size limit; torch: "
                + first[first.index("unexpected pos"):][:100])
    return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save/load in a single process" warning (that is the intent)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        yield


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def lineage_of(meta: dict[str, Any]) -> str:
    """The lineage id a marker records ("" for checkpoints written before lineages existed)."""
    value = meta.get("lineage")
    return value if isinstance(value, str) else ""


def data_fingerprint(tokens: Any) -> str:
    """``sha256-<hex>``: SHA-256 of the token ids in order, as little-endian uint16 when every id is below 65536
    (all of lowband's sources), else uint32, hashed in chunks of 4 Mi tokens; the same ids give the same
    fingerprint whatever their array dtype. About 0.35 s per 100 M tokens on one core with SHA instructions."""
    arr = np.asarray(tokens).reshape(-1)
    wide = arr.dtype != np.uint16 and arr.size > 0 and int(arr.max()) >= 1 << 16
    wire = np.dtype("<u4" if wide else "<u2")
    h = hashlib.sha256()
    step = 1 << 22
    for i in range(0, arr.size, step):
        h.update(memoryview(np.ascontiguousarray(arr[i:i + step], dtype=wire)).cast("B"))
    return f"sha256-{h.hexdigest()}"


def delete_checkpoint(path: Path, meta: dict[str, Any]) -> list[str]:
    """Remove a committed checkpoint this run may delete: its marker first (a delete cut short leaves no
    folder that looks committed), then exactly the files the marker lists, then the folder if that emptied
    it. Anything else in the folder (a user's eval results, another run's checkpoint saved inside it) stays,
    with the folder; returns those names (empty when the folder is gone)."""
    with contextlib.suppress(FileNotFoundError):
        (path / MARKER).unlink()
    for name in meta.get("files", {}):
        if "/" not in name and name not in ("", ".", ".."):
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                (path / name).unlink()
    try:
        path.rmdir()
    except FileNotFoundError:
        return []
    except OSError:
        return sorted(c.name for c in path.iterdir())
    return []


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def verify_files(path: str | os.PathLike, meta: dict[str, Any], *, hashes: bool = True) -> None:
    """Check that every file the marker records exists with its size (and SHA-256 when ``hashes``).

    Raises:
        CheckpointError: naming the first missing, truncated or altered file.
    """
    p = Path(path)
    for name, rec in sorted(meta["files"].items()):
        f = p / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {str(p)!r} is corrupt: file {name!r} is missing")
        size = f.stat().st_size
        if size != rec["size"]:
            raise CheckpointError(f"checkpoint {str(p)!r} is corrupt: file {name!r} has {size} bytes, the "
                                  f"marker recorded {rec['size']}")
        if hashes and rec.get("sha256") and _sha256(f) != rec["sha256"]:
            raise CheckpointError(f"checkpoint {str(p)!r} is corrupt: file {name!r} does not match its "
                                  "recorded SHA-256")


def describe_mismatch(saved: dict[str, Any], expected: dict[str, Any], *,
                      allow_data_change: bool = False) -> list[str]:
    """Human-readable differences between a checkpoint's marker and what this run expects (the data's source
    and token count not, with ``allow_data_change``; the data fingerprint is rank 0's check, in
    :meth:`TrainCheckpointer.resume`)."""
    diffs = []
    if saved.get("state_format") != expected["state_format"]:
        diffs.append(f"strategy: checkpoint {saved.get('strategy')!r} (state format "
                     f"{saved.get('state_format')!r}), this run {expected['strategy']!r} (state format "
                     f"{expected['state_format']!r})")
    for k, v in expected["model"].items():
        sv = saved.get("model", {}).get(k)
        if sv != v:
            diffs.append(f"model.{k}: checkpoint {sv!r}, this run {v!r}")
    if saved.get("dtype") != expected["dtype"]:
        diffs.append(f"run.dtype: checkpoint {saved.get('dtype')!r}, this run {expected['dtype']!r}")
    if not any(d.startswith("model.") for d in diffs):
        sp, ep = saved.get("params", {}), expected["params"]
        missing = sorted(set(ep) - set(sp))
        extra = sorted(set(sp) - set(ep))
        if missing:
            diffs.append(f"parameters missing from the checkpoint: {', '.join(missing[:5])}"
                         + (" ..." if len(missing) > 5 else ""))
        if extra:
            diffs.append(f"parameters in the checkpoint but not in this model: {', '.join(extra[:5])}"
                         + (" ..." if len(extra) > 5 else ""))
        for name in sorted(set(ep) & set(sp)):
            if list(sp[name][0]) != list(ep[name][0]) or sp[name][1] != ep[name][1]:
                diffs.append(f"parameter {name}: checkpoint shape {list(sp[name][0])} {sp[name][1]}, this run "
                             f"{list(ep[name][0])} {ep[name][1]}")
    saved_settings = saved.get("settings")
    if isinstance(saved_settings, dict):  # markers written before settings were recorded have none
        for k, v in expected.get("settings", {}).items():
            if k in saved_settings and saved_settings[k] != v:
                diffs.append(f"{k}: checkpoint {saved_settings[k]!r}, this run {v!r}")
    if "seed" in saved and "seed" in expected and saved["seed"] != expected["seed"]:
        diffs.append(f"run.seed: checkpoint {saved['seed']!r}, this run {expected['seed']!r} (the data order "
                     f"follows the seed; resume with the checkpoint's run.seed, or {START_OVER})")
    sd, ed = saved.get("data"), expected.get("data")
    if isinstance(sd, dict) and isinstance(ed, dict) and sd != ed and not allow_data_change:
        diffs.append(f"data: checkpoint trained on {sd.get('train_tokens')!r} tokens of data.source = "
                     f"{sd.get('source')!r}, this run has {ed.get('train_tokens')!r} tokens of {ed.get('source')!r} "
                     "(other data: the data position would not match; checkpoint.allow_data_change = true resumes "
                     "anyway)")
    if saved.get("global_batch") != expected["global_batch"]:
        diffs.append(f"global batch (data.batch_size x world size): checkpoint {saved.get('global_batch')!r}, "
                     f"this run {expected['global_batch']!r} (the data position would not match)")
    return diffs


# --------------------------------------------------------------------------------------------------
# The manager: atomic DCP save/commit, keep-last-K, async, verified load.

class CheckpointManager:
    """Saves and loads DCP checkpoints in ``directory`` with an atomic commit (see the module docstring).

    Every rank constructs one (in the same order relative to other group creations when ``async_save``,
    which creates a dedicated gloo group) and calls :meth:`save`, :meth:`wait`, :meth:`load` and
    :meth:`close` at the same points.

    Args:
        directory: the checkpoint directory (shared by every rank; created on demand).
        comm: a world ``Comm`` for barriers and sharing rank 0's checks (the trainer's metrics comm).
        keep_last: committed checkpoints to keep (>= 1).
        async_save: write in a background thread; :meth:`save` returns once the state is staged (copied).
        verify: record SHA-256 of every file at commit and check it before loading.
    """

    def __init__(self, directory: str | os.PathLike, comm: Comm, *, keep_last: int = 2, async_save: bool = False,
                 verify: bool = True) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be an integer >= 1, got {keep_last!r}")
        self.directory = Path(directory)
        self.comm = comm
        self.keep_last = keep_last
        self.async_save = bool(async_save)
        self.verify = bool(verify)
        self._pending: tuple[Future, int, Path, dict[str, Any]] | None = None
        self.lineage = uuid.uuid4().hex
        """This run's lineage id (written into every marker; only this lineage is pruned). A fresh one by
        default; :meth:`adopt` sets the resumed checkpoint's."""
        self._replace: dict[str, tuple[str, Any]] = {}
        self._async_group = None
        if self.async_save and _distributed() and dist.get_world_size() > 1:
            # DCP's background thread runs its own collectives; a separate group keeps them from
            # interleaving with the training collectives of the main thread.
            self._async_group = dist.new_group(backend="gloo")
        self.last_save_s = 0.0

    # -- save ---------------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Collective: write ``state`` as checkpoint ``step-<step>`` and commit it (async: commit later)."""
        self.wait()
        t0 = time.perf_counter()
        tmp = self.directory / f"{TMP_PREFIX}{step}"
        error = None
        if self.comm.rank == 0:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
            except OSError as e:
                error = self._save_error(step, e)
        self._agree(error)
        meta = dict(meta, step=step, format=FORMAT_VERSION)
        dcp, CheckpointException = _dcp()
        if self.async_save:
            fut = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._async_group,
                                 no_dist=not _distributed())
            self._pending = (fut, step, tmp, meta)
        else:
            try:
                with _quiet_single_process():
                    dcp.save(state, checkpoint_id=str(tmp), no_dist=not _distributed())
            except (Exception, CheckpointException) as e:  # DCP raises the same failure on every rank
                self._fail(step, tmp, e)
            self._commit(step, tmp, meta)
        self.last_save_s = time.perf_counter() - t0

    def _save_error(self, step: int, e: BaseException) -> str:
        prev = latest_checkpoint(self.directory)
        stays = (f"the previous checkpoint {str(prev.path)!r} (step {prev.step}) stays valid" if prev is not None
                 else "there is no earlier checkpoint")
        return f"checkpoint save of step {step} into {str(self.directory)!r} failed ({_root_cause(e)}); {stays}"

    def _agree(self, error: str | None) -> None:
        """Collective: raise the same :class:`CheckpointSaveError` on every rank if any rank has ``error``."""
        errors = self.comm.all_gather_object(error, tag="ckpt") if self.comm.size > 1 else [error]
        first = next((e for e in errors if e), None)
        if first is not None:
            raise CheckpointSaveError(first)

    def _fail(self, step: int, tmp: Path, e: BaseException) -> None:
        """Every rank: a save failed alike everywhere; rank 0 removes the partial folder; raise."""
        message = self._save_error(step, e)
        if self.comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(message) from (e if isinstance(e, Exception) else None)

    def wait(self) -> None:
        """Collective: finish and commit an in-flight async save (no-op when none)."""
        if self._pending is None:
            return
        fut, step, tmp, meta = self._pending
        self._pending = None
        CheckpointException = _dcp()[1]
        try:
            fut.result()
        except (Exception, CheckpointException) as e:
            self._fail(step, tmp, e)
        self._commit(step, tmp, meta)

    def _commit(self, step: int, tmp: Path, meta: dict[str, Any]) -> None:
        """Every rank has written its part of ``tmp``: rank 0 writes the marker and renames atomically."""
        self.comm.barrier(tag="ckpt")
        error = None
        if self.comm.rank == 0:
            try:
                self._commit_rank0(step, tmp, meta)
            except (OSError, CheckpointError) as e:
                error = self._save_error(step, e)
                shutil.rmtree(tmp, ignore_errors=True)
        self._agree(error)

    def _commit_rank0(self, step: int, tmp: Path, meta: dict[str, Any]) -> None:
        """Rank 0: write the marker into ``tmp``, rename it to ``step-<step>``, prune."""
        files = {}
        for f in sorted(tmp.iterdir()):
            if f.is_file() and f.name != MARKER:
                files[f.name] = {"size": f.stat().st_size, "sha256": _sha256(f) if self.verify else ""}
        if ".metadata" not in files:
            raise CheckpointError(f"checkpoint save into {str(tmp)!r} produced no DCP .metadata")
        meta = dict(meta, files=files, saved_at=time.time())
        part = tmp / (MARKER + ".part")
        with part.open("w") as fh:
            json.dump(meta, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(part, tmp / MARKER)
        _fsync_dir(tmp)
        final = self.directory / f"{STEP_PREFIX}{step}"
        old = self.directory / f"{OLD_PREFIX}{step}"
        if final.exists():
            try:
                existing = read_marker(final)
            except CheckpointError as e:  # never overwrite an unreadable checkpoint silently
                aside = move_aside(final)
                warn(f"{e}; moved it to {aside.name!r} before saving step {step} there")
            else:
                if not self.owns(CheckpointInfo(final, step, existing)) and not self._replaceable(final, existing):
                    raise CheckpointError(f"{str(final)!r} holds a checkpoint this run did not write (lineage "
                                          f"{lineage_of(existing) or 'unrecorded'!r}); it is left as it is")
        if final.exists():  # re-saving a step (e.g. a resumed run ending where it started)
            if old.exists():
                self._delete_old(old)
                if old.exists():
                    raise CheckpointError(f"{str(old)!r} is in the way of re-saving step {step} and holds files "
                                          "this run did not write; it is left as it is")
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(self.directory)
        if old.exists():
            self._delete_old(old)
        self._prune()
        if not (final / MARKER).is_file():
            raise CheckpointError(f"checkpoint {str(final)!r} is not on disk after its commit (removed by someone "
                                  "else?)")

    # -- ownership ----------------------------------------------------------------------------------

    def adopt(self, lineage: str, replace: list[tuple[str, str, Any]] | None = None) -> None:
        """Continue ``lineage`` (the resumed checkpoint's, or a fresh one), and (rank 0) delete the committed
        checkpoints ``replace`` names (``(folder name, lineage, saved_at)``, what :meth:`foreign` returned
        when the user asked to replace them) after this run's first successful save."""
        self.lineage = lineage
        self._replace = {name: (lin, saved_at) for name, lin, saved_at in (replace or [])}

    def owns(self, c: CheckpointInfo) -> bool:
        """Whether checkpoint ``c`` belongs to this run's lineage (and is not one it was told to replace)."""
        return lineage_of(c.meta) == self.lineage and not self._replaceable(c.path, c.meta)

    def _replaceable(self, path: Path, meta: dict[str, Any]) -> bool:
        rec = self._replace.get(path.name)
        return (rec is not None and path.parent == self.directory and rec == (lineage_of(meta), meta.get("saved_at")))

    def foreign(self, lineage: str, resumed_step: int | None) -> list[CheckpointInfo]:
        """Committed checkpoints in the directory a run of ``lineage`` resumed at ``resumed_step`` (``None``:
        a fresh run) does not continue: another lineage's, or its own lineage's past the resumed step."""
        return [c for c in list_checkpoints(self.directory)
                if resumed_step is None or lineage_of(c.meta) != lineage or c.step > resumed_step]

    def _prune(self) -> None:
        """Rank 0: keep the newest ``keep_last`` checkpoints of this lineage, delete the checkpoints this run was
        told to replace, and drop stale temporary folders. Nothing else is touched: other lineages'
        checkpoints, ``*.unreadable`` folders, and an ``.old-step-<N>`` whose ``step-<N>`` is missing (a commit
        cut short between its two renames), which is renamed back."""
        for c in [c for c in list_checkpoints(self.directory) if self.owns(c)][:-self.keep_last]:
            self._delete(c.path, c.meta)
        for c in list_checkpoints(self.directory):
            if self._replaceable(c.path, c.meta):
                self._delete(c.path, c.meta)
        self._replace = {}
        for child in self.directory.iterdir():
            if not child.is_dir():
                continue
            if child.name.startswith(TMP_PREFIX):
                shutil.rmtree(child, ignore_errors=True)
            elif child.name.startswith(OLD_PREFIX):
                step = _step_of(child.name, OLD_PREFIX)
                target = self.directory / f"{STEP_PREFIX}{step}"
                if step is not None and not target.exists():
                    os.replace(child, target)
                else:
                    self._delete_old(child)

    def _delete(self, path: Path, meta: dict[str, Any]) -> None:
        """Rank 0: :func:`delete_checkpoint`, warning about a folder kept for files this run did not write."""
        kept = delete_checkpoint(path, meta)
        if kept:
            warn(f"checkpoint {str(path)!r} was deleted (its marker and the files it lists) but the folder is kept: "
                 f"it holds files this run did not write ({', '.join(kept[:5])}{', ...' if len(kept) > 5 else ''})")

    def _delete_old(self, old: Path) -> None:
        """Rank 0: delete a ``.old-step-<N>`` (a committed checkpoint set aside by a re-save) the same way; one
        without a readable marker is left as it is."""
        try:
            meta = read_marker(old)
        except CheckpointError:
            return
        self._delete(old, meta)

    def close(self) -> None:
        """Collective: commit any in-flight async save."""
        self.wait()

    @property
    def pending(self) -> bool:
        """An async save was started and is not committed yet (the same on every rank)."""
        return self._pending is not None

    def save_in_flight(self) -> bool:
        """Local, no communication: an async save is pending and this rank's part of it has not finished.
        When no rank's is (agreed by a collective the caller already runs), :meth:`wait` commits at once."""
        return self._pending is not None and not self._pending[0].done()

    # -- load ---------------------------------------------------------------------------------------

    def inspect(self, path: str | os.PathLike | None) -> CheckpointInfo | None:
        """Collective: rank 0 resolves ``path`` (``None`` = the latest in the directory) and verifies its
        files; every rank gets the same :class:`CheckpointInfo` (or ``None`` when there is none) or the
        same :class:`CheckpointError`."""
        result: tuple[str, Any]
        if self.comm.rank == 0:
            try:
                if path is None:
                    info = latest_checkpoint(self.directory)
                    where = f"resuming from {str(info.path)!r}" if info is not None else "starting from step 0"
                    for bad, reason in unreadable_newer(self.directory, -1 if info is None else info.step):
                        aside = move_aside(bad)
                        warn(f"skipping the newest checkpoint: {reason}; moved it to {aside.name!r} (so no "
                             f"save overwrites it); {where}")
                else:
                    p = Path(path)
                    meta = read_marker(p)
                    info = CheckpointInfo(p, int(meta["step"]), meta)
                if info is not None:
                    verify_files(info.path, info.meta, hashes=self.verify)
                    check_metadata(info.path, self.verify)
                result = ("ok", None if info is None else (str(info.path), info.step, info.meta))
            except CheckpointError as e:
                result = ("error", str(e))
        else:
            result = ("ok", None)
        shared = self.comm.all_gather_object(result, tag="ckpt")[0]
        if shared[0] == "error":
            raise CheckpointError(shared[1])
        if shared[1] is None:
            return None
        p, step, meta = shared[1]
        return CheckpointInfo(Path(p), step, meta)

    def saved_keys(self, info: CheckpointInfo) -> set[str]:
        """The flattened DCP keys checkpoint ``info`` holds (its ``.metadata``; no communication)."""
        from torch.distributed.checkpoint import FileSystemReader

        return set(FileSystemReader(str(info.path)).read_metadata().state_dict_metadata)

    def load(self, info: CheckpointInfo, state: dict[str, Any]) -> None:
        """Collective: fill ``state`` in place from checkpoint ``info`` (DCP reshards as needed).

        Raises:
            CheckpointError: DCP could not read it (on every rank: DCP propagates a failure of any rank).
        """
        dcp, CheckpointException = _dcp()
        try:
            with _quiet_single_process():
                dcp.load(state, checkpoint_id=str(info.path), no_dist=not _distributed())
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            hint = "" if self.verify else (" (checkpoint.verify = false: the files' SHA-256 were not checked; "
                                           "one of them may be damaged)")
            raise CheckpointError(f"checkpoint {str(info.path)!r} could not be loaded: {_root_cause(e) or first}"
                                  f"{hint}") from (e if isinstance(e, Exception) else None)


# --------------------------------------------------------------------------------------------------
# The trainer's glue: what goes into the checkpoint and when.

def rng_state() -> dict[str, Any]:
    """This process's torch, numpy, python (and CUDA) RNG states."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def default_checkpoint_dir(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run.out_dir) / cfg.run.name / "checkpoint"


RESUME_HPARAMS = ("weight_decay", "betas", "eps", "momentum", "nesterov", "ns_method", "ns_steps", "ns_dtype")
"""Param-group settings a resumed run takes from its config rather than from the checkpoint's optimizer state
(which ``load_state_dict`` restores, as torch does), beside the peak lr (the LR scheduler's ``base_lrs``)."""


def _configured_hparams(optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    """The optimizer's settings as this run's config made them (call before loading a checkpoint)."""
    return {"base_lrs": list(getattr(scheduler, "base_lrs", [])),
            "groups": [{k: copy.deepcopy(g[k]) for k in RESUME_HPARAMS if k in g} for g in optimizer.param_groups]}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _reapply_hparams(optimizer: torch.optim.Optimizer, scheduler: Any, configured: dict[str, Any]) -> list[str]:
    """After a checkpoint was loaded: put back the config's peak lr and :data:`RESUME_HPARAMS` where the
    checkpoint's differ (a run resumed with another ``optim.lr`` or ``optim.weight_decay`` trains with them, as
    its ``config.toml`` says); the current lr is always this run's peak times this run's schedule factor at the
    resumed step (another ``run.steps`` moves a decaying schedule). Returns what changed, one
    ``group i: key old -> new`` per setting (peak lr and :data:`RESUME_HPARAMS`)."""
    changed: list[str] = []
    groups = optimizer.param_groups
    if len(configured["groups"]) != len(groups):
        return changed
    base = configured["base_lrs"]
    if base and len(base) == len(getattr(scheduler, "base_lrs", [])):
        for i, (old, new) in enumerate(zip(scheduler.base_lrs, base, strict=True)):
            if not _same(old, new):
                changed.append(f"group {i}: lr {old:g} -> {new:g}")
        scheduler.base_lrs = list(base)
        # the current lr from this run's schedule (another run.steps, warmup or schedule changes it; the
        # checkpoint's param groups hold the lr its own schedule gave), exactly as LambdaLR.step() computes it
        factors = [lam(scheduler.last_epoch) for lam in scheduler.lr_lambdas]
        for g, b, f in zip(groups, base, factors, strict=True):
            g["initial_lr"] = b
            g["lr"] = b * f
        scheduler._last_lr = [g["lr"] for g in groups]
    for i, (g, want) in enumerate(zip(groups, configured["groups"], strict=True)):
        for k, v in want.items():
            if k in g and not _same(g[k], v):
                changed.append(f"group {i}: {k} {g[k]} -> {v}")
                g[k] = copy.deepcopy(v)
    return changed


def wants_resume(cfg: Config) -> bool:
    """Whether the run looks for a checkpoint to load: an explicit ``checkpoint.resume`` path, or ``latest``
    with saving on (``every > 0``)."""
    c = cfg.checkpoint
    return c.resume != "none" and (c.resume != "latest" or c.every > 0)


class TrainCheckpointer:
    """Checkpoint/resume for :func:`lowband.train.trainer.train`, driven by the ``[checkpoint]`` config.

    Saves every ``checkpoint.every`` steps and at the end (when ``every > 0``); resumes from the latest
    committed checkpoint (``resume = "latest"``, only when ``every > 0``), an explicit ``step-<N>`` path,
    or not at all (``"none"``).

    Args:
        cfg, env: the run's config and environment.
        strategy: provides ``state_dict``/``load_state_dict``/``checkpoint_format``/``param_shapes``.
        scheduler: the LR scheduler (its ``state_dict`` is saved; its lambdas come from the config).
        loader: the training ``DistributedLoader`` (its position is saved).
        guard: the non-finite guard (its counters are saved).
        extra_state: called (collectively, on every rank) at each save; its picklable result, which must be
            the same on every rank, is saved with the trainer state and restored into :attr:`extra` on
            resume (the trainer's cumulative byte counters, :mod:`lowband.train.metrics`).
    """

    def __init__(self, cfg: Config, env: DistEnv, strategy: Strategy, scheduler: Any, loader: Any,
                 guard: NonFiniteGuard | None = None, extra_state: Callable[[], Any] | None = None) -> None:
        self.cfg, self.env, self.strategy = cfg, env, strategy
        self.scheduler, self.loader, self.guard = scheduler, loader, guard
        self.extra_state = extra_state
        self.extra: Any = None
        """What ``extra_state`` returned when the resumed checkpoint was saved (``None``: fresh, or not saved)."""
        c = cfg.checkpoint
        self.every = c.every
        self.directory = default_checkpoint_dir(cfg)
        self.wants_resume = wants_resume(cfg)
        self.active = c.every > 0 or self.wants_resume
        self.manager: CheckpointManager | None = None
        if self.active:
            if strategy.checkpoint_format() is None:
                raise CheckpointError(f"strategy {strategy.name!r} does not implement checkpoints yet "
                                      "(Strategy.checkpoint_format() is None; see docs/checkpoints.md); set "
                                      "checkpoint.every = 0 and checkpoint.resume = none")
            self.manager = CheckpointManager(self.directory, env.metrics_comm, keep_last=c.keep_last,
                                             async_save=c.async_save, verify=c.verify)
        self.resumed_from: CheckpointInfo | None = None
        self._fingerprint: str | None = None

    def expected_meta(self) -> dict[str, Any]:
        """What this run would write into a marker (and requires of a checkpoint it loads)."""
        cfg = self.cfg
        return {"strategy": self.strategy.name, "state_format": self.strategy.checkpoint_format(),
                "model": dataclasses.asdict(cfg.model), "dtype": cfg.run.dtype,
                "params": {k: [list(s), d] for k, (s, d) in self.strategy.param_shapes().items()},
                "global_batch": cfg.data.batch_size * self.env.world_size, "world_size": self.env.world_size,
                "torch": torch.__version__, "seed": cfg.run.seed, "settings": self.strategy.resume_settings(),
                "notices": self.strategy.resume_notices(),
                "data": {"source": cfg.data.source, "train_tokens": int(np.asarray(self.loader.tokens).size)}}

    def _state(self, rng_rank: int, trainer_blob: bytes = b"", rng_blob: bytes = b"",
               buffers_blob: bytes | None = b"") -> dict[str, Any]:
        state = {"strategy": self.strategy.state_dict(), "trainer": trainer_blob, f"rng_rank{rng_rank}": rng_blob}
        if buffers_blob is not None:
            state[f"buffers_rank{rng_rank}"] = buffers_blob
        return state

    def _buffers_blob(self) -> bytes:
        """This rank's persistent module buffers (CPU copies), pickled: they evolve per rank (a DDP run that
        does not broadcast buffers, DiLoCo replicas), so each rank saves its own."""
        return pickle.dumps({k: v.detach().cpu().clone() for k, v in persistent_buffers(self.strategy.unwrapped())})

    @torch.no_grad()
    def _load_buffers(self, info: CheckpointInfo, blob: bytes) -> None:
        saved: dict[str, torch.Tensor] = pickle.loads(blob)
        ours = dict(persistent_buffers(self.strategy.unwrapped()))
        bad = sorted(set(saved) ^ set(ours)) + sorted(
            k for k in set(saved) & set(ours) if saved[k].shape != ours[k].shape or saved[k].dtype != ours[k].dtype)
        if bad:
            raise CheckpointError(f"checkpoint {str(info.path)!r} does not match this run: module buffers differ "
                                  f"({', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''})")
        for k, v in ours.items():
            v.copy_(saved[k])

    def save(self, step: int) -> bool:
        """Collective: checkpoint the state after ``step`` optimizer steps; ``False`` when the save failed and
        ``checkpoint.on_save_error = continue`` (rank 0 printed a warning).

        Raises:
            CheckpointSaveError: the save failed (on every rank alike) and ``on_save_error = stop``.
        """
        assert self.manager is not None
        trainer = {"step": step, "scheduler": self.scheduler.state_dict(), "loader": self.loader.state_dict(),
                   "guard": self.guard.state_dict() if self.guard is not None else None,
                   "extra": self.extra_state() if self.extra_state is not None else None}
        # an async save still in flight commits (or fails, reported as its own step's) before this one starts
        self._handled(self.manager.wait)
        state = self._state(self.env.rank, pickle.dumps(trainer), pickle.dumps(rng_state()), self._buffers_blob())
        meta = self.expected_meta()
        if self.env.rank == 0:  # rank 0 writes the marker
            meta.update(lineage=self.manager.lineage, data_fingerprint=self.data_fingerprint(),
                        run_dir=str((Path(self.cfg.run.out_dir) / self.cfg.run.name).resolve()))
        return self._handled(lambda: self.manager.save(step, state, meta))

    def _handled(self, action: Callable[[], None]) -> bool:
        """Run a collective save/commit ``action``; ``False`` when it failed and ``checkpoint.on_save_error =
        continue`` (rank 0 warns), else the failure raises on every rank."""
        try:
            action()
        except CheckpointSaveError as e:
            if getattr(self.cfg.checkpoint, "on_save_error", "stop") == "continue":
                if self.env.is_main:
                    warn(f"{e}; training continues (checkpoint.on_save_error = continue)")
                return False
            raise CheckpointSaveError(f"{e}; the run stops (set checkpoint.on_save_error = continue to train on "
                                      "without it)") from e
        return True

    def save_in_flight(self) -> bool:
        """Local: this rank's part of an async save has not finished (what the guard's per-step flags carry)."""
        return self.manager is not None and self.manager.save_in_flight()

    def commit_finished(self, anyone_busy: bool) -> None:
        """Collective: commit a pending async save once no rank's part is still running (``anyone_busy``, agreed
        by the guard's per-step all-reduce), so a crash after it loses no more than the steps since it; a
        failure follows ``checkpoint.on_save_error``. No communication when nothing is pending or some rank
        is busy."""
        if self.manager is not None and self.manager.pending and not anyone_busy:
            self._handled(self.manager.wait)

    def due(self, step: int, final: bool) -> bool:
        """Whether to save after ``step`` steps (``final``: the run ends or stops here)."""
        return self.every > 0 and (final or step % self.every == 0)

    def data_fingerprint(self) -> str:
        """:func:`data_fingerprint` of the training tokens (computed once; rank 0 alone needs it)."""
        if self._fingerprint is None:
            self._fingerprint = data_fingerprint(self.loader.tokens)
        return self._fingerprint

    def _claim(self, info: CheckpointInfo | None) -> None:
        """Collective (one ``all_gather_object`` on the metrics ``Comm``, tag ``ckpt``): rank 0 decides this
        run's lineage (the resumed checkpoint's, else a fresh id), compares the training data's fingerprint
        with the resumed checkpoint's, and (when saving) lists the checkpoints in ``checkpoint.dir`` this run
        does not continue; every rank gets the same verdict or the same :class:`CheckpointError`."""
        assert self.manager is not None
        c = self.cfg.checkpoint
        verdict: tuple[str, Any] = ("ok", None)
        if self.env.rank == 0:
            try:
                verdict = ("ok", self._claim_rank0(info))
            except CheckpointError as e:
                verdict = ("error", str(e))
            except OSError as e:  # every rank must learn of it (no rank may wait alone in the gather)
                verdict = ("error", f"checkpoint.dir {str(self.manager.directory)!r} cannot be read "
                                    f"({e.strerror or e})")
        verdict = self.manager.comm.all_gather_object(verdict, tag="ckpt")[0]
        if verdict[0] == "error":
            raise CheckpointError(verdict[1])
        lineage, replace, notes = verdict[1]
        self.manager.adopt(lineage, replace if self.env.rank == 0 and c.overwrite else None)
        if self.env.is_main:
            for line in notes:
                warn(line)

    def _claim_rank0(self, info: CheckpointInfo | None) -> tuple[str, list[tuple[str, str, Any]], list[str]]:
        assert self.manager is not None
        c = self.cfg.checkpoint
        notes: list[str] = []
        lineage = lineage_of(info.meta) if info is not None else uuid.uuid4().hex
        if info is not None:
            saved_fp, ours = info.meta.get("data_fingerprint"), self.data_fingerprint()
            if isinstance(saved_fp, str) and saved_fp != ours:
                sd = info.meta.get("data", {})
                what = (f"checkpoint {str(info.path)!r} was trained on other data: data fingerprint {saved_fp} "
                        f"({sd.get('train_tokens')!r} tokens of data.source = {sd.get('source')!r}), this run's "
                        f"{ours} ({int(np.asarray(self.loader.tokens).size)} tokens of {self.cfg.data.source!r})")
                if not c.allow_data_change:
                    raise CheckpointError(f"{what}; resume with the checkpoint's data, set checkpoint."
                                          f"allow_data_change = true to train on with these, or {START_OVER}")
                notes.append(f"{what}; training on with this run's data (checkpoint.allow_data_change = true)")
        if self.every <= 0:
            return lineage, [], notes
        foreign = self.manager.foreign(lineage, None if info is None else info.step)
        if not foreign:
            return lineage, [], notes
        other = [f.path.name for f in foreign if info is None or lineage_of(f.meta) != lineage]
        newer = [f.path.name for f in foreign if info is not None and lineage_of(f.meta) == lineage]
        parts = ([f"{', '.join(other)} (written by another run)"] if other else []) + \
                ([f"{', '.join(newer)} (newer than the resumed step {info.step})"] if newer and info else [])
        held = f"checkpoint.dir {str(self.manager.directory)!r} holds checkpoints this run would not continue: " \
               + "; ".join(parts)
        if not c.overwrite:
            hint = "resume from them (checkpoint.resume = latest), " if info is None else ""
            raise CheckpointError(f"{held}; {hint}choose another checkpoint.dir, or set checkpoint.overwrite = "
                                  "true to replace them (deleted after this run's first save)")
        notes.append(f"{held}; checkpoint.overwrite = true: this run's first save deletes them")
        return lineage, [(f.path.name, lineage_of(f.meta), f.meta.get("saved_at")) for f in foreign], notes

    def resume(self) -> int:
        """Collective: load the configured checkpoint if any; return the step to continue from (0 = fresh).

        Before loading, and also for a fresh run that saves, :meth:`_claim` settles this run's lineage and
        refuses a checkpoint folder holding checkpoints this run would not continue (unless
        ``checkpoint.overwrite``) and a checkpoint of other training data (unless
        ``checkpoint.allow_data_change``)."""
        if self.manager is None:
            return 0
        c = self.cfg.checkpoint
        info = self.manager.inspect(None if c.resume == "latest" else c.resume) if self.wants_resume else None
        if info is None:
            if self.every > 0:
                self._claim(None)
            return 0
        diffs = describe_mismatch(info.meta, self.expected_meta(), allow_data_change=c.allow_data_change)
        if diffs:
            raise CheckpointError(f"checkpoint {str(info.path)!r} does not match this run: " + "; ".join(diffs))
        if info.step > self.cfg.run.steps:
            raise CheckpointError(f"checkpoint {str(info.path)!r} is at step {info.step}, past run.steps = "
                                  f"{self.cfg.run.steps}; raise run.steps to train on from it, or {START_OVER}")
        self._claim(info)
        saved_world = int(info.meta.get("world_size", 1))
        self.strategy.prepare_resume()
        saved = self.manager.saved_keys(info)
        src = self.env.rank % saved_world
        # checkpoints written before buffers were saved per rank hold none: their buffers came from the strategy
        state = self._state(src, buffers_blob=b"" if f"buffers_rank{src}" in saved else None)
        self.strategy.fit_resume_template(state["strategy"], {k.removeprefix("strategy.") for k in saved
                                                              if k.startswith("strategy.")})
        self.manager.load(info, state)
        configured = _configured_hparams(self.strategy.optimizer, self.scheduler)
        self.strategy.load_state_dict(state["strategy"])
        trainer = pickle.loads(state["trainer"])
        self.scheduler.load_state_dict(trainer["scheduler"])
        changed = _reapply_hparams(self.strategy.optimizer, self.scheduler, configured)
        if changed and self.env.is_main:
            print(f"lowband.train: resumed with this run's optimizer settings, not the checkpoint's: "
                  f"{'; '.join(changed)} (the moments and step counts are the checkpoint's)", flush=True)
        saved_notices = info.meta.get("notices")  # markers written before notices were recorded have none
        saved_notices = saved_notices if isinstance(saved_notices, dict) else {}
        noticed = [f"{k} {saved_notices[k]!r} -> {v!r}" for k, v in self.strategy.resume_notices().items()
                   if k in saved_notices and saved_notices[k] != v]
        if noticed and self.env.is_main:
            print(f"lowband.train: resumed with this run's settings, not the checkpoint's: {'; '.join(noticed)}",
                  flush=True)
        loader_state = dict(trainer["loader"])
        if c.allow_data_change:  # the position carries over onto the new tokens
            loader_state.pop("n_tokens", None)
        try:
            self.loader.load_state_dict(loader_state)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {str(info.path)!r} does not match this run's data: {e}") from e
        if self.guard is not None and trainer.get("guard") is not None:
            self.guard.load_state_dict(trainer["guard"])
        self.extra = trainer.get("extra")
        set_rng_state(pickle.loads(state[f"rng_rank{src}"]))
        if f"buffers_rank{src}" in state:
            self._load_buffers(info, state[f"buffers_rank{src}"])
        if int(trainer["step"]) != info.step:
            raise CheckpointError(f"checkpoint {str(info.path)!r} is corrupt: folder step {info.step} but saved "
                                  f"trainer step {trainer['step']}")
        self.resumed_from = info
        if info.step == self.cfg.run.steps and self.env.is_main:
            print(f"lowband.train: checkpoint {str(info.path)!r} is at run.steps = {info.step}: the run is "
                  "complete, nothing to train (raise run.steps to train further)", flush=True)
        return info.step

    def close(self) -> None:
        """Collective: commit an in-flight async save (a failure follows ``checkpoint.on_save_error``)."""
        if self.manager is not None:
            self._handled(self.manager.close)
