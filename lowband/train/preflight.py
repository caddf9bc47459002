"""Checks that run before the first training collective: device, data, directories, cores, run lock.

Everything here can fail before a rank enters a collective, so it does: a problem raises
:class:`~lowband.train.config.ConfigError` (or ``ShardError`` / ``LockError``) with one line naming the
field or file and what to do, and the CLI exits with code 2.

* **device**: ``run.device = cuda`` needs CUDA, and as many GPUs as local ranks.
* **data**: ``.bin`` shards: every token id below ``model.vocab_size`` (one scan per shard, cached,
  :func:`lowband.data.shards.shard_max_token`); the training and validation tokens hold at least one
  global batch of windows (``data.batch_size x world size`` windows of ``model.seq_len + 1`` tokens, the
  validation loader ``data.batch_size / data.grad_accum`` per rank). The built-in corpus is built
  (cached) and checked the same way, and so is ``data.source = text`` (:func:`text_source`: the files
  exist, are non-empty UTF-8; their cached shards are built here).
* **directories**: ``run.out_dir`` and, when saving, the checkpoint directory can be created and written
  (a probe file); a warning when the checkpoint directory's free space is below the size of the last
  checkpoint there.
* **cores**: a warning when more CPU ranks run on this machine than it has CPU cores (its affinity).
* **cache**: the data cache root (``$LOWBAND_CACHE_DIR`` or ``~/.cache/lowband``) is a writable directory.
* **lock**: the run directory and the checkpoint directory (also inside it) are locked (``lowband.train.lock``);
  a lock path of the wrong kind (the run directory a file, ``.lowband.lock`` a folder) is refused first.
* **outputs** (once the lock is held): a run directory holding another run's outputs (``RUN_OUTPUTS``) is
  refused unless this run continues it (resumes from a checkpoint, or runs the config of the directory's
  ``config.toml``: the same command again) or ``run.overwrite = true`` (:func:`check_run_outputs`).

:func:`local_checks` runs them in one process (the self-launcher, before it starts any rank).
:func:`collective_checks` is for ranks started by ``torchrun``: rank 0 runs the filesystem and data
checks and takes the lock, every rank checks its device, and one ``all_gather_object`` on the metrics
``Comm`` (tag ``preflight``) gives every rank the same verdict, so all raise the same error or none does.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lowband.data.shards import VAL_TAIL_DIVISOR, ShardError, val_tail_len
from lowband.train.config import Config, ConfigError
from lowband.train.errors import warn
from lowband.train.lock import LockError, RunLock, acquire_all

if TYPE_CHECKING:
    from lowband.train.env import DistEnv

BYTE_TOKENIZER_IDS = 258


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_device(cfg: Config, local_ranks: int) -> None:
    """``run.device = cuda`` needs CUDA and at least ``local_ranks`` GPUs."""
    import torch

    if cfg.run.device != "cuda":
        return
    if not torch.cuda.is_available():
        raise ConfigError(f"run.device = cuda, but CUDA is not available here (torch {torch.__version__}, "
                          f"{'a CPU-only build' if torch.version.cuda is None else 'no GPU visible'}); "
                          "use run.device = cpu or auto")
    if torch.cuda.device_count() < local_ranks:
        raise ConfigError(f"run.device = cuda with {local_ranks} ranks on this machine, but only "
                          f"{torch.cuda.device_count()} GPU(s) are visible; lower run.world_size")


def cores_warning(cfg: Config, local_ranks: int) -> str | None:
    """The warning line when ``local_ranks`` CPU ranks exceed this machine's CPU cores, else ``None``."""
    if cfg.run.device == "cuda":
        return None
    if cfg.run.device == "auto":
        import torch

        if torch.cuda.is_available():
            return None
    cores = cpu_cores()
    if local_ranks <= cores:
        return None
    return (f"run.world_size = {local_ranks} CPU ranks on {cores} CPU core{'s' if cores > 1 else ''}: the ranks "
            f"will share cores and run slowly; use run.world_size <= {cores}")


def _windows_check(what: str, n_tokens: int, seq_len: int, per_rank: int, world: int, knob: str) -> None:
    windows = max(0, (n_tokens - 1) // seq_len)
    need = per_rank * world
    if windows < need:
        raise ConfigError(
            f"data: {what} has {n_tokens:,} tokens, {windows:,} windows of model.seq_len = {seq_len} (+1 target), "
            f"fewer than one global batch of {knob} x world size = {per_rank} x {world} = {need}; lower "
            f"{knob.split(' ')[0]} or model.seq_len, or use more data")


def _vocab_check(pattern: str, field: str, vocab: int) -> int:
    """Total tokens of the shards of ``pattern``; raise if one holds an id >= ``vocab``."""
    from lowband.data.shards import read_shard, shard_max_token, shard_paths

    total = 0
    for p in shard_paths(pattern):
        total += int(read_shard(p).size)
        top = shard_max_token(p)
        if top >= vocab:
            raise ConfigError(f"{field}: shard {str(p)!r} holds token id {top}, but model.vocab_size = {vocab} "
                              f"(ids must be < vocab_size); set model.vocab_size >= {top + 1} or use shards of "
                              "a matching tokenizer")
    return total


def text_source(cfg: Config) -> tuple[np.ndarray, np.ndarray, Path]:
    """``(train, val, cache folder)`` of ``data.source = text`` (:func:`lowband.data.text.text_corpus`; builds
    the cache on a miss); a missing, empty or non-UTF-8 file raises ``ConfigError`` naming it."""
    from lowband.data.text import TextSourceError, text_corpus

    try:
        return text_corpus(cfg.data.path, cfg.data.val_fraction)
    except TextSourceError as e:
        raise ConfigError(str(e)) from e


def check_data(cfg: Config, world: int) -> None:
    """Vocabulary bounds and corpus length against one global batch (see the module docstring)."""
    d, m = cfg.data, cfg.model
    micro = d.batch_size // d.grad_accum
    if d.source == "bin":
        n_train = _vocab_check(d.train_bin, "data.train_bin", m.vocab_size)
        n_val = _vocab_check(d.val_bin, "data.val_bin", m.vocab_size) if d.val_bin else val_tail_len(n_train)
        if not d.val_bin:
            n_train -= n_val  # the tail is held out of training
        train_what = f"data.train_bin {d.train_bin!r}" + ("" if d.val_bin else " (without its validation tail)")
        val_what = f"data.val_bin {d.val_bin!r}" if d.val_bin else (f"the validation tail (last 1/{VAL_TAIL_DIVISOR}) "
                                                                      "of data.train_bin")
    elif d.source == "text":
        train, val, _ = text_source(cfg)
        n_train, n_val = int(train.size), int(val.size)
        train_what = f"data.path {d.path!r} (training split)"
        val_what = f"data.path {d.path!r} (validation split, the last data.val_fraction = {d.val_fraction})"
    else:
        from lowband.data import builtin_corpus

        train, val = builtin_corpus()
        n_train, n_val = int(train.size), int(val.size)
        train_what, val_what = "the built-in corpus (training split)", "the built-in corpus (validation split)"
    _windows_check(train_what, n_train, m.seq_len, d.batch_size, world, "data.batch_size")
    _windows_check(val_what, n_val, m.seq_len, micro, world, "data.batch_size / data.grad_accum")


def checkpoint_dir(cfg: Config) -> Path:
    from lowband.train.checkpoint import default_checkpoint_dir

    return default_checkpoint_dir(cfg)


def run_dir(cfg: Config) -> Path:
    return Path(cfg.run.out_dir) / cfg.run.name


def _check_writable(path: Path, field: str) -> None:
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{field}: {str(path)!r} exists and is not a directory; choose a directory path")
    anc = path
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise ConfigError(f"{field}: cannot create {str(path)!r}: {str(anc)!r} is not a directory; choose "
                          "another path")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".lowband-probe-"):
            pass
    except OSError as e:
        raise ConfigError(f"{field}: cannot write to {str(path)!r} ({e.strerror or e}); choose a writable "
                          "directory") from e


def free_space_warning(cfg: Config) -> str | None:
    """A warning when the checkpoint directory has less free space than its last checkpoint's size."""
    from lowband.train.checkpoint import latest_checkpoint

    if cfg.checkpoint.every <= 0:
        return None
    d = checkpoint_dir(cfg)
    last = latest_checkpoint(d)
    if last is None:
        return None
    size = sum(int(f.get("size", 0)) for f in last.meta.get("files", {}).values())
    free = shutil.disk_usage(d).free
    if free >= size:
        return None
    return (f"checkpoint directory {str(d)!r} has {free / 1e6:,.1f} MB free, less than its last checkpoint "
            f"({last.path.name}, {size / 1e6:,.1f} MB): the next save may fail; free some space or set "
            "checkpoint.dir elsewhere")


def _check_not_in_checkpoint(path: Path, field: str) -> None:
    """Refuse a directory that is, or lies inside, a committed checkpoint folder: what this run wrote there
    would be mixed into that checkpoint (and deleted with it when its run prunes it)."""
    from lowband.train.checkpoint import MARKER

    p = path.resolve()
    for anc in (p, *p.parents):
        if (anc / MARKER).is_file():
            inside = "is" if anc == p else "lies inside"
            raise ConfigError(f"{field}: {str(path)!r} {inside} the committed checkpoint {str(anc)!r}: this run's "
                              "files would be mixed into it (and deleted with it when its run prunes it). To "
                              f"resume from it set checkpoint.resume = {str(anc)!r}; to save, choose a directory "
                              "outside it")


def check_dirs(cfg: Config) -> list[str]:
    """Writable run and checkpoint directories, neither inside a committed checkpoint; returns warning lines
    (free space)."""
    _check_not_in_checkpoint(Path(cfg.run.out_dir), "run.out_dir")
    _check_writable(Path(cfg.run.out_dir), "run.out_dir")
    if cfg.checkpoint.every > 0:
        field = "checkpoint.dir" if cfg.checkpoint.dir else "checkpoint directory (<run.out_dir>/<run.name>/checkpoint)"
        _check_not_in_checkpoint(checkpoint_dir(cfg), field)
        _check_writable(checkpoint_dir(cfg), field)
    w = free_space_warning(cfg)
    return [w] if w else []


RUN_OUTPUTS = ("metrics.jsonl", "config.toml", "summary.json", "loss.png", "tensorboard", "model.safetensors",
               "model.json")
"""What a run writes into its run directory (the trainer's rank 0); ``logs/`` and ``checkpoint/`` are not here:
logs are appended to, checkpoints have their own rule (``checkpoint.overwrite``, docs/checkpoints.md)."""


def _continues_from_checkpoint(cfg: Config) -> bool:
    """Whether this run will load a checkpoint of its own checkpoint directory (the run that wrote the run
    directory's outputs): ``latest`` with saving on and a committed checkpoint there (as
    :class:`TrainCheckpointer` decides), or an explicit ``checkpoint.resume`` path inside that directory, and,
    when ``checkpoint.dir`` lies outside the run directory, the checkpoint's marker names this run directory
    as the one its run wrote (markers record ``run_dir``; older ones, without it, are taken as this run's). A
    checkpoint from elsewhere starts another history in this run directory."""
    from lowband.train.checkpoint import CheckpointError, latest_checkpoint, read_marker, wants_resume

    if not wants_resume(cfg):
        return False
    d = checkpoint_dir(cfg).resolve()
    if cfg.checkpoint.resume != "latest":
        chosen: Path | None = Path(cfg.checkpoint.resume).resolve()
        if chosen.parent != d:
            return False
    else:
        info = latest_checkpoint(d) if d.is_dir() else None
        chosen = None if info is None else info.path
    if chosen is None:
        return False
    rd = run_dir(cfg).resolve()
    if d.is_relative_to(rd):  # the run directory's own checkpoint folder: its location says whose it is
        return True
    try:
        written_by = read_marker(chosen).get("run_dir")
    except CheckpointError:
        return False
    return written_by is None or Path(written_by) == rd


def _identity(config: dict) -> dict:
    """A config as a run's identity: without ``run.overwrite`` (a permission, not a setting of the run)."""
    return {sec: {k: v for k, v in vals.items() if (sec, k) != ("run", "overwrite")} for sec, vals in config.items()}


def check_run_outputs(cfg: Config) -> None:
    """Refuse to overwrite another run's outputs: a run directory holding any of :data:`RUN_OUTPUTS` raises
    ``ConfigError`` (one line naming them) unless ``run.overwrite`` is true, this run resumes from a checkpoint
    of its own checkpoint directory (it continues the run that wrote them), or the directory's ``config.toml``
    is this run's config (the same command again: a restart, e.g. a fault-tolerant replica group started again
    from nothing). Call it with the run directory's lock held."""
    if cfg.run.overwrite:
        return
    from lowband.train.config import load_config

    rd = run_dir(cfg)
    found = [name for name in RUN_OUTPUTS if (rd / name).exists() or (rd / name).is_symlink()]
    if not found:
        return
    try:
        if _continues_from_checkpoint(cfg):
            return
    except OSError as e:
        raise ConfigError(f"checkpoint directory {str(checkpoint_dir(cfg))!r} cannot be read ({e.strerror or e}) "
                          f"to tell whether this run continues the outputs in {str(rd)!r}") from e
    earlier: dict | None = None
    if (rd / "config.toml").is_file():
        try:  # parsed, so a field added since it was written compares at its default
            earlier = load_config(str(rd / "config.toml"), []).to_dict()
        except (ConfigError, OSError, ValueError):
            earlier = None
    if earlier is not None and _identity(earlier) == _identity(cfg.to_dict()):
        return
    why = "its config.toml is another config" if (rd / "config.toml").exists() else \
        "no config.toml says whose they are"
    raise ConfigError(f"run directory {str(rd)!r} holds another run's outputs ({', '.join(found)}; {why}), which "
                      "this run would overwrite; choose another run.name / run.out_dir, resume that run from its "
                      "checkpoints, or set run.overwrite = true to replace them")


def lock_dirs(cfg: Config) -> list[Path]:
    """The run directory, then the checkpoint directory when saving: always its own lock, also when it lies
    inside a run directory, so ``checkpoint.dir`` naming another live run's checkpoint folder is refused."""
    rd = run_dir(cfg).resolve()
    dirs = [rd]
    if cfg.checkpoint.every > 0:
        cd = checkpoint_dir(cfg).resolve()
        if cd != rd:
            dirs.append(cd)
    return dirs


def check_cache_dir() -> None:
    """The data cache root (``$LOWBAND_CACHE_DIR`` or ``~/.cache/lowband``) is, or can be made, a writable
    directory: a file there (or above it) is a ``ConfigError`` naming the variable, not a traceback."""
    env = os.environ.get("LOWBAND_CACHE_DIR")
    root = Path(env) if env else Path.home() / ".cache" / "lowband"
    _check_writable(root, "LOWBAND_CACHE_DIR" if env else
                    "the data cache directory (~/.cache/lowband; set LOWBAND_CACHE_DIR to move it)")


def check_lock_paths(cfg: Config) -> None:
    """Each directory :func:`lock_dirs` locks is a directory (or can be made one), and its lock file
    (``.lowband.lock``), if present, is a regular file: a folder or a device there is a ``ConfigError``
    naming it, raised before the lock is taken."""
    from lowband.train.lock import LOCK_NAME

    for d in lock_dirs(cfg):
        field = "run directory (<run.out_dir>/<run.name>)" if d == run_dir(cfg).resolve() else "checkpoint.dir"
        if d.exists() and not d.is_dir():
            raise ConfigError(f"{field}: {str(d)!r} exists and is not a directory; remove it or choose another "
                              "run.name / run.out_dir")
        lock = d / LOCK_NAME
        if (lock.exists() or lock.is_symlink()) and not lock.is_file():
            kind = "a directory" if lock.is_dir() else "not a regular file"
            raise ConfigError(f"run lock {str(lock)!r} is {kind}, not a lowband lock file; remove it (lowband "
                              "writes that name itself) and start again")


def local_checks(cfg: Config, world: int, local_ranks: int) -> None:
    """Device, data and directory checks in this process; warnings (cores, free space) are printed as
    they are found, so they come before an error.

    Raises:
        ConfigError / ShardError: the first problem found.
    """
    w = cores_warning(cfg, local_ranks)
    if w:
        warn(w)
    check_device(cfg, local_ranks)
    check_cache_dir()
    try:
        check_data(cfg, world)
    except OSError as e:  # a data file or cache entry the checks above could not foresee
        where = f" {str(e.filename)!r}" if e.filename else ""
        raise ConfigError(f"data: cannot read or cache{where} ({e.strerror or e})") from e
    for line in check_dirs(cfg):
        warn(line)
    check_lock_paths(cfg)


_ERRORS = {"ConfigError": ConfigError, "ShardError": ShardError, "LockError": LockError}


def collective_checks(cfg: Config, env: DistEnv, *, take_lock: bool, run_local: bool) -> list[RunLock]:
    """Collective (``torchrun`` ranks): rank 0 checks and locks, every rank gets the same verdict.

    Args:
        take_lock: rank 0 locks the run directory (the self-launcher already holds it: ``False``).
        run_local: rank 0 runs :func:`local_checks` (the self-launcher already did: ``False``).

    Returns:
        The locks rank 0 took (empty on other ranks); release them when the run ends.

    Raises:
        ConfigError / ShardError / LockError: on every rank alike, naming the rank that found it when it
            was not rank 0.
    """
    locks: list[RunLock] = []
    verdict: tuple[str, str] | None = None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    try:
        check_device(cfg, local)
        if env.rank == 0:
            if run_local:
                local_checks(cfg, env.world_size, local)
            if take_lock:
                locks = acquire_all(lock_dirs(cfg))
                for lk in locks:
                    for line in lk.warnings:
                        warn(line)
            if run_local:
                check_run_outputs(cfg)
    except (ConfigError, ShardError, LockError) as e:
        verdict = (type(e).__name__, str(e))
    if env.world_size > 1:
        verdicts = env.metrics_comm.all_gather_object(verdict, tag="preflight")
    else:
        verdicts = [verdict]
    for r, v in enumerate(verdicts):
        if v is not None:
            for lk in locks:
                lk.release()
            cls = _ERRORS.get(v[0], ConfigError)
            raise cls(v[1] if r == 0 else f"on rank {r}: {v[1]}")
    return locks
