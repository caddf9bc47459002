"""Shaped links between ranks: Linux network namespaces, veth pairs, bridges and ``tbf`` rate limits.

:class:`ShapedNetwork` builds, for one run, a private network that exists only inside namespaces it
creates (the machine's own namespace is never touched, nothing is routed out):

* a hub namespace ``<prefix>h`` holding a bridge ``br0`` (the switch);
* flat topology (``nodes == world``): one namespace per rank ``<prefix>r<i>`` with a veth ``lb0``
  whose peer is a port of the hub bridge; ``tbf rate R`` on both ends (rank egress = its upload, hub
  port egress = its download), so every rank has a full-duplex link of ``R``;
* two-level topology (``nodes < world``): per node a namespace ``<prefix>n<k>`` with a bridge
  ``br0``; the node's ranks plug into it through unshaped veths; the node's uplink veth pair to the
  hub bridge carries ``tbf rate R`` on both ends, so ranks of one node share an unshaped link and
  nodes are joined by the shaped one.

Every rank interface is ``lb0`` with the address ``10.213.0.<i+1>/24`` inside its own namespace
(the same names in every run are safe: namespaces are separate). Ranks run under
``ip netns exec`` with ``GLOO_SOCKET_IFNAME=lb0`` and the rendezvous (``MASTER_ADDR``) at rank 0's
address on the bridge.

Hygiene: names carry the creating process id (``lbk<pid>x<hex>``), so two runs never collide and a
namespace whose creator is dead is a leftover of a crashed run; :func:`reap_leftovers` removes those
(and names them). :meth:`ShapedNetwork.close` kills the rank processes it started (each in its own
session, with a parent-death signal) and deletes every namespace it created; it runs on a normal
end, an exception, SIGINT/SIGTERM (turned into exceptions by :func:`signals_as_exceptions`), and a
rank that dies (the launcher notices and ends the run).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

PREFIX = "lbk"
"""Every namespace this module creates is named ``lbk<pid>x<4 hex>`` + a role suffix."""
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)x([0-9a-f]{{4}})([hnr]\d*)$")
IFNAME = "lb0"
SUBNET = "10.213.0"
"""Private /24 used only inside the run's namespaces; rank ``i`` is ``10.213.0.<i+1>``."""
MASTER_PORT = 29500
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)?\s*$", re.IGNORECASE)
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21


class NetnsError(RuntimeError):
    """A namespace / link / qdisc command failed; the message names the command and its stderr."""


def parse_rate(text: str) -> int:
    """``"100mbit"`` -> 100_000_000 bits/s (units bit, kbit, mbit, gbit; decimal, as ``tc`` reads them)."""
    m = _RATE_RE.match(str(text))
    if not m:
        raise ValueError(f"bad rate {text!r}; expected a number with unit bit, kbit, mbit or gbit (e.g. 100mbit)")
    bits = int(float(m.group(1)) * _UNITS[(m.group(2) or "bit").lower()])
    if bits < 8000:
        raise ValueError(f"rate {text!r} is below 8kbit; tbf cannot shape that usefully")
    return bits


def format_rate(bits: int) -> str:
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits % scale == 0:
            return f"{bits // scale}{unit}"
    return f"{bits}bit"


def privilege_problem(suite: str = "link") -> str | None:
    """``None`` if this process may create namespaces and qdiscs, else one line saying why not."""
    if sys.platform != "linux":
        return f"the {suite} suite needs Linux network namespaces; this is {sys.platform}"
    try:
        status = Path("/proc/self/status").read_text()
        cap_eff = int(re.search(r"^CapEff:\s*([0-9a-f]+)", status, re.M).group(1), 16)  # type: ignore[union-attr]
    except (OSError, AttributeError, ValueError):
        cap_eff = 0
    need = (1 << CAP_NET_ADMIN) | (1 << CAP_SYS_ADMIN)
    if cap_eff & need != need:  # root without these capabilities (a container, setpriv) cannot either
        return (f"the {suite} suite needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network "
                "namespaces and tc qdiscs; run it as root")
    dirs = [*os.environ.get("PATH", "").split(":"), "/usr/sbin", "/sbin"]
    for tool in ("ip", "tc"):
        if not any(Path(d, tool).exists() for d in dirs if d):
            return f"the {suite} suite needs the {tool!r} command (iproute2); it is not on PATH"
    return None


def bandwidth_list(text: str, suite: str) -> list[str]:
    """The rates of a suite's ``--bandwidths`` (``"100mbit,10mbit"``), for its argparse type, which is also the
    suite's privilege gate (argparse converts the string default too, so it runs on every parse that is not
    ``--help``): without root, one line ``lowband.bench SUITE: ...`` and exit 2; a bad rate is an
    ``argparse.ArgumentTypeError``."""
    import argparse

    problem = privilege_problem(suite)
    if problem is not None:
        print(f"lowband.bench {suite}: {problem}", file=sys.stderr)
        raise SystemExit(2)
    out = [b.strip() for b in text.split(",") if b.strip()]
    for b in out:
        try:
            parse_rate(b)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    if not out:
        raise argparse.ArgumentTypeError("--bandwidths needs at least one rate, e.g. 100mbit")
    return out


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_leftovers(log: bool = True) -> list[str]:
    """Delete namespaces of this suite whose creating process is gone (crashed runs); return their names.

    Namespaces of a live run (creator alive) are left alone.
    """
    removed = []
    for ns in list_namespaces():
        m = _NAME_RE.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            _kill_ns_processes(ns)
            _run(["ip", "netns", "del", ns], check=False)
            removed.append(ns)
    if removed and log:
        print(f"lowband.bench link: removed {len(removed)} namespace(s) left by crashed runs: "
              f"{', '.join(removed)}", file=sys.stderr)
    return removed


def _kill_ns_processes(ns: str) -> None:
    p = _run(["ip", "netns", "pids", ns], check=False)
    for tok in p.stdout.split():
        with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
            os.kill(int(tok), signal.SIGKILL)


def read_counters(ifname: str = IFNAME) -> tuple[int, int]:
    """``(rx_bytes, tx_bytes)`` of ``ifname`` in the calling process's network namespace (sysfs, as
    mounted by ``ip netns exec``)."""
    base = Path("/sys/class/net") / ifname / "statistics"
    return int((base / "rx_bytes").read_text()), int((base / "tx_bytes").read_text())


def read_proc_counters(pid: int, ifname: str) -> tuple[int, int]:
    """``(rx_bytes, tx_bytes)`` of ``ifname`` in the network namespace of process ``pid``
    (``/proc/<pid>/net/dev``), readable from any namespace."""
    for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == ifname:
            f = rest.split()
            return int(f[0]), int(f[8])
    raise NetnsError(f"interface {ifname!r} not found in /proc/{pid}/net/dev")


def _set_pdeathsig() -> None:
    """In the child before exec: die with SIGKILL when the launcher dies (survives execve)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass(frozen=True)
class Topology:
    world: int
    nodes: int
    rate_bits: int | None
    """Shaped rate in bits/s; ``None`` = unshaped."""
    mtu: int = 1500

    @property
    def ranks_per_node(self) -> int:
        return self.world // self.nodes

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node


class ScopedResource:
    """A context manager over :meth:`open` / :meth:`close`: entering opens (closing again what a failed open
    created), leaving closes, on every exit path. ``close`` must be idempotent."""

    def open(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShapedNetwork(ScopedResource):
    """One run's namespaces, links and qdiscs (see the module docstring); a context manager.

    Args:
        world: number of ranks.
        rate: shaped rate per link (``"100mbit"``) or ``None`` for unshaped.
        nodes: nodes of the two-level topology (must divide ``world``); ``None`` = one node per rank.
        mtu: MTU of every veth and bridge.
    """

    def __init__(self, world: int, rate: str | None, nodes: int | None = None, mtu: int = 1500) -> None:
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        nodes = world if nodes is None else nodes
        if nodes < 1 or world % nodes:
            raise ValueError(f"--nodes must divide the world size {world}; got {nodes}")
        if world > 250:
            raise ValueError(f"world {world} does not fit the /24 subnet of the link suite (at most 250)")
        self.topo = Topology(world, nodes, None if rate is None else parse_rate(rate), mtu)
        self.tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(2)}"
        self.hub = f"{self.tag}h"
        self.created: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.anchors: list[int] = []
        """Per node (two-level topology): pid of a ``sleep`` started in the node namespace, so that any
        process can read the node's uplink counters through ``/proc/<pid>/net/dev`` (interface ``up0``)."""

    # ---------------------------------------------------------------- names
    def rank_ns(self, rank: int) -> str:
        return f"{self.tag}r{rank}"

    def node_ns(self, node: int) -> str:
        return f"{self.tag}n{node}"

    @staticmethod
    def rank_addr(rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    # ---------------------------------------------------------------- set-up / tear-down
    def _ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _bridge(self, ns: str) -> None:
        _run(["ip", "-n", ns, "link", "add", "br0", "mtu", str(self.topo.mtu), "type", "bridge"])
        _run(["ip", "-n", ns, "link", "set", "br0", "up"])

    def _veth(self, ns_a: str, if_a: str, ns_b: str, if_b: str, bridge_b: bool, shaped: bool) -> None:
        mtu = str(self.topo.mtu)
        _run(["ip", "-n", ns_a, "link", "add", if_a, "mtu", mtu, "type", "veth", "peer", "name", if_b,
              "mtu", mtu, "netns", ns_b])
        if bridge_b:
            _run(["ip", "-n", ns_b, "link", "set", if_b, "master", "br0"])
        for ns, ifn in ((ns_a, if_a), (ns_b, if_b)):
            if shaped and self.topo.rate_bits is not None:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", ifn, "root", "tbf", *self.tbf_args()])
            _run(["ip", "-n", ns, "link", "set", ifn, "up"])

    def tbf_args(self) -> list[str]:
        """``rate R burst B latency L``: burst ~4 ms of traffic (at least 2 full frames), queue 50 ms."""
        rate = self.topo.rate_bits
        assert rate is not None
        burst = max(2 * (self.topo.mtu + 14), rate // 8 // 250)
        return ["rate", f"{rate}bit", "burst", str(burst), "latency", "50ms"]

    def open(self) -> None:
        """Create the namespaces, links, bridges, qdiscs and addresses."""
        t = self.topo
        self._ns(self.hub)
        self._bridge(self.hub)
        flat = t.ranks_per_node == 1
        for node in range(t.nodes):
            if not flat:
                nns = self.node_ns(node)
                self._ns(nns)
                self._bridge(nns)
                self._veth(nns, "up0", self.hub, f"n{node}", bridge_b=True, shaped=True)
                _run(["ip", "-n", nns, "link", "set", "up0", "master", "br0"])
                self.anchors.append(self._start(nns, ["sleep", "infinity"], dict(os.environ)).pid)
            for r in range(node * t.ranks_per_node, (node + 1) * t.ranks_per_node):
                rns = self.rank_ns(r)
                self._ns(rns)
                upstream = self.hub if flat else self.node_ns(node)
                self._veth(rns, IFNAME, upstream, f"r{r}", bridge_b=True, shaped=flat)
                _run(["ip", "-n", rns, "addr", "add", f"{self.rank_addr(r)}/24", "dev", IFNAME])

    def close(self) -> None:
        """Kill the rank processes started here, then delete every namespace created (idempotent)."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        self.procs.clear()
        self.anchors.clear()
        for ns in reversed(self.created):
            _kill_ns_processes(ns)
            _run(["ip", "netns", "del", ns], check=False)
        self.created.clear()

    def leftovers(self) -> list[str]:
        """Namespaces of this run that still exist (empty after :meth:`close`)."""
        return [ns for ns in list_namespaces() if ns.startswith(self.tag)]

    # ---------------------------------------------------------------- processes
    def rank_env(self, rank: int) -> dict[str, str]:
        """Environment of rank ``rank``: torch's env:// rendezvous on the bridge, gloo bound to ``lb0``."""
        t = self.topo
        return {"RANK": str(rank), "WORLD_SIZE": str(t.world), "LOCAL_RANK": str(rank % t.ranks_per_node),
                "LOCAL_WORLD_SIZE": str(t.ranks_per_node), "MASTER_ADDR": self.rank_addr(0),
                "MASTER_PORT": str(MASTER_PORT), "GLOO_SOCKET_IFNAME": IFNAME}

    def popen(self, rank: int, argv: Sequence[str], env: dict[str, str] | None = None,
              **kwargs: object) -> subprocess.Popen:
        """Start ``argv`` inside rank ``rank``'s namespace (own session, dies with this process)."""
        return self._start(self.rank_ns(rank), argv, {**os.environ, **(env or {}), **self.rank_env(rank)}, **kwargs)

    def _start(self, ns: str, argv: Sequence[str], env: dict[str, str], *,
               before_exec: Callable[[], None] | None = None, **kwargs: object) -> subprocess.Popen:
        """Start ``argv`` in namespace ``ns`` (own session, dies with this process); ``before_exec`` runs in
        the child first (e.g. :meth:`lowband.bench.cpuquota.CpuQuotas.preexec`: join a CPU-capped cgroup)."""

        def preexec() -> None:
            _set_pdeathsig()
            if before_exec is not None:
                before_exec()

        p = subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=env, start_new_session=True,
                             preexec_fn=preexec, **kwargs)  # type: ignore[call-overload]
        self.procs.append(p)
        return p


@contextlib.contextmanager
def signals_as_exceptions() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt (the default) and SIGTERM/SIGHUP raise SystemExit inside the
    block, so ``finally`` / ``__exit__`` clean-up runs on them too."""

    def to_exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    signal.signal(signal.SIGTERM, to_exit)
    signal.signal(signal.SIGHUP, to_exit)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
