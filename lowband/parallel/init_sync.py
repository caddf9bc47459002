"""Initial-weight agreement for GTP and TP: sync a model's state from one rank, or verify it.

GTP and TP cut *one* logical model into shards: rank ``r`` keeps rows (or columns) ``r`` of every
planned weight of the model *it* built. A script that seeds every rank differently (nanoGPT's
``torch.manual_seed(seed + rank)``) would silently train a patchwork of several models, so the
sharding entry points (:func:`lowband.parallel.gtp.shard_linears`, :func:`lowband.parallel.tp_shard.shard_tp`)
call :func:`sync_module_state` first by default (``init_sync=True``, as DiLoCo's ``init_sync``), or
:func:`check_module_state` (``init_sync=False``: verify, raise on every rank if they differ).

Communication pattern (all through :class:`~lowband.comm.Comm` on the given group):

Parameters that are already shards (a GTP shard, a TP slice: :func:`is_sharded`) are left out of
both, so the functions may run on a partly sharded model.

* :func:`sync_module_state`: one ``all_gather_object`` of the structure (tag ``"init_sync:validate"``),
  then one ``broadcast`` from group rank ``src`` per dtype, of every parameter and floating buffer
  flattened into one buffer (ledger tag ``"init_sync"``); a tensor reachable under several names
  (tied weights) travels once.
* :func:`check_module_state`: one ``all_gather_object`` of a per-rank checksum list (tag
  ``"init_check"``); every rank raises the same ``ValueError`` naming the first differing tensor.

No state is kept; nothing is sharded here.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from lowband.comm import Comm
from lowband.sharding import placement_of


def is_sharded(t: torch.Tensor) -> bool:
    """A tensor with a :class:`~lowband.sharding.Placement` (a GTP shard, a TP slice): differs by design."""
    return placement_of(t) is not None


def _state_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(first name, tensor)`` for every parameter and floating buffer, each tensor object once;
    parameters that are already shards (:func:`is_sharded`) are left out."""
    seen: set[int] = {id(p) for p in model.parameters() if is_sharded(p)}
    out: list[tuple[str, torch.Tensor]] = []
    items = list(model.named_parameters(remove_duplicate=False)) + [
        (n, b) for n, b in model.named_buffers(remove_duplicate=False) if b is not None and b.is_floating_point()]
    for name, t in items:
        if id(t) in seen:
            continue
        seen.add(id(t))
        out.append((name, t))
    return out


@torch.no_grad()
def sync_module_state(model: nn.Module, comm: Comm, src: int = 0, *, tag: str = "init_sync") -> int:
    """Overwrite every parameter and floating buffer of ``model`` with group rank ``src``'s values.

    Collective: every rank of ``comm`` must call it with a model of the same structure. One broadcast
    per dtype. Returns the number of elements broadcast (0 on a 1-rank group, where nothing travels).

    Raises:
        ValueError: the ranks' models differ in names, shapes or dtypes (checked with one
            ``all_gather_object`` before any broadcast, identically on every rank).
    """
    tensors = _state_tensors(model)
    if comm.size == 1:
        return 0
    sig = [(n, tuple(t.shape), str(t.dtype)) for n, t in tensors]
    comm.agree(sig, "init_sync: the model structure (parameter names, shapes, dtypes)", tag=f"{tag}:validate")
    total = 0
    for dtype in sorted({t.dtype for _, t in tensors}, key=str):
        group = [t for _, t in tensors if t.dtype == dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        comm.broadcast(flat, src, tag=tag)
        off = 0
        for t in group:
            t.copy_(flat[off:off + t.numel()].view_as(t))
            off += t.numel()
        total += flat.numel()
    return total


def _digest(t: torch.Tensor) -> str:
    data = t.detach().contiguous().cpu()
    if data.dtype == torch.bfloat16:
        data = data.view(torch.int16)
    return hashlib.sha1(data.numpy().tobytes()).hexdigest()


def check_module_state(model: nn.Module, comm: Comm, *, tag: str = "init_check") -> None:
    """Raise ``ValueError`` on every rank of ``comm`` if any parameter or floating buffer differs.

    Collective (one ``all_gather_object`` of bytewise checksums). The error names the first tensor
    that differs and the ranks that disagree with rank 0.
    """
    mine = [(n, tuple(t.shape), str(t.dtype), _digest(t)) for n, t in _state_tensors(model)]
    if comm.size == 1:
        return
    everyone = comm.all_gather_object(mine, tag=tag)
    ref = everyone[0]
    for r, theirs in enumerate(everyone):
        if theirs == ref:
            continue
        if [x[:3] for x in theirs] != [x[:3] for x in ref]:
            raise ValueError(f"initial weights: rank {r} of group {comm.name!r} built a model with other "
                             "parameter names, shapes or dtypes than rank 0")
        first = next(a[0] for a, b in zip(theirs, ref) if a != b)
        bad = [q for q, t in enumerate(everyone) if t != ref]
        raise ValueError(f"initial weights differ between ranks of group {comm.name!r}: {first!r} on ranks "
                         f"{bad} differs from rank 0 (per-rank seeds?); sync them (init_sync=True) or seed "
                         "every rank alike before sharding")
