"""CPU quotas per stand-in machine: one cgroup per group of processes, capped at a fixed share of a CPU.

The multi-machine suites (``goodput``) run every replica group on this one machine. Without a cap, a group
that is killed frees its CPU for the others (they run faster than in the fault-free run), and a group that
restarts takes CPU from them while it imports torch: neither happens on machines of their own, and both bend
a comparison of a faulty run with a fault-free one. :class:`CpuQuotas` gives each named group its own cgroup
with the CPU bandwidth limit ``cpus`` (CFS quota: ``cpus x period`` microseconds of CPU time per
``period``), so a group runs at the same speed whatever the others do, as long as the machine has
``sum(cpus)`` cores to give.

Layout: ``<cpu controller>/lowband-<pid>x<4 hex>/<name>`` (cgroup v1: ``/sys/fs/cgroup/cpu``, files
``cpu.cfs_period_us`` / ``cpu.cfs_quota_us``; cgroup v2: the unified root with the ``cpu`` controller enabled,
file ``cpu.max``). A process joins a group before it runs anything of its own: :meth:`CpuQuotas.preexec`
returns a function for ``subprocess.Popen(preexec_fn=...)`` that writes the child's pid into the group's
``cgroup.procs`` (children inherit it). :meth:`CpuQuotas.close` (also on an exception, and idempotent) removes
every directory it created once its processes are gone; :func:`reap_cpu_leftovers` removes those of runs whose
creator died. Needs root.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from pathlib import Path

from lowband.bench.netns import ScopedResource

PERIOD_US = 100_000
PREFIX = "lowband-"
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)x[0-9a-f]{{4}}$")
V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")


class CpuQuotaError(RuntimeError):
    """No usable cpu cgroup controller, or a cgroup file could not be written; the message says which."""


def controller_root() -> tuple[Path, int]:
    """``(directory, version)`` of the cgroup cpu controller this process can use.

    Raises:
        CpuQuotaError: neither a cgroup v1 ``cpu`` hierarchy nor a cgroup v2 root with the ``cpu`` controller
            enabled for its children, or no permission to create groups there.
    """
    if (V1_ROOT / "cpu.cfs_quota_us").is_file():
        root, version = V1_ROOT, 1
    elif "cpu" in _read(V2_ROOT / "cgroup.subtree_control").split():
        root, version = V2_ROOT, 2
    else:
        raise CpuQuotaError("no cgroup cpu controller found (cgroup v1 /sys/fs/cgroup/cpu, or cgroup v2 with 'cpu' in "
                            "/sys/fs/cgroup/cgroup.subtree_control); run without CPU quotas (--cpus-per-group 0)")
    if not os.access(root, os.W_OK):
        raise CpuQuotaError(f"cannot create cgroups in {root} (needs root); run without CPU quotas "
                            "(--cpus-per-group 0)")
    return root, version


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _rmdir_when_empty(path: Path, timeout_s: float = 10.0) -> bool:
    """Remove a cgroup directory; its processes may take a moment to be reaped after SIGKILL."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


class CpuQuotas(ScopedResource):
    """One cgroup per name, each capped at ``cpus`` CPUs; a context manager.

    Args:
        names: the groups (e.g. ``["g0", "g1", "g2"]``).
        cpus: the cap of each group in CPUs (``0.6`` = 60 ms of CPU time every 100 ms); > 0.

    Raises:
        ValueError: ``cpus`` not positive, or a name that is not a plain directory name.
        CpuQuotaError: see :func:`controller_root`.
    """

    def __init__(self, names: list[str], cpus: float) -> None:
        if not cpus > 0:
            raise ValueError(f"CpuQuotas: cpus must be > 0, got {cpus!r}")
        bad = [n for n in names if not re.fullmatch(r"[A-Za-z0-9_.-]+", n)]
        if bad:
            raise ValueError(f"CpuQuotas: group names must be plain directory names; got {bad}")
        self.names = list(names)
        self.cpus = float(cpus)
        self.quota_us = max(1000, round(self.cpus * PERIOD_US))
        self.root, self.version = controller_root()
        self.base = self.root / f"{PREFIX}{os.getpid()}x{secrets.token_hex(2)}"
        self.created: list[Path] = []

    def path(self, name: str) -> Path:
        if name not in self.names:
            raise KeyError(f"CpuQuotas: no group {name!r} (groups: {self.names})")
        return self.base / name

    def open(self) -> None:
        """Create the run's directory and one capped group per name."""
        self.base.mkdir()
        self.created.append(self.base)
        if self.version == 2:
            (self.base / "cgroup.subtree_control").write_text("+cpu")
        for name in self.names:
            d = self.base / name
            d.mkdir()
            self.created.append(d)
            if self.version == 1:
                (d / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (d / "cpu.cfs_quota_us").write_text(str(self.quota_us))
            else:
                (d / "cpu.max").write_text(f"{self.quota_us} {PERIOD_US}")

    def quota(self, name: str) -> float:
        """The cap of group ``name`` in CPUs, read back from the cgroup."""
        d = self.path(name)
        if self.version == 1:
            return int(_read(d / "cpu.cfs_quota_us")) / int(_read(d / "cpu.cfs_period_us"))
        q, p = _read(d / "cpu.max").split()
        return int(q) / int(p)

    def preexec(self, name: str):
        """A ``preexec_fn`` that moves the child into group ``name`` (before it execs anything)."""
        procs = str(self.path(name) / "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        return join

    def close(self) -> None:
        """Remove every group created here (its processes must be gone; waits up to 10 s each). Idempotent."""
        left = [d for d in reversed(self.created) if not _rmdir_when_empty(d)]
        self.created = left


def group_of(pid: int) -> str:
    """The cpu cgroup path of process ``pid`` (``/proc/<pid>/cgroup``; ``""`` when it has none)."""
    v2 = ""
    for line in _read(Path(f"/proc/{pid}/cgroup")).splitlines():
        _hid, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path  # cgroup v1's cpu hierarchy
        if controllers == "":
            v2 = path
    return v2


def reap_cpu_leftovers() -> list[str]:
    """Remove the groups of runs whose creating process is gone (a crashed launcher); return their names."""
    try:
        root, _version = controller_root()
    except CpuQuotaError:
        return []
    removed = []
    for d in root.glob(f"{PREFIX}*"):
        m = _NAME_RE.match(d.name)
        if not m or not d.is_dir():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # its creator is alive
        except PermissionError:
            continue  # alive, another user's
        except ProcessLookupError:
            pass
        for sub in [s for s in d.iterdir() if s.is_dir()]:
            for pid in _read(sub / "cgroup.procs").split():
                with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                    os.kill(int(pid), 9)
            _rmdir_when_empty(sub)
        if _rmdir_when_empty(d):
            removed.append(d.name)
    return removed
