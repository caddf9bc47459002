"""The final model of a run, written once, plain and unsharded, to the run directory.

:func:`export_model` runs at the end of ``train`` when ``run.export`` is true and a run directory is
written; it produces ``<run dir>/model.safetensors`` and ``model.json`` in the format
:mod:`lowband.train.trained` documents (and :func:`lowband.load_trained` reads). Which copy is written:

* ``single``, ``ddp``, ``sharded-adamw`` / ``sharded-muon``: every rank holds the full model
  (``strategy.unwrapped()``; the sharded optimizers first wait for their in-flight parameter
  all-gathers); rank 0's is written as it is, without a copy. No communication.
* ``gtp``, ``tp`` (any model with GTP or tensor-parallel layers): :func:`lowband.parallel.unsharded_copy`
  gathers the full logical weights (collective over the GTP / TP groups, tags ``gtp:state`` / ``tp:state``,
  see :mod:`lowband.parallel.unshard`), layer by layer into host memory on rank 0; the other ranks take part
  in the gathers and keep nothing. No device holds more than the live model and one gathered layer.
* ``diloco``: the **average of the replicas' live models**, :func:`lowband.diloco.average.replica_average`
  (tags ``export:digests`` and ``export``): ``global + mean_r(local_r - global)`` per fragment, what an outer step
  with plain averaging would make of the current local work, symmetric in the replicas and bitwise what every
  replica holds alike, per segment of rows. A segment equal on every replica (a frozen base, a buffer nobody
  changes, a fragment synced at the last step) never travels; the rest costs at most one fp32 all-reduce of the
  model over the replica group, once per run, beside 32 bytes of digests per segment of at least 64 elements,
  in buckets (the device holds one bucket at a time beside the live model; rank
  0 writes each averaged bucket into its host copy). A fragment's pseudo-gradient still in flight is waited for
  first and is not applied. With GTP inside the replicas (``diloco.inner = "gtp"``) each gathered layer is
  averaged over the replicas on the device as soon as it is gathered, then moves to rank 0's host copy or is
  dropped. With one replica: its model, as it is (gathered when sharded); so is a fault-tolerant group's
  (``ft.enabled``: every group is a launch of its own with one replica and writes its own model, which
  ``model.json``'s ``source`` says; the groups' files differ unless the run ended on a committed sync of every
  fragment with ``diloco.alpha = 0``).

Collectives happen on every rank alike, in the same order; only rank 0 writes, to temporary names
renamed into place, so a crash never leaves a half-written ``model.safetensors`` (nor new weights
beside an old ``model.json``). Rank 0's outcome is then shared on ``env.metrics_comm`` (one
``all_gather_object`` of its error text, "" if none, on that Comm's own ledger), so a failed write
raises the same :class:`ExportError` on every rank.
Tied parameters are stored once (:func:`file_tensors`; see :mod:`lowband.train.trained`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lowband.train.trained import FORMAT, META_FILE, WEIGHTS_FILE

if TYPE_CHECKING:
    from lowband.train.config import Config
    from lowband.train.env import DistEnv
    from lowband.train.models import ModelFactory
    from lowband.train.strategies.base import Strategy

__all__ = ["ExportError", "export_model", "file_tensors", "model_meta", "plain_model"]


class ExportError(RuntimeError):
    """Writing the final model failed (on rank 0); raised on every rank alike."""


def plain_model(strategy: Strategy, *, keep: bool = True) -> tuple[nn.Module | None, str]:
    """The model to export and a one-line description of which copy it is (collective; see module docstring).

    Returns ``(module, source)``; ``module`` is the live model when no gather or averaging was needed
    (do not modify it), else a plain copy in host memory (the device holds at most one gathered layer or one
    bucket of the average at a time beside the live model). ``keep=False`` (the ranks that do not write) takes
    part in every collective and returns ``None`` where a copy would have been made.
    """
    from lowband.diloco.average import replica_average
    from lowband.parallel.unshard import holds_shards, unsharded_copy
    from lowband.train.strategies.diloco import DilocoStrategy

    live = strategy.unwrapped()
    sharded = holds_shards(live)
    if not isinstance(strategy, DilocoStrategy):
        if not sharded:
            return live, f"the model every rank holds ({strategy.name})"
        return unsharded_copy(live, device="cpu", keep=keep), f"the gathered full weights ({strategy.name})"
    diloco = strategy.diloco
    if diloco.comm.size == 1:
        diloco.wait_inflight()
        ft = strategy.cfg.ft
        only = (f"group {ft.group}'s own model (diloco, fault-tolerant, {ft.groups} groups: each group writes its "
                "own; they differ unless the run ended on a committed sync of every fragment with diloco.alpha = "
                "0)") if ft.enabled else "the model of the only replica (diloco)"
        return (unsharded_copy(live, device="cpu", keep=keep), only) if sharded else (live, only)
    source = f"the average of the {diloco.comm.size} replicas' models (diloco)"
    return replica_average(diloco, keep=keep, tag="export"), source


def _factory_spec(cfg: Config, model_factory: ModelFactory | None) -> tuple[str | None, str]:
    """``(importable "module:function" or None, a readable name)`` of the factory that built the model."""
    if model_factory is None:
        return (cfg.model.factory or None), (cfg.model.factory or "lowband.model.GPT")
    mod, qual = getattr(model_factory, "__module__", None), getattr(model_factory, "__qualname__", None)
    name = f"{mod}:{qual}" if mod and qual else repr(model_factory)
    importable = bool(mod and qual) and "<" not in qual and mod != "__main__"
    return (name if importable else None), name


def model_meta(model: nn.Module, cfg: Config, *, strategy: Strategy, world_size: int, step: int, source: str,
               model_factory: ModelFactory | None = None) -> dict[str, Any]:
    """The ``model.json`` contents for ``model`` (the format of :mod:`lowband.train.trained`)."""
    from lowband.model.gpt import GPT

    spec, name = _factory_spec(cfg, model_factory)
    is_gpt = type(model) is GPT
    plan = getattr(strategy, "plan", None)
    vocab = getattr(plan, "vocab_size", None) or cfg.model.vocab_size
    meta: dict[str, Any] = {
        "format": FORMAT, "weights": WEIGHTS_FILE, "builder": "gpt" if is_gpt else "factory",
        "gpt": model.config.to_dict() if is_gpt else None, "factory": spec, "config": cfg.to_dict(),
        "dtype": cfg.run.dtype, "tokenizer": "bytes", "vocab_size": int(vocab),
        "seq_len": int(model.config.seq_len if is_gpt else cfg.model.seq_len), "forward": strategy.forward,
        "strategy": strategy.name, "world_size": world_size, "step": step, "source": source,
    }
    if not is_gpt and spec is None:
        meta["factory_repr"] = name
    return meta


def file_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``model.state_dict()`` as safetensors can store it: ``(tensors, metadata)``.

    Tied entries (the same storage, offset, shape and strides under several names) are stored once,
    under the alphabetically first name, and the metadata maps each dropped name to the kept one (the
    convention of ``safetensors.torch.save_model``, so ``load_model`` restores the tie). A tensor that
    is a view into a larger buffer (the sharded optimizers keep parameters in flat buffers) is copied
    out, as is any other entry sharing a storage already stored (safetensors refuses both); others are
    stored as they are, without a copy.
    """
    groups: dict[tuple, list[str]] = {}
    state = model.state_dict()
    for name, t in state.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        groups.setdefault(key, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    metadata = {"format": "pt", "lowband": FORMAT}
    stored: set[tuple] = set()
    for (device, ptr, *_), names in groups.items():
        keep, *dropped = sorted(names)
        t = state[keep].detach()
        whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        own = whole and (device, ptr) not in stored  # else another entry views the same storage: copy
        tensors[keep] = t.contiguous() if own else t.clone(memory_format=torch.contiguous_format)
        stored.add((device, ptr))
        metadata.update({d: keep for d in dropped})
    return tensors, metadata


def _write(model: nn.Module, meta: dict[str, Any], run_dir: Path) -> Path:
    """Write both files under temporary names, then move them into place: an older ``model.json`` is removed
    first and the new one comes last, so a crash in between never pairs new weights with an old description."""
    from safetensors.torch import save_file

    run_dir.mkdir(parents=True, exist_ok=True)
    weights, meta_path = run_dir / WEIGHTS_FILE, run_dir / META_FILE
    tmp_w, tmp_m = weights.with_name(weights.name + ".tmp"), meta_path.with_name(meta_path.name + ".tmp")
    try:
        tensors, metadata = file_tensors(model)
        save_file(tensors, str(tmp_w), metadata=metadata)
        tmp_m.write_text(json.dumps(meta, indent=1) + "\n")
        tmp_w.chmod(tmp_m.stat().st_mode & 0o777)  # safetensors creates its file 0600; give it model.json's mode
        meta_path.unlink(missing_ok=True)
        os.replace(tmp_w, weights)
        os.replace(tmp_m, meta_path)
    finally:
        tmp_w.unlink(missing_ok=True)
        tmp_m.unlink(missing_ok=True)
    return weights


def _cause(e: BaseException) -> str:
    """One phrase for a failed write: ``OSError: no space left on device (writing '.../model.safetensors.tmp')``."""
    if isinstance(e, OSError) and e.strerror:
        where = f" (writing {str(e.filename)!r})" if e.filename else ""
        return f"{type(e).__name__}: {e.strerror[0].lower()}{e.strerror[1:]}{where}"
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}{': ' + text[:300] if text else ''}"


def export_model(strategy: Strategy, cfg: Config, env: DistEnv, run_dir: Path, *, step: int,
                 model_factory: ModelFactory | None = None) -> Path | None:
    """Write the run's final model to ``run_dir`` (rank 0); collective, call on every rank alike.

    Returns the path of ``model.safetensors`` on rank 0 and ``None`` on the others.

    Raises:
        ExportError: rank 0 could not write the files (on every rank, after rank 0's attempt).
    """
    model, source = plain_model(strategy, keep=env.is_main)  # only the writer keeps a gathered copy
    error = ""
    path: Path | None = None
    if env.is_main:
        assert model is not None
        meta = model_meta(model, cfg, strategy=strategy, world_size=env.world_size, step=step, source=source,
                          model_factory=model_factory)
        try:
            path = _write(model, meta, run_dir)
        except Exception as e:  # OSError (disk full, permission), safetensors' own error, ...: never one rank alone
            error = _cause(e)
    error = env.metrics_comm.all_gather_object(error, tag="export")[0]  # rank 0's verdict, on every rank
    if error:
        raise ExportError(f"writing the final model to {str(run_dir)!r} failed on rank 0 ({error}); no model file "
                          "was written (the training itself finished; its checkpoints are kept): fix the cause (free "
                          "some space, ...) or set run.export = false to skip it")
    return path
