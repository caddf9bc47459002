"""``python -m lowband.lighthouse``: start torchft's Lighthouse, the membership service of fault-tolerant DiLoCo.

Replica groups (each its own launch, possibly on its own machine) find each other through one Lighthouse:
every group's ``torchft.Manager`` asks it for a quorum before each fragment's sync
(:class:`lowband.diloco.ft.TorchftMembership`). This command runs ``torchft._torchft.LighthouseServer`` in the
foreground, prints the URL the groups connect to, and stops cleanly on SIGINT or SIGTERM (exit 0)::

    python -m lowband.lighthouse --min-replicas 2 --bind 0.0.0.0:29510

The timeouts decide how a fault looks to the survivors (measured: ``../shared/reference/torchft_elastic.md``):

* ``--heartbeat-timeout-ms`` (default 5000): a SIGKILLed group is dropped from the next quorum this long after
  its last heartbeat; it bounds the survivors' stall after a kill.
* ``--join-timeout-ms`` (default 60000): how long a quorum waits for a group that heartbeats but has not asked
  yet. Keep it above the worst arrival skew between groups (an inner loop plus a heal's transfer): below it,
  groups that arrive late miss every quorum and re-heal at every sync.

Exit codes: 0 stopped by a signal; 2 bad arguments, torchft missing (``pip install 'lowband[ft]'``, which
pins ``torchft==0.2.0``), or the address cannot be bound (one line on stderr, ``lowband.lighthouse: error: ...``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from urllib.parse import urlsplit

PROG = "python -m lowband.lighthouse"
TAG = "lowband.lighthouse"  # the prefix of its lines, as lowband.train's
DEFAULT_BIND = "0.0.0.0:29510"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Run torchft's Lighthouse for fault-tolerant DiLoCo "
                                "replica groups (foreground; SIGINT or SIGTERM stops it, exit 0).")
    p.add_argument("--min-replicas", type=int, required=True,
                   help="replica groups a quorum needs (training waits until this many have joined)")
    p.add_argument("--bind", default=DEFAULT_BIND,
                   help="HOST:PORT to listen on; port 0 picks a free one (default: %(default)s)")
    p.add_argument("--join-timeout-ms", type=int, default=60_000,
                   help="how long a quorum waits for a heartbeating group that has not asked yet; keep it above "
                        "the worst arrival skew between groups (default: %(default)s)")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=5_000,
                   help="a group without a heartbeat this long leaves the next quorum; bounds the stall after a "
                        "group dies (default: %(default)s)")
    p.add_argument("--quorum-tick-ms", type=int, default=100,
                   help="how often a quorum is re-evaluated (default: %(default)s)")
    return p


def connect_url(bind: str, advertised: str) -> str:
    """The URL replica groups use: the bound host (the machine's hostname for a wildcard bind) and the real
    port (``advertised`` is the server's own ``http://HOSTNAME:PORT``, which has the port ``0`` resolved)."""
    port = urlsplit(advertised).port
    host = bind.rsplit(":", 1)[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = urlsplit(advertised).hostname or "localhost"
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    return f"http://{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for name in ("min_replicas", "join_timeout_ms", "heartbeat_timeout_ms", "quorum_tick_ms"):
        if getattr(args, name) < 1:
            print(f"{TAG}: error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}",
                  file=sys.stderr)
            return 2
    try:
        from torchft._torchft import LighthouseServer
    except ImportError:
        print(f"{TAG}: error: torchft is not installed; install lowband's ft extra "
              "(pip install 'lowband[ft]', torchft==0.2.0)", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server = LighthouseServer(bind=args.bind, min_replicas=args.min_replicas,
                                  join_timeout_ms=args.join_timeout_ms, quorum_tick_ms=args.quorum_tick_ms,
                                  heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    except RuntimeError as e:  # address in use, not an address, not permitted
        print(f"{TAG}: error: cannot listen on {args.bind!r}: {e}", file=sys.stderr)
        return 2
    url = connect_url(args.bind, server.address())
    print(f"{TAG}: listening on {url} (min_replicas {args.min_replicas}, join timeout {args.join_timeout_ms} ms, "
          f"heartbeat timeout {args.heartbeat_timeout_ms} ms)", flush=True)
    print(f"{TAG}: replica groups connect with TORCHFT_LIGHTHOUSE={url}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
    print(f"{TAG}: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
