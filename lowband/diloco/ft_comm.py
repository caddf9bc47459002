"""`TorchftComm`: the part of a :class:`~lowband.comm.Comm` that lowband's wire codecs use, over the
process group of a ``torchft.Manager`` for its current quorum.

:func:`~lowband.comm.codecs.codec_all_reduce` (``fp32``/``bf16``/``fp8``/``int8``/``fp64``) and
:func:`~lowband.comm.compress.gather_all_reduce` (``int4``/``int2``/``topk*``) need ``size``, ``rank``,
``all_to_all(out, inp, async_op=True, tag=...)`` and ``all_gather(out, inp, async_op=True, tag=...)``,
whose handles offer ``wait()`` and ``is_completed()``. :class:`TorchftComm` provides exactly that over
``manager._pg`` (torchft's process group, reconfigured by every quorum), so every wire codec works in
fault-tolerant mode.

Communication pattern (one object per reduction, built after ``start_quorum()``):

* ``size`` = ``manager.num_participants()``, ``rank`` = ``manager.participating_rank()`` (replica
  order of the quorum: every participant sees the same order);
* ``all_to_all``: ``pg.alltoall_base(recv, send, [], [], AllToAllOptions())`` (equal splits along dim
  0); ``all_gather``: ``pg.allgather_into_tensor_coalesced([out], [inp], AllgatherOptions())``. With
  one participant nothing is sent: the input is copied locally (as :class:`~lowband.comm.Comm` does);
* ledger: one record per call (group ``"ft"``, wire dtype of the buffer, the ring-model bytes of
  :class:`~lowband.comm.Comm`: ``all_to_all`` the bytes sent to others, ``all_gather``
  ``(N-1)/N`` of the output; algorithm ``"torchft"``), so a two-phase codec reduction records
  ``2 (N-1)/N`` of its encoded buffer and a message codec ``(N-1)`` messages, as with static membership
  (:func:`~lowband.comm.codecs.wire_bytes_per_rank`).

Error semantics (torchft's own ``Manager.allreduce`` rules): nothing raises and nothing hangs beyond
the manager's timeout. A call made after the manager has errored (an earlier collective of the step
failed, or someone called ``report_error``) sends nothing; a synchronous raise of the process group
(not configured, size mismatch) is passed to ``manager.report_error``; the work's future is wrapped
with ``manager.wrap_future`` (errors and the manager timeout become ``report_error``). The process
group writes into a private receive buffer, copied to the caller's output only if the manager has not
errored when the work completes; otherwise the output is **zeroed** (a failed collective leaves
garbage, and a timed-out one may still be writing): the codecs then decode zeros, finite and harmless,
and this replica's ``manager.should_commit()`` is False, so it discards the step's result (torchft's
vote is among the ranks of one replica group: a peer whose collectives completed commits, and this
replica, now behind, heals from a peer at a later quorum). A call made after the manager has errored
sends nothing, so peers that are still waiting for it fail by the process-group / manager timeout
(torchft's ``allreduce`` behaves the same). A replica that is not a participant of the quorum reports
an error and acts as a group of one. :meth:`TorchftComm.all_gather_unrouted` is the one exception to
these rules: a blocking all-gather that runs even after an error and raises what the group raises (the
settings check of :class:`~lowband.diloco.ft.TorchftMembership`).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from lowband.comm.ledger import CommLedger, CommRecord, dtype_name, ring_wire_bytes


class TorchftHandle:
    """Completion handle of one :class:`TorchftComm` collective (the ``CommHandle`` subset codecs use).

    ``wait()`` never raises for a collective failure: it waits for the manager-wrapped future (bounded
    by the manager's timeout), then copies the private receive buffer into the output, or zeroes the
    output if the manager has errored; it fills the record's ``elapsed_s`` and returns the output.
    """

    def __init__(self, manager: Any, record: CommRecord, t0: float, output: torch.Tensor,
                 scratch: torch.Tensor | None, fut: Any | None) -> None:
        self._manager = manager
        self.record = record
        self._t0 = t0
        self._output = output
        self._scratch = scratch
        self._fut = fut
        self._done = False
        if fut is None:  # nothing in flight (local copy, or skipped because the manager has errored)
            self._complete()

    def is_completed(self) -> bool:
        return self._done or (self._fut is not None and self._fut.done())

    def wait(self) -> torch.Tensor:
        if not self._done:
            if self._fut is not None:
                try:
                    self._fut.wait()  # wrap_future's callback already swallowed and reported errors
                except Exception as e:  # defensive: a future that still raises is routed too
                    self._manager.report_error(e)
            self._complete()
        return self._output

    def _complete(self) -> None:
        if self._scratch is not None:
            if self._manager.errored() is None:
                self._output.copy_(self._scratch)
            else:  # never hand garbage to a decoder; the step will not commit
                self._output.zero_()
        self._scratch = None
        self._fut = None
        self._done = True
        self.record.elapsed_s = time.perf_counter() - self._t0


class TorchftComm:
    """``size``, ``rank``, ``all_to_all`` and ``all_gather`` over a torchft Manager's process group.

    Build one per reduction, after the manager's quorum (``start_quorum()``): size and rank are those
    of that quorum. See the module docstring for the pattern, the ledger records and the error rules.

    Args:
        manager: a ``torchft.manager.Manager`` whose quorum has been started.
        ledger: where the records go.
        name: the ledger group name (default ``"ft"``).
    """

    def __init__(self, manager: Any, ledger: CommLedger, name: str = "ft") -> None:
        self.manager = manager
        self.ledger = ledger
        self.name = name
        rank = manager.participating_rank()
        if rank is None:  # not in this quorum: nobody waits for us; a group of one, step discarded
            manager.report_error(RuntimeError("lowband ft: this replica is not a participant of the quorum"))
            self.size, self.rank = 1, 0
        else:
            self.size, self.rank = int(manager.num_participants()), int(rank)

    def __repr__(self) -> str:
        return f"TorchftComm(name={self.name!r}, rank={self.rank}, size={self.size})"

    def _record(self, op: str, numel: int, dtype: torch.dtype, wire_bytes: int, tag: str,
                async_op: bool) -> CommRecord:
        return self.ledger.add(CommRecord(op=op, group=self.name, group_size=self.size, numel=numel,
                                          wire_dtype=dtype_name(dtype), wire_bytes=wire_bytes,
                                          algorithm="torchft", tag=tag,
                                          async_op=async_op))

    def _issue(self, record: CommRecord, t0: float, output: torch.Tensor, issue: Any) -> TorchftHandle:
        """Run ``issue(scratch) -> Work`` with the manager's error routing; returns the handle."""
        m = self.manager
        if m.errored() is not None:
            output.zero_()
            return TorchftHandle(m, record, t0, output, None, None)
        scratch = torch.empty_like(output)
        try:
            work = issue(scratch)
            fut = m.wrap_future(work.get_future(), None)
        except Exception as e:  # synchronous failure: not configured, size mismatch, broken pair ...
            m.report_error(e)
            fut = None
        return TorchftHandle(m, record, t0, output, scratch, fut)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                   tag: str = "") -> TorchftHandle:
        """Equal-split all-to-all along dim 0 (rank ``j`` receives row block ``j`` of everyone)."""
        from torch.distributed.distributed_c10d import AllToAllOptions

        n = self.size
        t0 = time.perf_counter()
        rows = input.shape[0] if input.dim() > 0 else 0
        if rows % n or output.shape != input.shape:
            raise ValueError(f"TorchftComm.all_to_all: input {tuple(input.shape)} / output {tuple(output.shape)} "
                             f"must be equal shapes whose rows split evenly over {n} ranks")
        row_bytes = (input.numel() // rows if rows else 0) * input.element_size()
        nbytes = (rows - rows // n) * row_bytes if n > 1 else 0
        rec = self._record("all_to_all", input.numel(), input.dtype, nbytes, tag, async_op)
        if n == 1:
            output.copy_(input)
            return self._finish(TorchftHandle(self.manager, rec, t0, output, None, None), async_op)
        send = input.contiguous()
        h = self._issue(rec, t0, output,
                        lambda scratch: self.manager._pg.alltoall_base(scratch, send, [], [], AllToAllOptions()))
        return self._finish(h, async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                   tag: str = "") -> TorchftHandle:
        """``output`` = every participant's ``input`` concatenated in rank order (flat, contiguous)."""
        t0 = time.perf_counter()
        rec = self._gather_record(output, input, tag, async_op)
        if self.size == 1:
            output.view(-1).copy_(input.reshape(-1))
            return self._finish(TorchftHandle(self.manager, rec, t0, output, None, None), async_op)
        send = input.reshape(-1).contiguous()
        h = self._issue(rec, t0, output, lambda scratch: self._pg_all_gather(scratch, send))
        return self._finish(h, async_op)

    def all_gather_unrouted(self, output: torch.Tensor, input: torch.Tensor, *, tag: str = "") -> None:
        """A blocking :meth:`all_gather` outside the manager's error routing: it runs even when the manager
        has already errored in this quorum, writes ``output`` directly and **raises** what the process group
        raises (bounded by its timeout). For checks every participant must complete to decide anything (the
        settings check of :class:`~lowband.diloco.ft.TorchftMembership`, which also runs after a failed heal);
        the caller decides what a failure means."""
        t0 = time.perf_counter()
        rec = self._gather_record(output, input, tag, async_op=False)
        try:
            if self.size == 1:
                output.view(-1).copy_(input.reshape(-1))
            else:
                self._pg_all_gather(output, input.reshape(-1).contiguous()).wait()
        finally:
            rec.elapsed_s = time.perf_counter() - t0

    def _gather_record(self, output: torch.Tensor, input: torch.Tensor, tag: str, async_op: bool) -> CommRecord:
        """Check the all-gather's buffers and record it (``(N-1)/N`` of the output, the ring model)."""
        n = self.size
        if output.numel() != n * input.numel() or not output.is_contiguous() or output.dtype != input.dtype:
            raise ValueError(f"TorchftComm.all_gather: output has {output.numel()} {output.dtype} elements, "
                             f"expected {n} x {input.numel()} {input.dtype}, contiguous")
        nbytes = ring_wire_bytes("all_gather", n, output.numel() * output.element_size())
        return self._record("all_gather", output.numel(), input.dtype, nbytes, tag, async_op)

    def _pg_all_gather(self, output: torch.Tensor, send: torch.Tensor) -> Any:
        from torch.distributed.distributed_c10d import AllgatherOptions

        return self.manager._pg.allgather_into_tensor_coalesced([output.view(-1)], [send], AllgatherOptions())

    @staticmethod
    def _finish(handle: TorchftHandle, async_op: bool) -> TorchftHandle:
        if not async_op:
            handle.wait()
        return handle
