"""`Comm`: the one door through which every lowband collective passes.

A :class:`Comm` wraps one process group. Each call records a :class:`CommRecord` in a
:class:`CommLedger` (op, group, size, elements, wire dtype, ring-model wire bytes, elapsed time) and
chooses an algorithm per backend:

========================  =============================  ===================================
op                        gloo (CPU tensors)             NCCL (CUDA tensors)
========================  =============================  ===================================
reduce_scatter            all_to_all + local sum;        native (all_to_all + sum if the
                          sharded optimizer: ring from   wire dtype is narrower than fp32)
                          3 ranks (fp32/fp64 wire, chunk
                          >= 8192), else p2p + sum
all_gather                native (< 4 MiB) or one async  native
                          broadcast per rank; sharded
                          optimizer: ring from 3 ranks
                          (chunk >= 8192), else p2p
all_reduce                native (wire = tensor dtype);  same
                          RS(all_to_all)+AG for a bf16
                          wire, or a bf16/fp16 sum from
                          3 ranks
all_to_all                native; sharded optimizer: p2p native
broadcast                 native                         native
========================  =============================  ===================================

Why: gloo emulates ``reduce_scatter_tensor`` with an all-reduce (2x the bytes); its
``all_to_all_single`` and ``all_gather_into_tensor`` post each send before the matching receive, and a
gloo send waits for the peer's "ready to receive" notice, which travels on the same TCP stream as the
peer's own data: when one rank is a moment late, its notice queues behind its whole message and the two
directions of every link run one after the other (on a bandwidth-bound link the collective then takes up
to twice its bytes' time). lowband's point-to-point exchange (``p2p``) posts every ``irecv`` first, then
every ``isend`` (one tag per exchange), so both directions always run at once (:meth:`Comm._p2p_exchange`);
``python -m lowband.bench link`` measures it. From three ranks the sharded optimizer's reduce-scatter
(fp32/fp64 wire) and all-gather of chunks of ``RING_MIN_CHUNK`` elements or more run as a pipelined ring
instead (``ring``, :mod:`lowband.comm.ring`): one TCP flow per direction of every link, where the
all-peers exchange made ``N - 1`` flows meet in every rank's link (at 4 ranks on a 10 Mbit/s link the
sharded optimizer's step was 1.07x DDP's with it, 1.32x without, docs/PERFORMANCE.md). Both are the default of
the sharded optimizer's private ``Comm`` (``P2P_PURPOSES``), where they were measured; other components
keep gloo's collectives until they are measured and tested with them (GTP's tests timed out in three runs on
a heavily loaded machine with ``p2p``, not yet understood). A group torch.distributed did not create (a
torchft-managed one) never uses either. An exchange
nobody waited for is finished before its group is destroyed (:func:`drain_exchanges`), as gloo finishes a
queued collective. Override per op with ``Comm(algorithms={"reduce_scatter": "p2p", "all_gather": "native"})``
(allowed values: ``ALGORITHMS``); gloo's all-gather is one async broadcast per rank from 4 MiB up (faster
than ``all_gather_into_tensor`` there, ``python -m lowband.bench comm``).

Precision: a wire dtype narrower than the tensor (bf16) is used only for the bytes on the wire; every
reduction is accumulated in fp32 (fp64 for fp64 tensors), in rank order (the ``ring`` reduce-scatter: in
ring order, chunk ``c`` from rank ``c + 1`` around to ``c``, :func:`lowband.comm.ring.ring_order_sum`;
:meth:`Comm.reduce_scatter_algorithm` says which), so all ranks get identical results and a
single-process reference can reproduce them exactly.

Every op returns a :class:`CommHandle`; with ``async_op=False`` it is already complete.

``torch.compile``: every collective entry point (and :meth:`CommHandle.wait`) is
``torch.compiler.disable``-d: dynamo never traces into a collective or the ledger (whose records,
clocks and locks would otherwise be guarded on and traced every step, recompiling each time); a
``Comm`` call inside compiled code is a graph break and runs eagerly, exactly as without compile.

Private communicators: every lowband component (GTP runtime, sharded optimizer, TP layers, TP
REKLS, GTP Muon, DiLoCo) runs its collectives on its own process group, derived from the user's
group with :meth:`Comm.private` (same members in the same rank order, same ledger name, ledger and
algorithms). Collectives on different process groups never pair with each other, so a collective the
user issues on their own group (a ``dist.barrier()`` on the default group while rank 0 evaluates, a
metrics ``all_reduce`` between forward and backward) can no longer be matched with a lowband gather
or reduce-scatter that happens to be in flight: a rank-divergent program then ends with a timeout
error naming the lowband operation instead of a silent mispairing or a hang.

Cost: one extra process group per component kind and parent group (memoized: every TP layer built
on one TP ``Comm`` shares the one ``"tp"`` group), created once at construction with
``torch.distributed.new_group(ranks, timeout, use_local_synchronization=True)``, so only the
members call it (a GTP or DP subgroup of a bigger world is created on its members alone) and only
they wait for each other. Creating it is a store rendezvous plus, on gloo, a full TCP mesh between
the members (N-1 connections and the backend's worker threads per rank: milliseconds on one host);
on NCCL the communicator is built lazily at its first collective (``ncclCommInitRank``: typically
tens to hundreds of milliseconds, and NCCL's per-communicator device buffers, a few MiB per peer
channel) and its collectives run on their own CUDA stream. A ``Comm`` of one rank (or without
``torch.distributed``) is its own private ``Comm``: nothing is created. The private group inherits
the parent's timeout (``Comm.private(purpose, timeout=...)`` overrides it), so a rank-divergent
collective fails within the same time the user chose for their group.

Creation order: torch names a locally synchronized group from its ranks and the number of process
groups this rank has created so far; members must therefore create their groups (torch's, and
lowband components) in the same order, as every SPMD program does. If they do not, creation times
out with an error that says so.
"""

from __future__ import annotations

import atexit
import functools
import math
import pickle
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lowband.comm.ledger import CommLedger, CommRecord, default_ledger, dtype_name, ring_wire_bytes
from lowband.comm.opaque import opaque
from lowband.comm.ring import RING_MIN_CHUNK, RingWork, ring_all_gather, ring_reduce_scatter, ring_tags, worker_for

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "reduce_scatter": ("native", "alltoall", "p2p", "ring"),
    "all_gather": ("native", "broadcast", "p2p", "ring"),
    "all_reduce": ("native", "rs+ag"),
    "all_to_all": ("native", "p2p"),
}
_P2P_TAGS = 1 << 30  # gloo point-to-point tags are non-negative int32: the sequence wraps here
P2P_PURPOSES = ("sharded", "sharded-p2p")
"""Private ``Comm`` purposes whose gloo reduce-scatter, all-gather and all-to-all default to ``p2p`` (see the module
docstring); every other ``Comm`` keeps gloo's collectives unless ``algorithms`` asks for ``p2p`` or ``ring``."""
RING_PURPOSES = ("sharded",)
"""Private ``Comm`` purposes whose gloo reduce-scatter (fp32/fp64 wire) and all-gather default to ``ring`` from three
ranks and ``RING_MIN_CHUNK`` elements per chunk (the sharded optimizer's ``exchange="ring"``; ``"sharded-p2p"`` is
its ``exchange="p2p"``)."""
REDUCE_OPS = ("sum", "avg", "max", "min")
_FLOAT_WIRE = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class CommHandle:
    """Completion handle of one collective.

    ``wait()`` blocks until the data is in place (running any local post-processing such as the
    reduce-scatter's local sum), fills the ledger record's ``elapsed_s`` and returns the output
    tensor. Calling it again is a no-op.
    """

    def __init__(self, record: CommRecord, works: Sequence[dist.Work], t0: float,
                 finish: Callable[[], None] | None, result: torch.Tensor | None,
                 finish_issues_collectives: bool = False, timeout: timedelta | None = None) -> None:
        self.record = record
        self._works = list(works)
        # point-to-point works (gloo isend/irecv) wait forever unless given one: the group's timeout
        self._timeout = timeout
        self._group: dist.ProcessGroup | None = None
        self._t0 = t0
        self._finish = finish
        self._result = result
        self._done = False
        self._lock = threading.Lock()
        self._chained = finish_issues_collectives

    @opaque
    def wait(self) -> torch.Tensor | None:
        if not self._done:
            for w in self._works:
                if self._timeout is None:
                    w.wait()
                elif not w.wait(self._timeout):
                    raise RuntimeError(f"lowband {self.record.op} (tag {self.record.tag!r}, group "
                                       f"{self.record.group!r}) timed out after {self._timeout}")
            self._complete()
        return self._result

    def _complete(self) -> None:
        with self._lock:
            if self._done:
                return
            if self._finish is not None:
                self._finish()
            self._done = True
            self.record.elapsed_s = time.perf_counter() - self._t0
            self._works = []
        _IN_FLIGHT.pop(id(self), None)

    def is_completed(self) -> bool:
        """Whether the result is in place (so :meth:`wait` returns at once). When the transfers are done, the
        local post-processing (a reduce-scatter's sum, an average's division) runs here; a handle whose
        post-processing issues collectives of its own (the two-phase all-reduce) completes only in
        :meth:`wait`, so this stays ``False`` until then."""
        if self._done:
            return True
        if self._chained or not all(w.is_completed() for w in self._works):
            return False
        self._complete()
        return True

    def future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` resolving to the result (for DDP communication hooks).

        The post-processing runs in the future's callback (on the backend's thread), never
        ``Work.wait()`` there: waiting on a work from its own completion callback deadlocks. A handle
        whose post-processing issues further collectives (the two-phase narrow-wire all-reduce) is
        completed here, on the caller's thread, and returns an already completed future.
        """
        if not self._done and len(self._works) == 1 and not self._chained:
            def on_done(_fut: torch.futures.Future) -> torch.Tensor | None:
                self._complete()
                return self._result

            return self._works[0].get_future().then(on_done)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.wait())
        return fut


def _check_float_wire(wire: torch.dtype, tensor: torch.Tensor, what: str) -> None:
    if wire != tensor.dtype and (wire not in _FLOAT_WIRE or not tensor.is_floating_point()):
        raise ValueError(f"{what}: wire_dtype {wire} is not allowed for a {tensor.dtype} tensor; "
                         "use the tensor's own dtype, or bfloat16/float16/float32 for float tensors")


def true_div(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """``t / divisor`` with IEEE division on every device.

    CUDA's division kernel multiplies by the reciprocal of a Python-number divisor, which rounds differently
    from a true division whenever ``1 / divisor`` is inexact (``/ 3``, ``/ 127``, ``/ 448``); dividing by a
    tensor of the same device takes the true-division kernel there too, so a CUDA rank computes the bits a CPU
    rank (and a CPU reference) computes. On CPU the result equals ``t / divisor`` exactly.
    """
    return torch.div(t, torch.full((), divisor, dtype=t.dtype, device=t.device))


def avg_divisor(op: str, avg_over: int | None, n: int, what: str) -> int | None:
    """What ``op`` divides the sum by: ``None`` for ``"sum"``, else ``avg_over`` (1..N) or ``N``."""
    if avg_over is not None:
        if op != "avg" or isinstance(avg_over, bool) or not isinstance(avg_over, int) or not 1 <= avg_over <= n:
            raise ValueError(f"{what}: avg_over={avg_over!r} needs op='avg' and 1 <= avg_over <= {n} (the ranks)")
        return avg_over
    return n if op == "avg" else None


def true_div_(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """In-place :func:`true_div`."""
    return t.div_(torch.full((), divisor, dtype=t.dtype, device=t.device))


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite (no inf, no NaN); integer and bool tensors always are.

    Exact, and about 30x cheaper than ``torch.isfinite(t).all()`` on a CPU core for large tensors (one
    reduction instead of a boolean mask): a floating-point sum that comes out finite has only finite summands,
    whatever the order (an inf or NaN summand makes every partial sum that holds it inf or NaN, and inf + -inf
    is NaN). Only a sum that is not finite (a non-finite element, or an overflow of the sum itself) is checked
    element by element. Half-precision tensors are summed in float32, so their sum does not overflow first.
    Reads back one scalar (a device synchronization on CUDA, as ``bool(torch.isfinite(t).all())`` does)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    acc = torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else None
    if math.isfinite(float(t.sum(dtype=acc))):
        return True
    return bool(torch.isfinite(t).all())


def finite_probe(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim tensor on ``t``'s device that is finite exactly when every element of ``t`` is, computed
    without a host synchronization (for flags that travel in a collective while a CUDA stream runs on).

    On CPU it is ``(t - t).sum()``: ``x - x`` is +0 for every finite ``x`` and NaN for inf or NaN, and a sum of
    zeros cannot overflow, so the result is 0 or NaN; one subtraction and one sum, about 16x cheaper on a CPU
    core than the infinity norm (it allocates one temporary of ``t``'s size). Elsewhere it is
    ``torch.linalg.vector_norm(t, inf)`` (no temporary; fast on GPUs). Integer and bool tensors give 0."""
    if not t.is_floating_point():
        return torch.zeros((), device=t.device)
    if t.device.type == "cpu":
        return (t - t).sum()
    return torch.linalg.vector_norm(t, math.inf)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype == torch.float64:
        return torch.float64
    if dtype.is_floating_point:
        return torch.float32
    return dtype


class _Workspace:
    """Free lists of scratch buffers keyed by (numel, dtype, device).

    Receive buffers of the all-to-all reduce-scatter are reused instead of freshly allocated: on CPU
    a fresh large allocation is an mmap whose first touch page-faults, which costs as much as the
    transfer. A buffer is checked out until the handle's ``wait()`` finishes with it.
    """

    def __init__(self, max_cached_bytes: int = 1 << 30) -> None:
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._cached_bytes = 0
        self.max_cached_bytes = max_cached_bytes

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free.get((numel, dtype, device))
        if free:
            t = free.pop()
            self._cached_bytes -= t.numel() * t.element_size()
            return t
        return torch.empty(numel, dtype=dtype, device=device)

    def release(self, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self._cached_bytes + nbytes > self.max_cached_bytes:
            return
        self._free.setdefault((t.numel(), t.dtype, t.device), []).append(t)
        self._cached_bytes += nbytes


class Comm:
    """Collectives over one process group, each recorded in a :class:`CommLedger`.

    Args:
        group: the process group; ``None`` means the default (world) group, or a single-process
            stand-in when ``torch.distributed`` is not initialized.
        name: the group's name in ledger records (``"world"``, ``"dp"``, ``"tp"``, ...).
        ledger: where records go; defaults to the process-wide :func:`default_ledger`.
        algorithms: per-op algorithm override, e.g. ``{"reduce_scatter": "native"}``; see
            ``ALGORITHMS`` for the allowed values.

    Components derive their own communicator with :meth:`private` (one extra process group per
    component kind per parent group, created once among the members; see the module docstring
    for the cost), so their collectives never pair with the user's collectives on ``group``.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, name: str = "world",
                 ledger: CommLedger | None = None,
                 algorithms: Mapping[str, str] | None = None) -> None:
        self.group = group
        self.name = name
        self.ledger = ledger if ledger is not None else default_ledger()
        self.algorithms = dict(algorithms or {})
        self.workspace = _Workspace()
        self.parent: Comm | None = None  # the user's Comm this private Comm was derived from
        self.purpose: str | None = None  # the component a private Comm belongs to
        self._privates: dict[tuple[str, timedelta | None], Comm] = {}
        # gloo all-gather: N broadcasts beat all_gather_into_tensor from a few MiB up (bench comm); below,
        # the native call has less per-call overhead.
        self.gloo_broadcast_gather_min_bytes = 4 << 20
        self._p2p_seq = 0  # tag of the next point-to-point exchange (every rank counts its exchanges alike)
        self.point_to_point = False  # p2p as the gloo default (private Comms of P2P_PURPOSES)
        self.ring_default = False  # ring as the gloo default from 3 ranks (private Comms of RING_PURPOSES)
        for op, algo in self.algorithms.items():
            if op not in ALGORITHMS or algo not in ALGORITHMS[op]:
                allowed = {k: list(v) for k, v in ALGORITHMS.items()}
                raise ValueError(f"Comm algorithms: {op}={algo!r} is not allowed; allowed: {allowed}")
        if dist.is_available() and dist.is_initialized():
            self.size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
            if self.rank < 0:
                raise ValueError(f"Comm {name!r}: this process is not a member of the group")
            backend = str(dist.get_backend(group))
            self.backends = backend
        else:
            if group is not None:
                raise ValueError(f"Comm {name!r}: a group was given but torch.distributed is not "
                                 "initialized")
            self.size, self.rank, self.backends = 1, 0, "local"

    def __repr__(self) -> str:
        return f"Comm(name={self.name!r}, rank={self.rank}, size={self.size}, backend={self.backends!r})"

    def __copy__(self) -> Comm:
        return self

    def __deepcopy__(self, memo: dict) -> Comm:
        """A ``Comm`` is a handle to a process group: copies of a model that holds one (an EMA copy of a
        tensor-parallel model: ``copy.deepcopy(model)``) share it, so the copy's layers communicate over
        the same group (every rank of it must run the copy, as for the original)."""
        memo[id(self)] = self
        return self

    def __reduce__(self) -> tuple:
        raise TypeError(f"lowband.comm.Comm {self.name!r} is a handle to a process group and cannot be pickled "
                        "(e.g. torch.save(model) of a model holding tensor-parallel or GTP layers); save "
                        "state_dict()s instead (lowband.parallel.unsharded_copy(model).state_dict() for a plain "
                        "model)")

    # ---------------------------------------------------------------------------- private groups
    @property
    def timeout(self) -> timedelta | None:
        """The process-group timeout of this group (``None`` for a local ``Comm``)."""
        if self.backends == "local":
            return None
        return group_timeout(self.group)

    def private(self, purpose: str, *, timeout: timedelta | None = None) -> Comm:
        """A ``Comm`` on a process group of its own, with this group's members, for one component.

        The private ``Comm`` has the same members in the same rank order, the same ledger ``name``
        (so ledger counts and bytes are recorded as before), the same ledger and algorithm
        overrides. Collectives on it can never pair with collectives the user issues on this
        group (see the module docstring for why and what it costs).

        Collective over this group's members only (``use_local_synchronization=True``): every
        member must call it, in the same order relative to its other process-group creations;
        non-members need not. Memoized per ``(purpose, timeout)`` on the user's ``Comm``: asking
        again (also on a private ``Comm`` derived from it) returns the same object without
        communicating. A ``Comm`` of one rank returns itself, and so does one whose group
        ``torch.distributed`` did not create (a torchft-managed group: its members are not known
        to ``new_group``).

        Args:
            purpose: the component (``"gtp"``, ``"sharded"``, ``"tp"``, ``"tp_rekls"``,
                ``"gtp_muon"``, ``"diloco"`` ...); part of the group's description.
            timeout: process-group timeout of the new group (default: this group's own timeout).

        Raises:
            ValueError: an empty ``purpose``.
            RuntimeError: the group could not be created (naming the parent group and purpose).
        """
        if not isinstance(purpose, str) or not purpose:
            raise ValueError(f"Comm.private: purpose must be a non-empty str, got {purpose!r}")
        if self.size == 1 or self.backends == "local":
            return self
        if self.group is not None and self.group not in dist.distributed_c10d._world.pg_group_ranks:
            return self  # a group torch.distributed did not create (e.g. torchft's): no ranks to derive from
        root = self.parent if self.parent is not None else self
        if self.purpose == purpose and timeout is None:
            return self
        key = (purpose, timeout)
        found = root._privates.get(key)
        if found is not None:
            return found
        ranks = [root.global_rank(r) for r in range(root.size)]
        parent_timeout = root.timeout
        use = timeout if timeout is not None else parent_timeout
        try:
            pg = dist.new_group(ranks, timeout=use, use_local_synchronization=True, sort_ranks=False,
                                group_desc=f"lowband:{root.name}:{purpose}")
        except Exception as e:  # re-raised with the group and purpose named
            raise RuntimeError(
                f"Comm {root.name!r}: creating lowband's private process group for {purpose!r} over ranks "
                f"{ranks} failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Every "
                "member must build lowband components (and any torch.distributed.new_group) in the same "
                "order") from e
        priv = Comm(pg, name=root.name, ledger=root.ledger, algorithms=root.algorithms)
        priv.gloo_broadcast_gather_min_bytes = root.gloo_broadcast_gather_min_bytes
        priv.parent, priv.purpose = root, purpose
        priv.point_to_point = purpose in P2P_PURPOSES
        priv.ring_default = purpose in RING_PURPOSES
        if priv.rank != root.rank or priv.size != root.size:
            raise RuntimeError(f"Comm {root.name!r}: private group for {purpose!r} has rank {priv.rank} of "
                               f"{priv.size}, expected {root.rank} of {root.size}")
        root._privates[key] = priv
        return priv

    # ----------------------------------------------------------------------------------- helpers
    def global_rank(self, group_rank: int) -> int:
        """Global rank of ``group_rank`` in this group."""
        if self.size == 1 and self.backends == "local":
            return 0
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def _is_nccl(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda and "nccl" in self.backends

    def _algo(self, op: str, default: str) -> str:
        return self.algorithms.get(op, default)

    def _p2p_ok(self, tensor: torch.Tensor) -> bool:
        """Whether ``p2p`` is the default here: a ``Comm`` with ``point_to_point`` set, CPU tensors on a gloo
        group torch.distributed created (a torchft-managed group keeps the native collectives: its
        point-to-point support is its own)."""
        return self.point_to_point and self._torch_gloo_cpu(tensor)

    def _torch_gloo_cpu(self, tensor: torch.Tensor) -> bool:
        """CPU tensors on a gloo group torch.distributed created: where lowband's point-to-point algorithms run."""
        return (not tensor.is_cuda and self.backends == "gloo"
                and (self.group is None or self.group in dist.distributed_c10d._world.pg_group_ranks))

    def _ring_ok(self, tensor: torch.Tensor) -> bool:
        """Whether the ring (:mod:`lowband.comm.ring`) can run here: :meth:`_torch_gloo_cpu`, three ranks or more
        (at two ranks the ring is the ``p2p`` exchange)."""
        return self.size > 2 and self._torch_gloo_cpu(tensor)

    def _ring_default(self, tensor: torch.Tensor, chunk_numel: int) -> bool:
        """Whether the ring is the default here: a ``Comm`` with ``ring_default`` set where :meth:`_ring_ok`, and a
        chunk of ``RING_MIN_CHUNK`` elements or more. A smaller one goes as one ``p2p`` exchange, posted at once
        beside whatever is in flight, instead of ``N - 1`` latency-bound ring steps queued behind the ring
        thread's big transfers."""
        return self.ring_default and self._ring_ok(tensor) and chunk_numel >= RING_MIN_CHUNK

    def _ring_tags(self, chunk_numel: int) -> int:
        """First tag of a block of :func:`lowband.comm.ring.ring_tags` tags (every rank allocates alike)."""
        count = ring_tags(self.size, chunk_numel)
        if self._p2p_seq + count > _P2P_TAGS:
            self._p2p_seq = 0
        tag0 = self._p2p_seq
        self._p2p_seq += count
        return tag0

    def _ring_handle(self, rec: CommRecord, run: Callable[[int, str], None], chunk_numel: int, t0: float,
                     finish: Callable[[], None] | None, output: torch.Tensor) -> CommHandle:
        """Queue ``run(tag0, what)`` on this group's ring thread (``what`` names the operation in its
        errors); the handle waits for it, tracked like an exchange so a teardown finishes it first."""
        tag0 = self._ring_tags(chunk_numel)
        what = f"{rec.op} (tag {rec.tag!r}, group {rec.group!r}, ring)"
        work = worker_for(self.group, self.name).submit(RingWork(what, lambda: run(tag0, what)))
        return _track(CommHandle(rec, [work], t0, finish, output), self.group)

    def _p2p_exchange(self, recvs: Sequence[torch.Tensor | None],
                      sends: Sequence[torch.Tensor | None]) -> list[dist.Work]:
        """Post ``irecv(recvs[p])`` from every peer ``p`` first, then ``isend(sends[p])`` to every peer.

        Why receives first: gloo starts a send only when the peer's "ready to receive" notice arrived, and
        that notice travels on the same TCP stream as the peer's own data. gloo's ``all_to_all_single`` and
        ``all_gather_into_tensor`` post each send before the matching receive, so a peer that is a moment
        late queues its notice behind its whole outgoing message and the two directions of a link run one
        after the other (measured on a 10 Mbit/s shaped link, 2 ranks, 221 kB each way: 0.19 s or 0.36 s,
        depending on the ranks' timing). With every receive posted before any send, each notice leaves
        before any data and both directions always run at once. One tag per exchange (a sequence every
        rank advances alike), so exchanges in flight together never pair with each other."""
        tag = self._p2p_seq % _P2P_TAGS
        self._p2p_seq += 1
        n, me = self.size, self.rank
        works = []
        for i in range(1, n):
            src = (me - i) % n
            if recvs[src] is not None and recvs[src].numel():
                works.append(dist.irecv(recvs[src], group=self.group, group_src=src, tag=tag))
        for i in range(1, n):
            dst = (me + i) % n
            if sends[dst] is not None and sends[dst].numel():
                works.append(dist.isend(sends[dst], group=self.group, group_dst=dst, tag=tag))
        return works

    def _p2p_handle(self, rec: CommRecord, works: list[dist.Work], t0: float, finish: Callable[[], None] | None,
                    output: torch.Tensor) -> CommHandle:
        """The handle of one :meth:`_p2p_exchange`: its waits honour the group's timeout (gloo's point-to-point
        waits have none of their own), and it is kept until waited for (:func:`drain_exchanges`)."""
        return _track(CommHandle(rec, works, t0, finish, output, timeout=self.timeout), self.group)

    def _record(self, op: str, numel: int, wire: torch.dtype, wire_bytes: int, algorithm: str,
                tag: str, async_op: bool) -> CommRecord:
        return self.ledger.add(CommRecord(op=op, group=self.name, group_size=self.size, numel=numel,
                                          wire_dtype=dtype_name(wire), wire_bytes=wire_bytes,
                                          algorithm=algorithm, tag=tag, async_op=async_op))

    @staticmethod
    def _finish_handle(handle: CommHandle, async_op: bool) -> CommHandle:
        if not async_op:
            handle.wait()
        return handle

    # ------------------------------------------------------------------------------- all_reduce
    @opaque
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, wire_dtype: torch.dtype | None = None,
                   async_op: bool = False, tag: str = "") -> CommHandle:
        """Reduce ``tensor`` in place over the group (``sum``, ``avg``, ``max`` or ``min``).

        With a wire dtype narrower than the tensor (bf16), and for a bf16/fp16 tensor summed or averaged
        over 3 or more ranks, runs as reduce-scatter (fp32 local sum, in rank order) plus all-gather of the
        reduced chunks, both on the wire dtype; bytes are counted on the buffer padded to a multiple of N.
        (The backend's own all-reduce of a bf16/fp16 tensor rounds every partial sum to that dtype; with two
        ranks there is one addition, rounded once either way, so it stays native.) ``max`` / ``min`` are the
        backend's: a NaN on one rank may be dropped (gloo's comparison), so reduce flags, not raw values, when
        non-finite values must survive.
        """
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce: op {op!r} not in {REDUCE_OPS}")
        wire = wire_dtype or tensor.dtype
        _check_float_wire(wire, tensor, "all_reduce")
        t0 = time.perf_counter()
        n = self.size
        esize = torch.empty((), dtype=wire).element_size()
        if n == 1:
            rec = self._record("all_reduce", tensor.numel(), wire, 0, "local", tag, async_op)
            if wire != tensor.dtype:  # same rounding as on the wire, so numerics don't depend on N
                tensor.copy_(tensor.to(wire))
            return self._finish_handle(CommHandle(rec, [], t0, None, tensor), async_op)
        narrow_sum = op in ("sum", "avg") and _acc_dtype(wire) != wire and n > 2
        if wire == tensor.dtype and not narrow_sum:
            algo = "native"
            rec = self._record("all_reduce", tensor.numel(), wire,
                               ring_wire_bytes("all_reduce", n, tensor.numel() * esize), algo, tag,
                               async_op)
            dop = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                   "min": dist.ReduceOp.MIN}[op]
            work = dist.all_reduce(tensor, op=dop, group=self.group, async_op=True)
            finish = (lambda: true_div_(tensor, n)) if op == "avg" else None
            return self._finish_handle(CommHandle(rec, [work], t0, finish, tensor), async_op)
        if op not in ("sum", "avg"):
            raise ValueError(f"all_reduce: op {op!r} needs wire_dtype equal to the tensor dtype")
        # Two-phase: RS with local high-precision sum, then AG of the reduced chunk, narrow wire.
        flat = tensor.reshape(-1)
        chunk = -(-flat.numel() // n)
        padded = torch.zeros(chunk * n, dtype=wire, device=tensor.device)
        padded[: flat.numel()].copy_(flat)
        recv = torch.empty_like(padded)
        rec = self._record("all_reduce", tensor.numel(), wire,
                           ring_wire_bytes("all_reduce", n, padded.numel() * esize), "rs+ag", tag,
                           async_op)
        work = dist.all_to_all_single(recv, padded, group=self.group, async_op=True)
        acc_dtype = _acc_dtype(tensor.dtype)

        def finish() -> None:
            parts = recv.view(n, chunk)
            acc = parts[0].to(acc_dtype)
            for i in range(1, n):
                acc.add_(parts[i])
            if op == "avg":
                true_div_(acc, n)
            gathered = torch.empty(chunk * n, dtype=wire, device=tensor.device)
            mine = acc.to(wire)
            works = [dist.broadcast(gathered[r * chunk:(r + 1) * chunk] if r != self.rank else mine,
                                    group=self.group, group_src=r, async_op=True) for r in range(n)]
            for w in works:
                w.wait()
            gathered[self.rank * chunk:(self.rank + 1) * chunk].copy_(mine)
            flat.copy_(gathered[: flat.numel()])
            if flat.data_ptr() != tensor.data_ptr():
                tensor.copy_(flat.view_as(tensor))

        return self._finish_handle(CommHandle(rec, [work], t0, finish, tensor, finish_issues_collectives=True),
                                   async_op)

    # --------------------------------------------------------------------------- reduce_scatter
    @opaque
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", *,
                       wire_dtype: torch.dtype | None = None, async_op: bool = False,
                       tag: str = "") -> CommHandle:
        """``output`` (this rank's chunk) = reduction over ranks of chunk ``rank`` of ``input``.

        ``input`` holds N equal contiguous chunks (``input.numel() == N * output.numel()``). Only
        ``sum`` and ``avg``. The local sum runs in rank order in fp32 (fp64 for fp64 outputs).
        """
        if op not in ("sum", "avg"):
            raise ValueError(f"reduce_scatter: op {op!r} not in ('sum', 'avg')")
        n = self.size
        if input.numel() != n * output.numel():
            raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected "
                             f"{n} x {output.numel()} (group size x output)")
        if not (input.is_contiguous() and output.is_contiguous()):
            raise ValueError("reduce_scatter: input and output must be contiguous")
        wire = wire_dtype or input.dtype
        _check_float_wire(wire, input, "reduce_scatter")
        esize = torch.empty((), dtype=wire).element_size()
        t0 = time.perf_counter()
        if n == 1:
            rec = self._record("reduce_scatter", input.numel(), wire, 0, "local", tag, async_op)
            output.copy_(input.reshape(output.shape) if wire == input.dtype
                         else input.to(wire).reshape(output.shape))
            return self._finish_handle(CommHandle(rec, [], t0, None, output), async_op)
        nbytes = ring_wire_bytes("reduce_scatter", n, input.numel() * esize)
        acc_dtype = _acc_dtype(output.dtype)
        algo = self.reduce_scatter_algorithm(input, output, wire)
        if algo == "ring":
            rec = self._record("reduce_scatter", input.numel(), wire, nbytes, "ring", tag, async_op)
            flat_in, flat_out = input.reshape(-1), output.view(-1)
            group, rank, timeout = self.group, self.rank, self.timeout

            def run_ring(tag0: int, what: str) -> None:
                ring_reduce_scatter(group, rank, n, flat_out, flat_in, tag0, timeout, what)
                if op == "avg":
                    true_div_(flat_out, n)

            return self._finish_handle(self._ring_handle(rec, run_ring, output.numel(), t0, None, output),
                                       async_op)
        if algo == "native":
            rec = self._record("reduce_scatter", input.numel(), wire, nbytes, algo, tag, async_op)
            send = input if wire == input.dtype else input.to(wire)
            if wire == output.dtype:
                recv = output
            else:
                recv = torch.empty(output.shape, dtype=wire, device=output.device)
            fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            work = fn(recv.reshape(-1), send.reshape(-1), op=dist.ReduceOp.SUM, group=self.group,
                      async_op=True)

            def finish_native() -> None:
                if recv is not output:
                    output.copy_(recv)
                if op == "avg":
                    true_div_(output, n)

            return self._finish_handle(CommHandle(rec, [work], t0, finish_native, output), async_op)
        rec = self._record("reduce_scatter", input.numel(), wire, nbytes,
                           "p2p+sum" if algo == "p2p" else "alltoall+sum", tag, async_op)
        send = input.reshape(-1) if wire == input.dtype else input.reshape(-1).to(wire)
        recv = self.workspace.acquire(send.numel(), wire, send.device)
        m = output.numel()
        if algo == "p2p":
            me = self.rank
            recv[me * m:(me + 1) * m].copy_(send[me * m:(me + 1) * m])
            chunks = [recv[r * m:(r + 1) * m] for r in range(n)]
            works = self._p2p_exchange(chunks, [send[r * m:(r + 1) * m] for r in range(n)])
        else:
            works = [dist.all_to_all_single(recv, send, group=self.group, async_op=True)]

        def finish_a2a() -> None:
            parts = recv.view(n, m)
            out = output.view(-1)
            if output.dtype == acc_dtype:
                out.copy_(parts[0])
                acc = out
            else:
                acc = parts[0].to(acc_dtype)
            for i in range(1, n):
                acc.add_(parts[i])
            if op == "avg":
                true_div_(acc, n)
            if acc is not out:
                out.copy_(acc)
            self.workspace.release(recv)

        handle = (self._p2p_handle(rec, works, t0, finish_a2a, output) if algo == "p2p"
                  else CommHandle(rec, works, t0, finish_a2a, output))
        return self._finish_handle(handle, async_op)

    def reduce_scatter_algorithm(self, input: torch.Tensor, output: torch.Tensor,
                                 wire_dtype: torch.dtype | None = None) -> str:
        """The algorithm :meth:`reduce_scatter` runs for these tensors and wire dtype (``local`` on one rank).

        It decides the summation order: ``ring`` sums chunk ``c`` from rank ``c + 1`` around to ``c``
        (:func:`lowband.comm.ring.ring_order_sum`), ``p2p`` and ``alltoall`` in rank order, ``native`` as the
        backend does. :mod:`lowband.comm.sparse` follows it, so its row-sparse sums stay bitwise equal to the
        dense reduce-scatter."""
        if self.size == 1:
            return "local"
        wire = wire_dtype or input.dtype
        native_ok = self._is_nccl(input) and wire == input.dtype == output.dtype and (
            wire in (torch.float32, torch.float64) or not wire.is_floating_point)
        ring_ok = (self._ring_ok(input) and wire == input.dtype == output.dtype
                   and wire in (torch.float32, torch.float64))
        default = ("native" if native_ok else "ring" if ring_ok and self._ring_default(input, output.numel())
                   else "p2p" if self._p2p_ok(input) else "alltoall")
        algo = self._algo("reduce_scatter", default)
        if algo == "ring" and not ring_ok:
            algo = "p2p"  # the ring sums fp32/fp64 of one dtype on gloo CPU groups of 3+ ranks only
        return algo

    # ------------------------------------------------------------------------------- all_gather
    @opaque
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                   wire_dtype: torch.dtype | None = None, async_op: bool = False,
                   tag: str = "") -> CommHandle:
        """``output`` = concatenation of every rank's ``input`` in rank order (flat, contiguous)."""
        n = self.size
        if output.numel() != n * input.numel():
            raise ValueError(f"all_gather: output has {output.numel()} elements, expected "
                             f"{n} x {input.numel()} (group size x input)")
        if not output.is_contiguous():
            raise ValueError("all_gather: output must be contiguous")
        wire = wire_dtype or input.dtype
        _check_float_wire(wire, input, "all_gather")
        esize = torch.empty((), dtype=wire).element_size()
        t0 = time.perf_counter()
        if n == 1:
            rec = self._record("all_gather", output.numel(), wire, 0, "local", tag, async_op)
            src = input if wire == input.dtype else input.to(wire)
            output.view(-1).copy_(src.reshape(-1))
            return self._finish_handle(CommHandle(rec, [], t0, None, output), async_op)
        nbytes = ring_wire_bytes("all_gather", n, output.numel() * esize)
        nbytes_out = output.numel() * esize
        if self._p2p_ok(input):
            default = "ring" if self._ring_default(input, input.numel()) else "p2p"
        else:
            default = "native" if self._is_nccl(input) or nbytes_out < self.gloo_broadcast_gather_min_bytes \
                else "broadcast"
        algo = self._algo("all_gather", default)
        if algo == "ring" and not self._ring_ok(input):
            algo = "p2p"  # the ring runs on gloo CPU groups of 3+ ranks only
        rec = self._record("all_gather", output.numel(), wire, nbytes, algo, tag, async_op)
        flat_out = output.view(-1)
        buf = flat_out if wire == output.dtype else torch.empty(flat_out.shape, dtype=wire,
                                                                device=output.device)
        m = input.numel()
        mine = buf[self.rank * m:(self.rank + 1) * m]
        src = input.reshape(-1)
        if mine.data_ptr() != src.data_ptr() or wire != input.dtype:
            mine.copy_(src)
        if algo == "native":
            fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            works = [fn(buf, mine, group=self.group, async_op=True)]
        elif algo == "ring":
            group, rank, timeout = self.group, self.rank, self.timeout
            handle = self._ring_handle(
                rec, lambda tag0, what: ring_all_gather(group, rank, n, buf, tag0, timeout, what), m, t0,
                None if buf is flat_out else (lambda: flat_out.copy_(buf)), output)
            return self._finish_handle(handle, async_op)
        elif algo == "p2p":
            works = self._p2p_exchange([buf[r * m:(r + 1) * m] for r in range(n)], [mine] * n)
        else:
            works = [dist.broadcast(buf[r * m:(r + 1) * m], group=self.group, group_src=r,
                                    async_op=True) for r in range(n)]
        finish = None if buf is flat_out else (lambda: flat_out.copy_(buf))
        handle = (self._p2p_handle(rec, works, t0, finish, output) if algo == "p2p"
                  else CommHandle(rec, works, t0, finish, output))
        return self._finish_handle(handle, async_op)

    # ------------------------------------------------------------------------------- all_to_all
    @opaque
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   output_split_sizes: Sequence[int] | None = None,
                   input_split_sizes: Sequence[int] | None = None, *, async_op: bool = False,
                   tag: str = "") -> CommHandle:
        """``all_to_all_single`` along dim 0 with optional variable splits (rows per peer)."""
        n = self.size
        t0 = time.perf_counter()
        esize = input.element_size()
        rows = input.shape[0] if input.dim() > 0 else 0
        row_elems = input.numel() // rows if rows else 0
        if input_split_sizes is None:
            if rows % n:
                raise ValueError(f"all_to_all: {rows} input rows do not split evenly over {n} ranks; "
                                 "pass input_split_sizes")
            sent_rows = rows - rows // n
        else:
            if len(input_split_sizes) != n or sum(input_split_sizes) != rows:
                raise ValueError(f"all_to_all: input_split_sizes {list(input_split_sizes)} must have "
                                 f"{n} entries summing to {rows}")
            sent_rows = rows - int(input_split_sizes[self.rank])
        if output_split_sizes is not None and len(output_split_sizes) != n:
            raise ValueError(f"all_to_all: output_split_sizes must have {n} entries")
        nbytes = sent_rows * row_elems * esize if n > 1 else 0
        algo = "local" if n == 1 else self._algo("all_to_all", "p2p" if self._p2p_ok(input) else "native")
        rec = self._record("all_to_all", input.numel(), input.dtype, nbytes, algo, tag, async_op)
        if n == 1:
            output.copy_(input)
            return self._finish_handle(CommHandle(rec, [], t0, None, output), async_op)
        if algo == "p2p":
            if not (input.is_contiguous() and output.is_contiguous()):
                raise ValueError("all_to_all: input and output must be contiguous")
            out_rows = output.shape[0] if output.dim() > 0 else 0
            if output_split_sizes is None and out_rows % n:
                raise ValueError(f"all_to_all: {out_rows} output rows do not split evenly over {n} ranks; "
                                 "pass output_split_sizes")
            ins = list(input_split_sizes) if input_split_sizes is not None else [rows // n] * n
            outs = list(output_split_sizes) if output_split_sizes is not None else [out_rows // n] * n
            out_row_elems = output.numel() // out_rows if out_rows else 0
            send_parts = _row_parts(input.reshape(-1), ins, row_elems)
            recv_parts = _row_parts(output.reshape(-1), outs, out_row_elems)
            me = self.rank
            if recv_parts[me].numel() != send_parts[me].numel():
                raise ValueError(f"all_to_all: this rank keeps {send_parts[me].numel()} elements of its input "
                                 f"but its output has room for {recv_parts[me].numel()}")
            recv_parts[me].copy_(send_parts[me])
            works = self._p2p_exchange(recv_parts, send_parts)
            return self._finish_handle(self._p2p_handle(rec, works, t0, None, output), async_op)
        work = dist.all_to_all_single(
            output, input,
            output_split_sizes=list(output_split_sizes) if output_split_sizes is not None else None,
            input_split_sizes=list(input_split_sizes) if input_split_sizes is not None else None,
            group=self.group, async_op=True)
        return self._finish_handle(CommHandle(rec, [work], t0, None, output), async_op)

    # -------------------------------------------------------------------------------- broadcast
    @opaque
    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False,
                  tag: str = "") -> CommHandle:
        """Copy ``tensor`` from group rank ``src`` to every rank, in place."""
        n = self.size
        t0 = time.perf_counter()
        if not 0 <= src < n:
            raise ValueError(f"broadcast: src {src} is not a rank of group {self.name!r} (size {n})")
        nbytes = ring_wire_bytes("broadcast", n, tensor.numel() * tensor.element_size())
        rec = self._record("broadcast", tensor.numel(), tensor.dtype, nbytes,
                           "local" if n == 1 else "native", tag, async_op)
        if n == 1:
            return self._finish_handle(CommHandle(rec, [], t0, None, tensor), async_op)
        work = dist.broadcast(tensor, group=self.group, group_src=src, async_op=True)
        return self._finish_handle(CommHandle(rec, [work], t0, None, tensor), async_op)

    # ---------------------------------------------------------------------------------- objects
    @opaque
    def all_gather_object(self, obj: object, *, tag: str = "") -> list:
        """Every rank's picklable ``obj``, in rank order (used for cross-rank validation)."""
        t0 = time.perf_counter()
        size = len(pickle.dumps(obj))
        rec = self._record("all_gather_object", 1, torch.uint8,
                           ring_wire_bytes("all_gather_object", self.size, size * self.size),
                           "local" if self.size == 1 else "native", tag, False)
        if self.size == 1:
            out = [obj]
        else:
            out = [None] * self.size
            dist.all_gather_object(out, obj, group=self.group)
        rec.elapsed_s = time.perf_counter() - t0
        return out

    @opaque
    def barrier(self, *, tag: str = "") -> None:
        """Block until every rank of the group arrives (recorded with zero bytes)."""
        t0 = time.perf_counter()
        rec = self._record("barrier", 0, torch.uint8, 0, "local" if self.size == 1 else "native",
                           tag, False)
        if self.size > 1:
            dist.barrier(group=self.group)
        rec.elapsed_s = time.perf_counter() - t0

    @opaque
    def agree(self, value: object, what: str, *, tag: str = "validate") -> None:
        """Raise ``ValueError`` on every rank alike if ``value`` differs between ranks."""
        values = self.all_gather_object(value, tag=tag)
        if any(v != values[0] for v in values):
            diffs = ", ".join(f"rank {i}: {v!r}" for i, v in enumerate(values))
            raise ValueError(f"{what} differs between ranks of group {self.name!r}: {diffs}")


def _row_parts(flat: torch.Tensor, rows: Sequence[int], row_elems: int) -> list[torch.Tensor]:
    """Consecutive slices of ``flat`` holding ``rows[p] * row_elems`` elements each (one per peer)."""
    parts, at = [], 0
    for r in rows:
        parts.append(flat[at:at + int(r) * row_elems])
        at += int(r) * row_elems
    return parts


_IN_FLIGHT: dict[int, CommHandle] = {}
"""Point-to-point exchanges issued and not yet waited for, by handle id (see :func:`drain_exchanges`)."""


def _track(handle: CommHandle, group: dist.ProcessGroup | None) -> CommHandle:
    """Keep ``handle`` until it is waited for, so a teardown can finish it first; drop finished ones."""
    for key, h in list(_IN_FLIGHT.items()):
        if h._done:
            _IN_FLIGHT.pop(key, None)
    handle._group = group
    _IN_FLIGHT[id(handle)] = handle
    return handle


def drain_exchanges(group: dist.ProcessGroup | None = None, *, all_groups: bool = False) -> None:
    """Wait for every point-to-point exchange lowband issued on ``group`` (``all_groups``: on any group)
    and nobody waited for yet.

    gloo runs a queued collective to its end before its process group is destroyed; a point-to-point
    send still in flight is dropped instead (the peer then sees its connection close). lowband's exchanges
    keep the collective behaviour: :func:`torch.distributed.destroy_process_group` (wrapped once when
    :mod:`lowband.comm` is imported) and interpreter exit call this first. An exchange that fails here (a
    peer already gone) is left to the teardown, as a failed collective would be."""
    for key, h in list(_IN_FLIGHT.items()):
        if all_groups or group is None or h._group is group:
            try:
                h.wait()
            except Exception:  # the peer is gone: nothing left to finish; the teardown goes on
                pass
            _IN_FLIGHT.pop(key, None)


def _destroy_after_drain(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
        drain_exchanges(group, all_groups=group is None)
        return original(group)

    destroy_process_group._lowband_drains = True  # type: ignore[attr-defined]
    return destroy_process_group


if not getattr(dist.destroy_process_group, "_lowband_drains", False):
    dist.destroy_process_group = _destroy_after_drain(dist.destroy_process_group)
atexit.register(drain_exchanges, all_groups=True)


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """The timeout of a process group (``None``: the default group), read from its backend's options
    (torch 2.13 keeps it there: ``group._get_backend(device).options._timeout``); ``None`` if the
    backend does not expose one. No communication."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in getattr(pg, "_device_types", []) or [torch.device("cpu")]:
        try:
            t = pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
        if isinstance(t, timedelta):
            return t
    return None


def new_group(ranks: Sequence[int], name: str, *, ledger: CommLedger | None = None,
              timeout: timedelta | None = None, algorithms: Mapping[str, str] | None = None) -> Comm | None:
    """Create a subgroup (every rank must call this with the same ``ranks`` in the same order).

    Returns a :class:`Comm` on members and ``None`` on the others.
    """
    pg = dist.new_group(ranks=list(ranks), timeout=timeout)
    if dist.get_rank() not in ranks:
        return None
    return Comm(pg, name=name, ledger=ledger, algorithms=algorithms)
