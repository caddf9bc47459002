"""Pipelined ring reduce-scatter and all-gather over gloo point-to-point, driven by one thread per group.

Why a ring: on a bandwidth-bound link with three or more ranks, lowband's all-peers exchange (``p2p``)
makes every rank send to ``N - 1`` peers and receive from ``N - 1`` at once, so ``N - 1`` TCP flows meet
in every rank's downlink and in every rank's uplink queue. On a shaped 10 Mbit/s link at 4 ranks that
incast cost the sharded optimizer 1.4x DDP's step, although both move the same bytes (docs/PERFORMANCE.md,
"The ring exchange"). A ring sends to one neighbour and receives from the other, one flow per direction of
every link, like the ring all-reduce DDP runs.

Pattern (``N`` ranks, rank ``r`` sends to ``r + 1`` and receives from ``r - 1``; chunk ``c`` of the flat
buffer belongs to rank ``c``; each chunk is cut into ``K`` sub-chunks, see :func:`ring_pieces`):

* **reduce-scatter**, ``N - 1`` steps: step 0 sends chunk ``r - 1`` of this rank's input; step ``s``
  receives the partial sum of chunk ``r - 1 - s``, adds this rank's own part of it and sends it on. The
  last receive is chunk ``r``'s sum over the other ranks, to which the owner adds its own part. So chunk
  ``c`` is summed in *ring order* ``((x[c+1] + x[c+2]) + ...) + x[c]`` (ranks mod ``N``), in the tensor's
  dtype: fp32 or fp64 only, where that dtype is also the accumulation dtype (a narrower wire keeps the
  all-peers exchange and its fp32 sum at the owner). :func:`ring_order_sum` is the single-process
  reference. Every rank gets its own chunk; a following all-gather gives every rank the same bits.
* **all-gather**, ``N - 1`` steps: step 0 sends this rank's own chunk, step ``s`` forwards chunk
  ``r - s`` received in step ``s - 1``. Pure copies: bitwise the same result as any other all-gather.

Sub-chunk ``k`` of step ``s + 1`` is sent as soon as sub-chunk ``k`` of step ``s`` has arrived, so the
steps overlap instead of running one after the other. Bytes per rank: ``(N - 1) / N`` of the buffer,
each way, as in the ring model of :mod:`lowband.comm.ledger`.

Threading: every ring operation of a process group runs, in launch order, on one daemon thread of that
group (:class:`RingWorker`), so a reduce-scatter launched from a backward hook keeps moving while backward
goes on, and an all-gather launched in ``step()`` keeps moving through the next forward. Every rank
launches the same operations in the same order, so every rank's thread runs them in the same order. Each
operation takes a block of point-to-point tags allocated at launch from the caller's :class:`Comm`
(one tag per step and sub-chunk), so operations never pair with each other or with other exchanges. A
wait past the group's timeout raises on the thread and is re-raised by :meth:`RingWork.wait`, naming the
operation.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

RING_MIN_CHUNK = 8192
"""Smallest chunk, in elements, for which :class:`lowband.comm.Comm` picks the ring by default."""
RING_PIECE = 16384
"""Sub-chunk size, in elements, that :func:`ring_pieces` aims at."""
RING_MAX_PIECES = 8
"""Most sub-chunks per chunk."""


def ring_pieces(chunk_numel: int) -> int:
    """Sub-chunks per chunk: ``chunk_numel // RING_PIECE``, between 2 and ``RING_MAX_PIECES`` (1 for a chunk of
    one element or none); the same on every rank, since every rank's chunk has the same size.

    The trade-off, measured at 4 ranks on shaped links (docs/PERFORMANCE.md): each piece is one more
    point-to-point message per step and one more hand-off on the ring thread, which costs latency where the link
    is fast (1 Gbit/s: 6 pieces of a 110 kB chunk made the step 1.5x the all-peers exchange's, 2 pieces
    1.14-1.25x), while one piece leaves every link idle while a step's chunk is being received whole
    (10 Mbit/s: 1 piece 1.17x DDP's step, 2 pieces 1.03-1.07x, 6 pieces 1.09x; one run each)."""
    if chunk_numel < 2:
        return 1
    return max(2, min(RING_MAX_PIECES, chunk_numel // RING_PIECE))


def ring_tags(world: int, chunk_numel: int) -> int:
    """Point-to-point tags one ring operation uses: one per step and sub-chunk."""
    return (world - 1) * ring_pieces(chunk_numel)


def ring_order(owner: int, world: int) -> list[int]:
    """The ranks in the order the ring reduce-scatter adds up chunk ``owner``: from ``owner + 1`` around to
    ``owner``."""
    return [(owner + 1 + i) % world for i in range(world)]


def ring_order_sum(parts: list[torch.Tensor], owner: int) -> torch.Tensor:
    """Single-process reference of the ring reduce-scatter's sum of chunk ``owner``: ``parts[i]`` is rank
    ``i``'s copy of that chunk, added in :func:`ring_order`."""
    first, *rest = ring_order(owner, len(parts))
    acc = parts[first].clone()
    for i in rest:
        acc = acc + parts[i]
    return acc


class RingWork:
    """One ring operation queued on its group's :class:`RingWorker`; the ``dist.Work``-like object a
    :class:`lowband.comm.CommHandle` waits on (``wait``, ``is_completed``, ``get_future``)."""

    def __init__(self, what: str, run: Callable[[], None]) -> None:
        self.what = what
        self._run = run
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future = torch.futures.Future()

    def execute(self) -> None:
        try:
            self._run()
        except BaseException as e:  # handed to the waiter, who raises it on its own thread
            self._error = e
        self._run = None  # type: ignore[assignment]  # drop the tensors it held
        self._done.set()
        if self._error is None:
            self._future.set_result(None)
        else:
            self._future.set_exception(self._error)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the operation ended; raise its error if it failed. The thread's own waits carry the
        group's timeout, so this returns; ``timeout`` is accepted for ``dist.Work`` compatibility."""
        del timeout
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(f"lowband {self.what} failed: {self._error}") from self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def get_future(self) -> torch.futures.Future:
        """Completes (on the ring thread) when the operation has ended."""
        return self._future


class RingWorker:
    """The daemon thread that runs one process group's ring operations in launch order."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[RingWork] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"lowband-ring-{name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self._queue.get().execute()

    def submit(self, work: RingWork) -> RingWork:
        self._queue.put(work)
        return work


_WORKERS: dict[int, RingWorker] = {}
_WORKERS_LOCK = threading.Lock()


def _forget_workers_in_child() -> None:
    """A forked child (a DataLoader worker) has none of its parent's threads: it starts its own if it ever
    runs a ring."""
    global _WORKERS_LOCK
    _WORKERS.clear()
    _WORKERS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_workers_in_child)


def worker_for(group: dist.ProcessGroup | None, name: str) -> RingWorker:
    """The ring thread of ``group`` (one per process group, started on first use)."""
    key = id(group) if group is not None else 0
    with _WORKERS_LOCK:
        w = _WORKERS.get(key)
        if w is None:
            w = _WORKERS[key] = RingWorker(name)
        return w


def _wait(work: dist.Work, timeout: timedelta | None, what: str) -> None:
    if timeout is None:
        work.wait()
    elif not work.wait(timeout):
        raise RuntimeError(f"{what} timed out after {timeout}")


def ring_reduce_scatter(group: dist.ProcessGroup | None, rank: int, world: int, out: torch.Tensor,
                        send: torch.Tensor, tag0: int, timeout: timedelta | None, what: str) -> None:
    """``out`` = ring-order sum over ranks of chunk ``rank`` of ``send`` (both flat, contiguous, one dtype;
    ``send`` holds ``world`` chunks of ``out.numel()``). Runs on the ring thread; see the module doc."""
    m = out.numel()
    if m == 0:
        return
    k_pieces = ring_pieces(m)
    chunks = send.view(world, m)
    right, left = (rank + 1) % world, (rank - 1) % world
    recv = torch.empty((world - 1, m), dtype=out.dtype, device=out.device)
    partial = torch.empty((max(world - 2, 0), m), dtype=out.dtype, device=out.device)
    recvs = [recv[s].tensor_split(k_pieces) for s in range(world - 1)]
    rworks = [[dist.irecv(p, group=group, group_src=left, tag=tag0 + s * k_pieces + k)
               for k, p in enumerate(recvs[s])] for s in range(world - 1)]
    sworks = []
    for s in range(world - 1):
        if s == 0:
            cur = chunks[(rank - 1) % world].tensor_split(k_pieces)
        else:
            cur = partial[s - 1].tensor_split(k_pieces)
            own = chunks[(rank - 1 - s) % world].tensor_split(k_pieces)
        for k in range(k_pieces):
            if s > 0:
                _wait(rworks[s - 1][k], timeout, what)
                torch.add(recvs[s - 1][k], own[k], out=cur[k])
            sworks.append(dist.isend(cur[k], group=group, group_dst=right, tag=tag0 + s * k_pieces + k))
    for w in rworks[world - 2]:
        _wait(w, timeout, what)
    torch.add(recv[world - 2], chunks[rank], out=out)
    for w in sworks:
        _wait(w, timeout, what)


def ring_all_gather(group: dist.ProcessGroup | None, rank: int, world: int, buf: torch.Tensor, tag0: int,
                    timeout: timedelta | None, what: str) -> None:
    """Fill every chunk of the flat ``buf`` but chunk ``rank`` (already in place) from its owner, around the
    ring. Runs on the ring thread; see the module doc."""
    m = buf.numel() // world
    if m == 0:
        return
    k_pieces = ring_pieces(m)
    chunks = buf.view(world, m)
    right, left = (rank + 1) % world, (rank - 1) % world
    rworks = [[dist.irecv(p, group=group, group_src=left, tag=tag0 + s * k_pieces + k)
               for k, p in enumerate(chunks[(rank - 1 - s) % world].tensor_split(k_pieces))]
              for s in range(world - 1)]
    sworks = []
    for s in range(world - 1):
        pieces = chunks[(rank - s) % world].tensor_split(k_pieces)
        for k in range(k_pieces):
            if s > 0:
                _wait(rworks[s - 1][k], timeout, what)
            sworks.append(dist.isend(pieces[k], group=group, group_dst=right, tag=tag0 + s * k_pieces + k))
    for w in rworks[world - 2]:
        _wait(w, timeout, what)
    for w in sworks:
        _wait(w, timeout, what)
