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
* ``diloco``: the **average of the replicas' live models**, ``global + mean_r(local_r - global)`` per
  fragment, i.e. what an outer step with plain averaging would make of the current local work. It is
  symmetric in the replicas and, bitwise, **equals what every replica holds alike**: each tensor is cut into
  segments of whole rows (at least :data:`SEGMENT_MIN_ELEMS` elements), one all-reduce (max, tag
  ``export:digests``) of every segment's two 31-bit digests (:func:`lowband.diloco.row_digest.row_digest_pairs`,
  32 bytes per segment with the negation) finds the segments equal on every replica, and those are copied
  locally and never travel (a frozen base under adapters, buffers nobody changes, a fragment synced at the
  last step, one replica, every fragment just synced with ``diloco.alpha = 0``; an fp32 sum of 3 equal values
  would round). The segments that differ cost the bytes of one all-reduce over the replica group (fp32, fp64
  for fp64 models; tag ``export``), in buckets of at most :data:`EXPORT_BUCKET_BYTES` (the device holds one
  bucket at a time beside the live model; rank 0 writes each averaged bucket into its host copy): at most the
  bytes of one fp32 sync of every fragment, once per run; each of their elements is the mean within the
  rounding of an fp32 (fp64) sum of the replicas' values, exact on 2 replicas. A
  fragment's pseudo-gradient still in flight is waited for first (so the export's collective is issued in
  the same order on every rank) and is not applied. With GTP inside the replicas (``diloco.inner = "gtp"``)
  each gathered layer is averaged over the replicas on the device as soon as it is gathered (the same
  bytes as averaging the gathered model: every GTP rank sends its whole layer), then moves to rank 0's host
  copy or is dropped; the replicated rest is averaged straight from the live model.

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


def _is_sharded(model: nn.Module) -> bool:
    """True if ``model`` holds GTP or tensor-parallel layers (its weights are shards); local, same on every rank."""
    from lowband.parallel.dense import is_sharded_module
    from lowband.parallel.tensor import TPInputGather

    return any(is_sharded_module(m) or isinstance(m, TPInputGather) for m in model.modules())


EXPORT_BUCKET_BYTES = 16 << 20
"""Bytes (in the accumulation dtype) of one all-reduce of the DiLoCo export's average: the device holds one such
bucket at a time beside the live model, never a second copy of the model."""


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    """``model``'s floating-point parameters and buffers in registration order, tied ones once."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_floating_point() and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _buckets(ranges: list[tuple[int, int, int]], cap: int) -> list[list[tuple[int, int, int]]]:
    """The ``(tensor index, start, end)`` element ranges laid end to end, cut into buckets of at most ``cap``
    elements (a range larger than a bucket spans several)."""
    out: list[list[tuple[int, int, int]]] = [[]]
    filled = 0
    for i, start, end in ranges:
        pos = start
        while pos < end:
            if filled == cap:
                out.append([])
                filled = 0
            take = min(end - pos, cap - filled)
            out[-1].append((i, pos, pos + take))
            pos, filled = pos + take, filled + take
    return [b for b in out if b]


def _acc_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    """The export average's accumulation dtype: fp64 if any tensor is fp64, else fp32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


SEGMENT_MIN_ELEMS = 64
"""The fewest elements of one compared segment (below a tensor's whole rows): a row of fewer elements is
compared together with the rows after it, so the digests cost at most 32 bytes per 64 elements."""


def segment_length(t: torch.Tensor) -> int:
    """Elements of one compared segment of ``t``: whole rows (dimension 0 of a tensor of two or more dimensions,
    the whole of a 0-d or 1-d one), as few as give at least :data:`SEGMENT_MIN_ELEMS` elements; ``t``'s flat
    elements are cut into segments of that length (the last one may be shorter)."""
    n = t.numel()
    if n == 0:
        return 1
    cols = n // t.shape[0] if t.dim() >= 2 else n
    return cols * -(-SEGMENT_MIN_ELEMS // cols)


def _segment_digests(t: torch.Tensor) -> torch.Tensor:
    """int64 ``[segments, 2]``: :func:`lowband.diloco.row_digest.row_digest_pairs` of each segment of ``t``."""
    from lowband.diloco.row_digest import row_digest_pairs

    flat, seg = t.detach().reshape(-1), segment_length(t)
    whole = flat.numel() // seg
    parts = [row_digest_pairs(flat[:whole * seg].view(whole, seg))] if whole else []
    if flat.numel() > whole * seg:
        parts.append(row_digest_pairs(flat[whole * seg:]))
    return torch.cat(parts) if parts else torch.zeros(0, 2, dtype=torch.int64, device=t.device)


def _differing_ranges(comm: Any, src: list[torch.Tensor], device: torch.device) -> list[tuple[int, int, int]]:
    """The ``(tensor index, start, end)`` flat element ranges of ``src`` whose segments are not bit-identical
    on every rank of ``comm`` (the same list on every rank). Collective: one all-reduce (max, tag
    ``export:digests``) of every segment's digest pair and its negation, ``2 (N-1)/N * 32`` bytes per segment:
    a segment is equal everywhere when the largest digest equals the smallest, in both digests (digests on
    ``device``, the one ``comm`` runs on)."""
    digests = [_segment_digests(t) for t in src]
    counts = [d.shape[0] for d in digests]
    pairs = torch.cat(digests)
    both = torch.cat([pairs, -pairs]).to(device)
    comm.all_reduce(both, "max", tag="export:digests")
    differ = (both[:len(pairs)] != -both[len(pairs):]).any(dim=1).to("cpu", torch.int8)
    out: list[tuple[int, int, int]] = []
    offset = 0
    for i, (t, count) in enumerate(zip(src, counts, strict=True)):
        mine = differ[offset:offset + count]
        offset += count
        if not bool(mine.any()):
            continue
        seg, edges = segment_length(t), torch.diff(mine, prepend=mine.new_zeros(1), append=mine.new_zeros(1))
        starts, ends = (edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()
        out.extend((i, a * seg, min(b * seg, t.numel())) for a, b in zip(starts, ends, strict=True))
    return out


@torch.no_grad()
def _average_tensors(comm: Any, src: list[torch.Tensor], dst: list[torch.Tensor] | None, *, device: torch.device,
                     acc: torch.dtype, bucket_bytes: int = EXPORT_BUCKET_BYTES) -> None:
    """Write into ``dst`` (tensors of ``src``'s shapes, on any device, or ``src`` itself; ``None`` on a rank that
    keeps nothing) the average over ``comm`` of ``src``, exactly ``src`` wherever every rank holds the same bits.

    Collective, every rank alike: first the digests of every segment (:func:`_differing_ranges`, whole rows of at
    least :data:`SEGMENT_MIN_ELEMS` elements), then the segments that differ on some rank, laid end to end,
    all-reduced (avg, tag ``export``) in ``acc`` in buckets of at most ``bucket_bytes`` on ``device`` (the one
    ``comm`` runs on). A segment equal everywhere is copied locally and never travels (a frozen base, a buffer
    nobody changes, a fragment synced at the last step): it is exported bitwise, where an fp32 sum of 3 equal
    values would round. In a segment that differs, each element is the mean rounded like an fp32 / fp64 sum of
    the ranks' values (on 2 ranks ``(a + b) / 2`` exactly, in either order)."""
    if dst is not None and [t.shape for t in dst] != [t.shape for t in src]:
        raise ValueError("export: the copy's tensors do not match the model's")  # a bug, never a user's input
    if dst is not None:
        for d, t in zip(dst, src, strict=True):
            if d is not t:
                d.copy_(t)
    if not src or comm.size == 1:
        return
    ranges = _differing_ranges(comm, src, device)
    cap = max(1, bucket_bytes // acc.itemsize)
    flat_src = [t.detach().reshape(-1) for t in src]  # views (a copy for a rare non-contiguous tensor)
    flat_dst = None if dst is None else [d.view(-1) if d.is_contiguous() else d.reshape(-1) for d in dst]
    for bucket in _buckets(ranges, cap):
        flat = torch.cat([flat_src[i][a:b].to(device=device, dtype=acc) for i, a, b in bucket])
        comm.all_reduce(flat, "avg", tag="export")
        if flat_dst is None:
            continue
        offset = 0
        for i, a, b in bucket:
            flat_dst[i][a:b].copy_(flat[offset:offset + b - a])
            offset += b - a
    if dst is not None and flat_dst is not None:
        for d, f in zip(dst, flat_dst, strict=True):
            if not d.is_contiguous():  # written through a copy: put it in place
                d.copy_(f.view(d.shape))


def _average_over(comm: Any, source: nn.Module, dest: nn.Module | None, *, device: torch.device | None = None,
                  bucket_bytes: int = EXPORT_BUCKET_BYTES) -> None:
    """:func:`_average_tensors` of ``source``'s floating-point parameters and buffers (registration order, tied
    ones once) into ``dest``'s (a module of ``source``'s structure, ``source`` itself, or ``None``), on ``device``
    (default: ``source``'s)."""
    src = _tensors(source)
    if not src:
        return
    _average_tensors(comm, src, _tensors(dest) if dest is not None else None,
                     device=src[0].device if device is None else device, acc=_acc_dtype(src),
                     bucket_bytes=bucket_bytes)


@torch.no_grad()
def _average_sharded(comm: Any, live: nn.Module, keep: bool) -> nn.Module | None:
    """The average over ``comm`` (the DiLoCo replicas) of the replicas' gathered GTP / TP models, in host memory
    where ``keep``: every gathered layer is averaged on the device as soon as it is gathered (then moves to the
    host, or is dropped), the replicated rest straight from the live model (collective on every rank alike)."""
    from lowband.parallel import unsharded_copy
    from lowband.parallel.tensor import TPInputGather
    from lowband.parallel.unshard import replicated_tensors

    inner = live.module if isinstance(live, TPInputGather) else live
    device = next(iter(inner.parameters())).device
    acc = _acc_dtype(_tensors(inner))

    def average_layer(layer: nn.Module) -> None:
        ts = _tensors(layer)
        _average_tensors(comm, ts, ts, device=device, acc=acc)

    copied = unsharded_copy(inner, device="cpu", keep=keep, each_layer=average_layer)
    rest = [(name, t) for name, t in replicated_tensors(inner) if t.is_floating_point()]
    dst = None
    if copied is not None:
        mine = dict([*copied.named_parameters(), *copied.named_buffers()])
        dst = [mine[name] for name, _ in rest]
    _average_tensors(comm, [t for _, t in rest], dst, device=device, acc=acc)
    return copied


def _host_copy(model: nn.Module) -> nn.Module:
    """A deep copy of a plain ``model`` with every parameter and buffer copied straight to host memory."""
    from lowband.parallel.unshard import unsharded_copy

    copied = unsharded_copy(model, device="cpu")
    assert copied is not None
    return copied


def plain_model(strategy: Strategy, *, keep: bool = True) -> tuple[nn.Module | None, str]:
    """The model to export and a one-line description of which copy it is (collective; see module docstring).

    Returns ``(module, source)``; ``module`` is the live model when no gather or averaging was needed
    (do not modify it), else a plain copy in host memory (the device holds at most one gathered layer or one
    bucket of the average at a time beside the live model). ``keep=False`` (the ranks that do not write) takes
    part in every collective and returns ``None`` where a copy would have been made.
    """
    from lowband.parallel import unsharded_copy
    from lowband.train.strategies.diloco import DilocoStrategy

    live = strategy.unwrapped()
    sharded = _is_sharded(live)
    if not isinstance(strategy, DilocoStrategy):
        if not sharded:
            return live, f"the model every rank holds ({strategy.name})"
        return unsharded_copy(live, device="cpu", keep=keep), f"the gathered full weights ({strategy.name})"
    diloco = strategy.diloco
    diloco.wait_inflight()  # same order on every rank before the export's collectives on the same group
    if diloco.comm.size == 1:
        only = "the model of the only replica (diloco)"
        return (unsharded_copy(live, device="cpu", keep=keep), only) if sharded else (live, only)
    source = f"the average of the {diloco.comm.size} replicas' models (diloco)"
    if sharded:  # each gathered layer averaged over the replicas right away
        return _average_sharded(diloco.comm, live, keep), source
    dest = _host_copy(live) if keep else None
    _average_over(diloco.comm, live, dest)
    return dest, source


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
