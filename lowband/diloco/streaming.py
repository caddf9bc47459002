"""`StreamingDiLoCo`: fragment-wise outer synchronisation across replica groups, driven by the inner
optimizer's step post-hook (the user's training loop does not change).

Schedule (see :mod:`lowband.diloco.schedule`): with ``n`` fragments, ``sync_every`` ``H`` and delay
``tau``, ``K = H / n``. After the inner step that brings the local step to ``K - tau`` the fragment
``committed % n`` is *prepared*: its pseudo-gradient ``global - local`` is packed into flat fp32
buckets (fp64 for fp64 models) on the parameters' device and each bucket's codec all-reduce (average
over replicas) is started asynchronously. Between prepare and sync every post-hook polls the
in-flight buckets (issuing their second phase as soon as the first is done), so the traffic overlaps
the next ``tau`` inner steps. After the step that brings it to ``K`` the fragment is *synced*: wait,
outer optimizer step on the averaged pseudo-gradient (on the global copy), ``committed += 1``, and the
fragment's weights become ``global + alpha (local - global)``; the local step returns to 0.

Communication (per sync, cross-replica group, tag ``diloco:frag<i>``): per bucket one all-to-all and
one all-gather of the encoded pseudo-gradient (``2 (N-1)/N`` of the encoded bytes per rank, see
:mod:`lowband.comm.codecs`). Once at construction (tag ``diloco:init``): one broadcast of every
parameter from replica 0 (``init_sync``), and one ``all_gather_object`` (tag ``validate``) checking
that every replica has the same settings and fragment shapes.

State layout: per fragment, a global copy of its parameters on ``backup_device`` (default CPU, pinned
when the model is on CUDA) and one outer optimizer over those copies (so its state, e.g. SGD
momentum, lives there too); the counters ``committed`` and ``local_step``. The inner optimizer and
the model are never replaced; the model's weights are written in place at each sync.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lowband.comm import Comm
from lowband.comm.codecs import CODECS, DEFAULT_BLOCK_SIZE, get_codec
from lowband.diloco.fragments import Fragment, split_fragments
from lowband.diloco.membership import StaticMembership
from lowband.diloco.outer import (
    OuterOptimizerFactory,
    default_outer_optimizer,
    merge_,
    outer_step,
    pseudo_gradient_into,
)
from lowband.diloco.schedule import PREPARE, SYNC, ScheduleConfig, actions_at, fragment_for


@dataclass
class _InFlight:
    fragment: int
    flat: torch.Tensor
    handles: list[Any]


def _bucket_bounds(numel: int, cap_elems: int | None) -> list[tuple[int, int]]:
    if cap_elems is None or cap_elems >= numel:
        return [(0, numel)]
    return [(s, min(s + cap_elems, numel)) for s in range(0, numel, cap_elems)]


class StreamingDiLoCo:
    """Streaming DiLoCo around an existing model and inner optimizer.

    Args:
        model: the replica's model, weights initialised (the global copies are taken now).
        inner_optimizer: the model's optimizer; a step post-hook is registered on it.
        comm: the cross-replica group (same dp rank in every replica); ``None`` = a 1-rank Comm.
        sync_every: H, inner steps between two syncs of the same fragment.
        fragments: number of fragments (default consecutive split) or a list of modules / parameter
            lists (see :func:`lowband.diloco.fragments.split_fragments`).
        delay: tau, inner steps between a fragment's prepare and its sync, in ``[0, H / n)``.
        alpha: merge weight of the local weights after a sync, in ``[0, 1]`` (0 = pure global).
        outer_optimizer: a factory ``params -> Optimizer`` used for every fragment, or a list of n
            factories (one per fragment); default SGD lr 0.7 momentum 0.9 Nesterov.
        wire: pseudo-gradient wire codec: ``fp32``, ``bf16``, ``fp8``, ``int8`` (or ``fp64``).
        block_size: elements per scale for ``fp8``/``int8``.
        bucket_cap_mb: split a fragment's flat pseudo-gradient into buckets of at most this many MiB
            (of the fp32/fp64 buffer); ``None`` = one bucket per fragment.
        backup_device: where global copies and outer state live (default CPU).
        init_sync: broadcast the weights from replica 0 at construction so all replicas start equal.
        membership: who takes part in a sync; default :class:`StaticMembership` over ``comm``; or
            :class:`lowband.diloco.ft.TorchftMembership` (quorum, healing, rollback and retry).

    Raises:
        ValueError: naming the value: H < n, n not dividing H, tau outside ``[0, H/n)``, alpha outside
            ``[0, 1]``, a list of outer optimizers of the wrong length, overlapping fragments,
            fragments leaving trainable parameters out, an unknown wire codec, settings that differ
            between replicas. All local checks run before any collective.
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, *,
                 comm: Comm | None = None, sync_every: int,
                 fragments: int | Sequence[nn.Module | Iterable[nn.Parameter]] = 1, delay: int = 0,
                 alpha: float = 0.0,
                 outer_optimizer: OuterOptimizerFactory | Sequence[OuterOptimizerFactory] | None = None,
                 wire: str = "fp32", block_size: int = DEFAULT_BLOCK_SIZE,
                 bucket_cap_mb: float | None = None, backup_device: str | torch.device = "cpu",
                 init_sync: bool = True, membership: Any = None) -> None:
        # ---- local validation (identical on every rank, before any collective)
        if not isinstance(model, nn.Module):
            raise TypeError(f"diloco model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"diloco inner_optimizer must be a torch.optim.Optimizer, got "
                            f"{type(inner_optimizer).__name__}")
        self.frags: list[Fragment] = split_fragments(model, fragments)
        n = len(self.frags)
        self.schedule = ScheduleConfig(n, sync_every, delay)
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"diloco alpha={alpha!r} is not in [0, 1]")
        self.alpha = float(alpha)
        if wire not in CODECS:
            raise ValueError(f"diloco wire={wire!r} is not supported; allowed: {list(CODECS)}")
        self.codec = get_codec(wire, block_size)
        cap = bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int | float) or cap <= 0):
            raise ValueError(f"diloco bucket_cap_mb={bucket_cap_mb!r} must be a positive number or None")
        if outer_optimizer is None:
            factories: list[OuterOptimizerFactory] = [default_outer_optimizer] * n
        elif callable(outer_optimizer):
            factories = [outer_optimizer] * n
        elif isinstance(outer_optimizer, Sequence):
            if len(outer_optimizer) != n:
                raise ValueError(f"diloco outer_optimizer: got a list of {len(outer_optimizer)}, expected "
                                 f"one per fragment ({n})")
            if not all(callable(f) for f in outer_optimizer):
                raise TypeError("diloco outer_optimizer list entries must be callables params -> Optimizer")
            factories = list(outer_optimizer)
        else:
            raise TypeError("diloco outer_optimizer must be None, a callable params -> Optimizer, or a list "
                            f"of them, got {type(outer_optimizer).__name__}")
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.comm = comm if comm is not None else Comm(name="replica")
        self.membership = membership if membership is not None else StaticMembership(self.comm)
        self.backup_device = torch.device(backup_device)
        self.buffer_dtypes = [torch.float64 if any(p.dtype == torch.float64 for p in f.params)
                              else torch.float32 for f in self.frags]
        self.bucket_cap_elems: list[int | None] = [
            None if bucket_cap_mb is None else max(1, int(bucket_cap_mb * 2**20) // (8 if dt == torch.float64
                                                                                        else 4))
            for dt in self.buffer_dtypes]

        # ---- cross-replica checks and initial sync (collectives, every rank alike)
        schedule = (sync_every, delay) if getattr(self.membership, "uniform_schedule", True) else ()
        signature = (n, *schedule, self.alpha, wire, self.codec.block_size, bucket_cap_mb,
                     [[tuple(p.shape) for p in f.params] for f in self.frags],
                     [[str(p.dtype) for p in f.params] for f in self.frags])
        self.comm.agree(signature, "diloco settings and fragment shapes")
        if init_sync and self.comm.size > 1:
            with torch.no_grad():
                for f in self.frags:
                    for p in f.params:
                        self.comm.broadcast(p.data, src=0, tag="diloco:init")

        # ---- state: global copies and per-fragment outer optimizers on the backup device
        pin = self.backup_device.type == "cpu" and torch.cuda.is_available() and any(
            p.is_cuda for f in self.frags for p in f.params)
        self.globals: list[list[torch.Tensor]] = []
        for f in self.frags:
            copies = []
            for p in f.params:
                c = p.detach().to(self.backup_device, copy=True)
                if pin:
                    c = c.pin_memory()
                copies.append(c)
            self.globals.append(copies)
        self.outer: list[torch.optim.Optimizer] = [fac(g) for fac, g in zip(factories, self.globals,
                                                                           strict=True)]
        self.committed = 0
        self.local_step = 0
        self._inflight: _InFlight | None = None
        self._on_sync: list[Callable[[StreamingDiLoCo, int], None]] = []
        self._on_attempt: list[Callable[[StreamingDiLoCo, int, bool], None]] = []
        self.membership.attach(self)
        self._hooks = [inner_optimizer.register_step_post_hook(self._post_step)]
        if hasattr(self.membership, "before_step"):
            self._hooks.append(inner_optimizer.register_step_pre_hook(
                lambda *_: self.membership.before_step()))

    # ------------------------------------------------------------------------------ properties
    @property
    def num_fragments(self) -> int:
        return len(self.frags)

    @property
    def sync_every(self) -> int:
        return self.schedule.sync_every

    @property
    def delay(self) -> int:
        return self.schedule.delay

    def add_sync_callback(self, fn: Callable[[StreamingDiLoCo, int], None]) -> None:
        """Call ``fn(self, fragment)`` after every committed sync (tests, logging)."""
        self._on_sync.append(fn)

    def add_attempt_callback(self, fn: Callable[[StreamingDiLoCo, int, bool], None]) -> None:
        """Call ``fn(self, fragment, committed_ok)`` after every sync attempt, committed or not."""
        self._on_attempt.append(fn)

    # -------------------------------------------------------------------------------- the hook
    def _post_step(self, _opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if hasattr(self.membership, "after_step"):
            self.membership.after_step()
        self.local_step += 1
        actions = actions_at(self.local_step, self.schedule)
        if self._inflight is not None and not actions:
            for h in self._inflight.handles:  # same order on every rank
                if not h.poll():
                    break
        for action in actions:
            if action == PREPARE:
                self._prepare()
            elif action == SYNC:
                self._sync()
                self.local_step = 0

    def _prepare(self) -> None:
        self.membership.start_quorum(self)  # may heal this replica and move self.committed
        i = fragment_for(self.committed, self.num_fragments)
        frag = self.frags[i]
        device = frag.params[0].device
        flat = torch.empty(frag.numel, dtype=self.buffer_dtypes[i], device=device)
        pseudo_gradient_into(flat, self.globals[i], frag.params)
        handles = [self.membership.all_reduce(flat[s:e], self.codec, f"diloco:frag{i}")
                   for s, e in _bucket_bounds(flat.numel(), self.bucket_cap_elems[i])]
        self._inflight = _InFlight(i, flat, handles)

    def _sync(self) -> None:
        inflight = self._inflight
        i = fragment_for(self.committed, self.num_fragments)
        if inflight is None or inflight.fragment != i:
            raise RuntimeError(f"diloco: sync of fragment {i} without a matching prepare")
        for h in inflight.handles:
            h.wait()
        self._inflight = None
        if not self.membership.should_commit():
            with torch.no_grad():  # roll back to the last agreed weights; the same fragment retries
                for p, g in zip(self.frags[i].params, self.globals[i], strict=True):
                    p.copy_(g)
            for fn in self._on_attempt:
                fn(self, i, False)
            return
        outer_step(self.outer[i], self.globals[i], inflight.flat)
        merge_(self.frags[i].params, self.globals[i], self.alpha)
        self.committed += 1
        for fn in self._on_attempt:
            fn(self, i, True)
        for fn in self._on_sync:
            fn(self, i)

    # ------------------------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:
        """Counters, global copies and outer optimizer states (not the model or inner optimizer).

        Raises:
            RuntimeError: while a fragment's all-reduce is in flight (between prepare and sync).
        """
        if self._inflight is not None:
            raise RuntimeError("diloco state_dict: fragment "
                               f"{self._inflight.fragment} is in flight (local_step={self.local_step}); "
                               "take the state at a local step before prepare or right after a sync")
        return {"committed": self.committed, "local_step": self.local_step,
                "globals": [[g.detach().clone() for g in gs] for gs in self.globals],
                "outer": [o.state_dict() for o in self.outer]}

    def outer_state(self) -> dict[str, Any]:
        """Global copies and outer optimizer states only (what a healing replica copies)."""
        return {"globals": [[g.detach().clone() for g in gs] for gs in self.globals],
                "outer": [o.state_dict() for o in self.outer]}

    def load_outer_state(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for gs, saved in zip(self.globals, state["globals"], strict=True):
                for g, s in zip(gs, saved, strict=True):
                    g.copy_(s)
        for o, s in zip(self.outer, state["outer"], strict=True):
            o.load_state_dict(s)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["globals"]) != self.num_fragments:
            raise ValueError(f"diloco load_state_dict: {len(state['globals'])} fragments in the state, "
                             f"{self.num_fragments} here")
        with torch.no_grad():
            for gs, saved in zip(self.globals, state["globals"], strict=True):
                for g, s in zip(gs, saved, strict=True):
                    g.copy_(s)
        for o, s in zip(self.outer, state["outer"], strict=True):
            o.load_state_dict(s)
        self.committed = int(state["committed"])
        self.local_step = int(state["local_step"])
        self._inflight = None

    # --------------------------------------------------------------------------------- cleanup
    def close(self) -> None:
        """Remove the hook (an in-flight all-reduce is waited for and dropped)."""
        if self._inflight is not None:
            for h in self._inflight.handles:
                h.wait()
            self._inflight = None
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self) -> StreamingDiLoCo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
