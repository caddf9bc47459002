"""One replica group's ``torchft.Manager``, built the way separate launches on separate machines need it.

A fault-tolerant DiLoCo replica group is its own launch (``python -m lowband.train`` or ``torchrun``) on
its own machine; groups find each other through a torchft Lighthouse (``python -m lowband.lighthouse``).
:func:`build_manager` makes the pieces every rank of a group needs, with the addresses a multi-machine
deployment must get right (the reference notes: every torchft default advertises the machine's
hostname, which may resolve to a loopback address on another machine):

* the group's ``TCPStore``: group rank 0 hosts it on a free port (listening on every interface; other
  groups rendezvous the cross-group process group on the store of the quorum's first group) and the
  port reaches the other ranks of the group through one ``all_gather_object`` on the group's
  :class:`~lowband.comm.Comm` (tag ``ft:store``);
* ``hostname`` = ``FtOptions.host``: what group rank 0's ManagerServer advertises (quorum, heal
  metadata) and the store address other groups connect to; the checkpoint server that serves this
  rank's state to a healing peer advertises the same host (:class:`HostHTTPTransport`; torchft's own
  ``HTTPTransport`` always advertises ``socket.gethostname()``);
* a ``torchft.process_group.ProcessGroupGloo`` with ``FtOptions.timeout_s`` (a hung peer's collective
  fails after this long and the sync is rolled back);
* ``use_async_quorum=False`` (a quorum precedes each fragment's prepare, :class:`~lowband.diloco.ft.TorchftMembership`);
* ``init_sync`` = ``FtOptions.init_sync`` (default ``False``): groups seeded alike start from the same weights,
  so at step 0 no group heals from the first (torchft's default copies the first group's model and optimizer
  state to every other group over the slow links, and drops their first inner steps); the settings check
  compares the weights at step 0 (:data:`~lowband.diloco.ft.STEP0_WEIGHTS`) and refuses groups that differ.

:func:`check_lighthouse` connects to the Lighthouse once (a gRPC connection, ``connect_timeout_s``) so an
unreachable address is one line before training instead of a quorum timeout later.

Communication: the store port's ``all_gather_object`` (tag ``ft:store``) on the group; torchft's own
traffic (Lighthouse heartbeats, quorum RPCs, store) is not in lowband's ledger.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lowband.comm import Comm


class LighthouseUnreachableError(ConnectionError):
    """No torchft Lighthouse answered at the configured address within the connect timeout."""


@dataclass(frozen=True)
class FtOptions:
    """How one replica group joins the fault-tolerant run.

    Args:
        lighthouse: the Lighthouse URL, ``http://HOST:PORT`` (what ``python -m lowband.lighthouse`` prints).
        replica_id: this group's name; torchft appends a fresh ``:<uuid>`` per start and orders groups
            by it (its trailing digits are torchft's "global rank").
        min_replicas: a sync needs at least this many groups; fewer and the quorum waits (up to
            ``quorum_timeout_s``).
        host: the address other machines reach this group at (its ManagerServer, TCPStore and
            checkpoint server); ``""`` = ``socket.gethostname()``.
        timeout_s: collectives, commit votes and heal transfers; a hung peer costs at most this.
        quorum_timeout_s: how long a quorum may take (waiting for ``min_replicas`` groups).
        connect_timeout_s: connecting to the Lighthouse and to peers' ManagerServers.
        init_sync: torchft's ``init_sync`` (every group but the first heals at step 0); off by default.
    """

    lighthouse: str
    replica_id: str
    min_replicas: int = 1
    host: str = ""
    timeout_s: float = 60.0
    quorum_timeout_s: float = 300.0
    connect_timeout_s: float = 60.0
    init_sync: bool = False

    @property
    def advertised_host(self) -> str:
        return self.host or socket.gethostname()


def check_lighthouse(url: str, connect_timeout_s: float) -> None:
    """Connect to the Lighthouse at ``url`` once; raise :class:`LighthouseUnreachableError` (one line) if
    nothing answers within ``connect_timeout_s``."""
    from torchft._torchft import LighthouseClient

    try:
        LighthouseClient(url, connect_timeout=timedelta(seconds=connect_timeout_s))
    except Exception as e:  # torchft raises RuntimeError with a multi-line transport error
        raise LighthouseUnreachableError(
            f"no torchft Lighthouse answered at {url} within {connect_timeout_s:g} s (ft.lighthouse; start one with "
            f"`python -m lowband.lighthouse --min-replicas N` and give this group its URL): "
            f"{(str(e).splitlines() or [''])[0].rsplit(': ', 1)[-1][:160]}") from None


def _http_transport(host: str, timeout: timedelta) -> Any:
    from torchft.checkpointing.http_transport import HTTPTransport

    class HostHTTPTransport(HTTPTransport):  # type: ignore[misc]
        """torchft's HTTP checkpoint server, advertising ``host`` instead of ``socket.gethostname()``; its
        per-request access log (``http.server`` writes one stderr line per heal request) is off."""

        def __init__(self, timeout: timedelta, num_chunks: int) -> None:
            super().__init__(timeout=timeout, num_chunks=num_chunks)
            self._server.RequestHandlerClass.log_message = lambda *args, **kwargs: None  # a class made per server

        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return HostHTTPTransport(timeout=timeout, num_chunks=0)


def build_manager(options: FtOptions, group: Comm, *, state_dict: Callable[[], Any],
                  load_state_dict: Callable[[Any], None]) -> tuple[Any, Any]:
    """Build this rank's ``torchft.Manager`` (returns ``(manager, store)``; keep the store alive as long as
    the manager: on group rank 0 it is the group's TCPStore server).

    ``group`` is the replica group's own ranks (``group.rank`` is the group rank); ``state_dict`` /
    ``load_state_dict`` are the healing functions of the model and inner optimizer (registered under
    torchft's ``"default"`` key; :mod:`lowband.diloco.ft_state`). Raises
    :class:`LighthouseUnreachableError` (group rank 0 connects first) before any Manager exists.
    """
    import torch.distributed as dist
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    host = options.advertised_host
    store = None
    verdict: int | str = 0  # group rank 0's store port, or why the group cannot start
    if group.rank == 0:
        try:
            check_lighthouse(options.lighthouse, options.connect_timeout_s)
            store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=options.connect_timeout_s))
            verdict = store.port
        except LighthouseUnreachableError as e:
            verdict = str(e)
    if group.size > 1:  # every rank of the group learns the port, or raises the same error
        verdict = group.all_gather_object(verdict, tag="ft:store")[0]
    if isinstance(verdict, str):
        raise LighthouseUnreachableError(verdict)
    port = int(verdict)
    timeout = timedelta(seconds=options.timeout_s)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=options.min_replicas,
                      use_async_quorum=False, init_sync=options.init_sync, load_state_dict=load_state_dict,
                      state_dict=state_dict,
                      replica_id=options.replica_id, store_addr=host, store_port=port, rank=group.rank,
                      world_size=group.size, lighthouse_addr=options.lighthouse, hostname=host,
                      timeout=timeout, quorum_timeout=timedelta(seconds=options.quorum_timeout_s),
                      connect_timeout=timedelta(seconds=options.connect_timeout_s),
                      checkpoint_transport=_http_transport(host, timeout))
    return manager, store
