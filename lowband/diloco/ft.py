"""Fault-tolerant DiLoCo membership through torchft (optional extra ``ft``: ``torchft==0.2.0``).

:class:`TorchftMembership` wraps a ``torchft.Manager`` (one per replica group, created by the user
with ``use_async_quorum=False``, a torchft process group over the same group rank of every replica,
and the user's ``state_dict`` / ``load_state_dict`` for the model and inner optimizer):

* **quorum before each fragment's prepare** (``manager.start_quorum()``, synchronous): membership is
  agreed, the process group reconfigured if it changed, and a replica whose committed step is behind
  the quorum's maximum (a restarted or failed one) is **healed** from an up-to-date peer: model and
  inner optimizer (the user's state-dict functions), every fragment's global copy and outer optimizer
  state (registered here under the key ``lowband_diloco``) and the committed step (torchft's own);
* at the first sync of every new quorum the participants' settings are compared (an 8-byte digest per
  entry of ``StreamingDiLoCo.agreed_settings``, plus the manager's ``init_sync`` and, without it, the global
  copies' bits while the quorum is at step 0: no group heals then, so all must start equal; one all-gather,
  tag ``diloco:settings``); a difference raises ``ValueError`` on every participant naming the setting
  (:meth:`TorchftMembership._check_settings`);
* the fragment to sync is ``manager.current_step() % n`` (the committed step, identical on every
  member after the quorum);
* the pseudo-gradient is averaged over the quorum's participants **that did not heal** in it: a replica
  healed at this quorum holds its source's weights, so its pseudo-gradient would be a copy of its source's
  (that work counted twice, its own discarded work not at all); it sends zeros instead, and every
  participant divides the sum by the number of up-to-date participants, ``U`` (the quorum's members at its
  maximum committed step; ``U = 1`` at step 0 when the manager has torchft's ``init_sync``, where every
  member but the first heals). ``U`` and whether this replica healed come from torchft's quorum result
  (:class:`_QuorumTap`), the same on every participant, so no extra message is sent. Wire ``fp32``: with
  ``manager.allreduce`` (sum then division by the number of participants; by ``U`` after it), recorded in the ledger as
  one ``all_reduce`` per bucket (algorithm ``torchft``, tag ``diloco:frag<i>``). **Every other wire
  codec** (``bf16``, ``fp8``, ``int8``, ``int4``, ``int2``, ``topk``, ``topk-int4``, ``topk-int2``):
  with lowband's own codec all-reduce (:func:`~lowband.comm.codecs.wire_all_reduce`) over the
  manager's process group (:class:`~lowband.diloco.ft_comm.TorchftComm`; rank order = the quorum's
  participating rank): the two-phase codecs one ``all_to_all`` and one ``all_gather`` per bucket
  (``2 (N-1)/N`` of the encoded buffer), the message codecs one ``all_gather`` of every participant's
  message (``(N-1)`` messages), the same bytes and bitwise the same results as with static
  membership over ``N`` = the participants of the current quorum (with ``avg_over = U`` when some healed);
  every record has group ``ft``,
  algorithm ``torchft``. In every case errors and timeouts are recorded by the manager instead of
  raised (then that replica's ``should_commit()`` is False; the outputs of a failed codec collective
  are zeroed, never decoded from garbage);
* at the sync ``manager.should_commit()`` votes; on False the fragment is **rolled back** to its
  last global copy, nothing is stepped, the committed step stays, and the **same fragment is
  retried** ``K`` inner steps later (after a new quorum);
* replicas may run **different** ``sync_every`` (same number of fragments): they meet at the quorum.

State reads by a healing peer are blocked during the inner optimizer step (pre-hook
``disallow_state_dict_read``, post-hook ``allow_state_dict_read``), as in torchft's DiLoCo. That lock
covers building the state dict, not sending it: torchft's HTTP transport serves CPU tensors by reference
until the next ``should_commit()``, while this replica runs the ``delay`` inner steps of the fragment in
flight, so the user's ``state_dict`` function must return **copies**
(:func:`lowband.diloco.ft_state.local_state` does; the trainer uses it).

A quorum with fewer participants than the manager's ``min_replica_size`` (a Lighthouse started with a lower
``--min-replicas``) is asked for again every ``QUORUM_RETRY_S`` instead of being trained into a sync that
torchft's vote must refuse; after the manager's ``quorum_timeout`` :class:`FtQuorumError`. The trainer
builds the manager with :func:`lowband.diloco.ft_group.build_manager` (docs/diloco.md, "Training across
machines").
Every wire codec is supported in this mode (torchft's own quantized all-reduce, which needs
CUDA+Triton, is not used: the non-fp32 wires run lowband's codecs over ``manager._pg``, whose
all-to-all and all-gather torchft's ``ProcessGroupGloo`` supports, with the error routing of
``Manager.allreduce``: ``report_error`` / ``wrap_future``).

Error feedback under faults (the rule, implemented in :class:`~lowband.diloco.StreamingDiLoCo` for
any membership): a replica's residual for a fragment changes only when that fragment's sync
**commits**; a rolled-back attempt (``should_commit()`` False) keeps the previous residual, so the
retry re-sends the dropped mass; a replica **healed** from a peer (``load_outer_state``) restarts its
residuals at zero (the residual is private to a replica, never copied from a peer, whose own dropped
mass would then be sent twice). With a lossy wire (error feedback is on by default for ``int4``,
``int2`` and ``topk*``) the residual of an attempt is this replica's own encoding error in the layout
of the attempt's quorum (``N`` participants for the two-phase codecs' chunks); it is adopted only if
the attempt commits, so a membership change between attempts never mixes layouts. With ``fp32``
residuals are zero.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from lowband.comm import CommLedger, default_ledger
from lowband.comm.codecs import CodecHandle, WireCodec, wire_all_reduce
from lowband.comm.comm import true_div_
from lowband.comm.compress import GatherHandle
from lowband.comm.ledger import CommRecord, ring_wire_bytes
from lowband.diloco.ft_comm import TorchftComm

if TYPE_CHECKING:
    from lowband.diloco.streaming import StreamingDiLoCo

STATE_KEY = "lowband_diloco"
QUORUM_RETRY_S = 0.2
"""Pause between quorums while fewer than ``min_replicas`` groups have joined."""


def _torchft_message(e: BaseException) -> str:
    """The ``message: "..."`` of a torchft RPC error (a gRPC status dump), else its first line."""
    text = str(e)
    if 'message: "' in text:
        return text.split('message: "', 1)[1].split('"', 1)[0][:160]
    return (text.splitlines() or [type(e).__name__])[0][:160]


STEP0_WEIGHTS = ("the weights at step 0 (torchft init_sync off: give every group the same seed and model, or "
                 "turn init_sync on, ft.init_sync in the trainer)")
"""The settings-check entry of the global copies' digest while a quorum is at step 0, without ``init_sync``."""


class FtSettingsError(ValueError):
    """Replica groups with settings that must agree (wire, fragments, model, ...) met in one quorum."""


class FtQuorumError(RuntimeError):
    """No quorum formed within the manager's quorum timeout (Lighthouse gone, too few replica groups)."""


class _QuorumTap:
    """Stands in for a ``torchft.Manager``'s ``_client`` (its ``ManagerClient``) and keeps the last quorum
    result, whose ``heal``, ``max_step`` and ``max_world_size`` the Manager does not keep; everything
    else goes to the client unchanged. ``_quorum`` runs on the Manager's quorum thread, and
    ``start_quorum()`` (synchronous quorum) returns after it, so the main thread reads ``last`` then."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.last: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = None
        result = self._client._quorum(*args, **kwargs)
        self.last = result
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class _WorkHandle:
    """Adapter of a torchft ``Work`` to the handle interface StreamingDiLoCo polls and waits; with
    ``divisor`` the summed result is divided by it once complete (an average over the up-to-date
    participants)."""

    def __init__(self, work: Any, record: CommRecord, t0: float, flat: torch.Tensor | None = None,
                 divisor: int | None = None) -> None:
        self._work = work
        self._record = record
        self._t0 = t0
        self._flat = flat
        self._divisor = divisor
        self._done = False

    def poll(self) -> bool:
        return True  # single phase: nothing to advance

    def wait(self) -> None:
        if not self._done:
            self._work.wait()
            if self._divisor is not None and self._flat is not None:
                true_div_(self._flat, self._divisor)
            self._done = True
            self._record.elapsed_s = time.perf_counter() - self._t0


class TorchftMembership:
    """Replicas managed by a ``torchft.Manager``: quorum, healing, commit vote, rollback and retry.

    Args:
        manager: a ``torchft.manager.Manager`` built with ``use_async_quorum=False``.
        ledger: where the outer all-reduces are recorded (default: the process-wide ledger).

    Raises:
        ValueError: the manager uses an asynchronous quorum.
    """

    name = "ft"
    uniform_schedule = False  # replicas may differ in sync_every

    def __init__(self, manager: Any, ledger: CommLedger | None = None) -> None:
        if getattr(manager, "_use_async_quorum", False):
            raise ValueError("diloco ft membership: the torchft Manager must be built with "
                             "use_async_quorum=False (a quorum precedes every fragment's prepare)")
        self.manager = manager
        self.ledger = ledger if ledger is not None else default_ledger()
        self._checked_quorum: int | None = None  # torchft quorum id whose settings agreed
        self._started = False  # the first quorum has been asked for
        self._diloco: StreamingDiLoCo | None = None
        client = getattr(manager, "_client", None)
        if client is not None and not isinstance(client, _QuorumTap):
            manager._client = _QuorumTap(client)

    # ------------------------------------------------------------------------------ set-up
    def attach(self, diloco: StreamingDiLoCo) -> None:
        """Called once by :class:`StreamingDiLoCo`: register the healing state (every wire is supported)."""
        self._diloco = diloco
        self.manager.register_state_dict_fn(STATE_KEY, diloco.load_outer_state, diloco.outer_state)

    # --------------------------------------------------------------------------- the hooks
    def before_step(self) -> None:
        self.manager.disallow_state_dict_read()

    def after_step(self) -> None:
        self.manager.allow_state_dict_read()

    def start_quorum(self, diloco: StreamingDiLoCo) -> None:
        """Quorum (may heal this replica); a new quorum checks the settings; the committed step follows
        the manager's.

        Before this replica's first quorum a fresh manager takes ``diloco.committed`` as its step (a
        replica resumed from its own checkpoint: the quorum then knows how far it is, and heals it only if
        a peer is further). A quorum that does not form within the manager's ``quorum_timeout`` raises
        :class:`FtQuorumError` (one line: the Lighthouse is gone or fewer than ``min_replicas`` groups
        are alive)."""
        if not self._started:
            self._started = True
            if self.manager.current_step() < diloco.committed:
                self.manager.load_state_dict({"step": diloco.committed,
                                              "batches_committed": self.manager.batches_committed()})
        timeout = getattr(self.manager, "_quorum_timeout", None)
        timeout_s = timeout.total_seconds() if timeout is not None else None
        need = int(getattr(self.manager, "_min_replica_size", 1))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                self.manager.start_quorum()
            except TimeoutError as e:
                within = f" within {timeout_s:g} s" if timeout_s is not None else ""
                raise FtQuorumError(
                    f"diloco ft: no quorum formed{within} (committed step {diloco.committed}): the torchft "
                    f"Lighthouse is unreachable or fewer than min_replicas = {need} replica groups are alive "
                    f"(torchft: {_torchft_message(e)})") from None
            except Exception:  # e.g. a heal whose state does not fit this model: name the setting that differs
                self._check_settings(diloco)
                raise
            have = self.manager.num_participants()
            if have >= need:
                break
            # a Lighthouse with a lower --min-replicas formed a quorum without enough groups: such a sync could
            # never commit (torchft's vote needs min_replicas), so ask again instead of training into a rollback
            if deadline is not None and time.monotonic() > deadline:
                raise FtQuorumError(
                    f"diloco ft: only {have} of min_replicas = {need} replica groups joined within {timeout_s:g} s "
                    f"(committed step {diloco.committed}); start the missing groups, or lower min_replicas")
            time.sleep(QUORUM_RETRY_S)
        self._check_settings(diloco)
        diloco.committed = self.manager.current_step()

    def contributors(self) -> tuple[int, bool]:
        """``(U, healed)`` of the current quorum: how many participants are up to date (did not heal), and
        whether this replica healed. torchft 0.2.0's rule (its ``compute_quorum_results``): a member heals
        when its step is below the quorum's maximum, or, with ``init_sync``, when the maximum is 0 and it is
        not the first member at it. Without a quorum result (a manager without ``_client``) every participant
        counts."""
        n = int(self.manager.num_participants())
        tap = getattr(self.manager, "_client", None)
        q = getattr(tap, "last", None)
        if q is None or n < 1:
            return max(n, 1), False
        if int(q.max_step) == 0 and bool(getattr(self.manager, "_init_sync", True)):
            up = 1
        else:
            up = int(q.max_world_size)
        healed = bool(q.heal)
        if not 1 <= up <= n or (healed and up >= n):
            raise RuntimeError(f"diloco ft: torchft's quorum result does not fit its healing rule ({n} participants, "
                               f"{up} at the maximum step {q.max_step}, this replica healed: {healed}); lowband "
                               "supports torchft 0.2.0")
        return up, healed

    def _check_settings(self, diloco: StreamingDiLoCo) -> None:
        """At the first sync of every new quorum (torchft's quorum id changed): all-gather an 8-byte digest
        of each of ``diloco.agreed_settings`` over the quorum's participants and raise ``ValueError`` on
        every participant, naming the first setting that differs. Replica groups that joined with another
        wire, block size, top-k, fragment count or model would otherwise exchange messages that decode
        as something else (``fp8`` and ``int8`` have the same size) or never agree in size.

        The all-gather runs on the manager's process group even when the manager has already errored in
        this quorum (a heal from a peer with another model fails first), so the refusal still names the
        setting; if the all-gather itself fails it is reported to the manager and the check runs again
        at the next quorum. One record, tag ``diloco:settings``, ``8 * len(settings)`` bytes per
        participant."""
        import hashlib

        quorum = getattr(self.manager, "_quorum_id", None)
        if quorum is not None and quorum == self._checked_quorum:
            return
        rank, n = self.manager.participating_rank(), self.manager.num_participants()
        if rank is None or n <= 1:
            self._checked_quorum = quorum
            return
        settings = {**diloco.agreed_settings, **self._quorum_settings(diloco)}
        names = list(settings)
        digests = b"".join(hashlib.sha256(repr(settings[k]).encode()).digest()[:8] for k in names)
        device = next((p.device for f in diloco.frags for p in f.params), torch.device("cpu"))
        mine = torch.frombuffer(bytearray(digests), dtype=torch.uint8).to(device)
        everyone = torch.zeros(n * mine.numel(), dtype=torch.uint8, device=device)
        try:
            TorchftComm(self.manager, self.ledger).all_gather_unrouted(everyone, mine, tag="diloco:settings")
        except Exception as e:  # a peer died or the group is not configured: check at the next quorum
            self.manager.report_error(e)
            return
        rows = everyone.view(n, len(names), 8)
        for k, name in enumerate(names):
            differ = [r for r in range(n) if not torch.equal(rows[r, k], rows[rank, k])]
            if differ:
                raise FtSettingsError(f"diloco ft: replica groups disagree on {name} (this group, participant {rank} "
                                      f"of {n}: {settings[name]!r}; participants {differ} have another "
                                      f"value): refused at join; every replica group must use the same {name}")
        self._checked_quorum = quorum

    def _quorum_settings(self, diloco: StreamingDiLoCo) -> dict[str, object]:
        """Two more entries every participant compares: the manager's ``init_sync``, and, without it, a digest of
        the global copies while the quorum is at step 0. Without ``init_sync`` no group heals at step 0, so
        every group must start from the same weights (the same seed and model); with it, or past step 0, the
        entry is ``"-"`` (the heal makes the weights equal)."""
        init_sync = bool(getattr(self.manager, "_init_sync", True))
        q = getattr(getattr(self.manager, "_client", None), "last", None)
        step0 = "-"
        if not init_sync and q is not None and int(q.max_step) == 0:
            from lowband.diloco.streaming import weights_digest

            step0 = weights_digest(t for gs in diloco.globals for t in gs)
        return {"torchft init_sync": init_sync, STEP0_WEIGHTS: step0}

    def all_reduce(self, flat: torch.Tensor, codec: WireCodec, tag: str,
                   residual_out: torch.Tensor | None = None) -> _WorkHandle | CodecHandle | GatherHandle:
        """Average ``flat`` in place over the quorum's up-to-date participants (asynchronous; errors go to
        the manager, never raised); a replica healed at this quorum sends zeros. ``fp32``:
        ``manager.allreduce``; any other codec: ``wire_all_reduce`` over
        :class:`~lowband.diloco.ft_comm.TorchftComm`, with ``residual_out`` receiving this replica's own
        encoding error (error feedback; zero for a healed replica)."""
        n = int(self.manager.num_participants())
        up, healed = self.contributors()
        if healed:  # a copy of its source's pseudo-gradient: that work is already counted
            flat.zero_()
        if codec.name != "fp32":
            comm = TorchftComm(self.manager, self.ledger)
            return wire_all_reduce(comm, flat, codec, op="avg", async_op=True, tag=tag,  # type: ignore[arg-type]
                                   residual_out=residual_out, avg_over=up if up < comm.size else None)
        if residual_out is not None:  # fp32 is exact for fp32 buffers; error feedback is then off anyway
            residual_out.zero_()

        t0 = time.perf_counter()
        esize = flat.element_size()
        rec = self.ledger.add(CommRecord(op="all_reduce", group="ft", group_size=n, numel=flat.numel(),
                                         wire_dtype=str(flat.dtype).removeprefix("torch."),
                                         wire_bytes=ring_wire_bytes("all_reduce", n, flat.numel() * esize),
                                         algorithm="torchft", tag=tag, async_op=True))
        if up < n:  # sum, then divide by the up-to-date participants
            from torch.distributed import ReduceOp

            return _WorkHandle(self.manager.allreduce(flat, reduce_op=ReduceOp.SUM), rec, t0, flat, up)
        return _WorkHandle(self.manager.allreduce(flat), rec, t0)

    def should_commit(self) -> bool:
        return bool(self.manager.should_commit())
