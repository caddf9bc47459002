"""One run per run directory: a lock file with the owner's pid, host and process start time.

``<dir>/.lowband.lock`` is created with ``O_CREAT | O_EXCL`` (atomic on local file systems) and holds
JSON ``{"pid", "host", "start", "started_at", "argv"}``; ``start`` is the owner's start time from
``/proc/<pid>/stat`` (``None`` where there is no ``/proc``), so a recycled pid is not mistaken for the
owner. A lock whose owner is on this host and no longer running (or is another process now) is stale:
it is removed with a warning and taken over. A lock held by a live process, or by a process on another
host (whose liveness cannot be checked), makes :func:`acquire` raise :class:`LockError` naming the owner.

The CLI takes the lock once per run, before any rank starts (the self-launcher, or rank 0 under
``torchrun``), and removes it when the run ends. No communication.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

LOCK_NAME = ".lowband.lock"


class LockError(RuntimeError):
    """The run directory is in use by another run (the message names the owner and the lock file)."""


def _proc_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), or ``None``."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return int(text[text.rindex(")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def _alive(pid: int, start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    return start is None or _proc_start(pid) in (None, start)


@dataclass
class RunLock:
    """A held lock on ``directory`` (release it with :meth:`release`)."""

    directory: Path
    path: Path
    record: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def release(self) -> None:
        """Remove the lock file if it is still ours."""
        try:
            if json.loads(self.path.read_text()).get("token") == self.record.get("token"):
                self.path.unlink()
        except (OSError, ValueError):
            pass


def describe_owner(rec: dict, path: Path) -> str:
    return (f"pid {rec.get('pid')} on host {rec.get('host')} (started {rec.get('started_at', '?')}; "
            f"lock file {path})")


def acquire(directory: str | os.PathLike, pid: int | None = None) -> RunLock:
    """Take the lock on ``directory`` (created if missing) for process ``pid`` (default: this one).

    Raises:
        LockError: another live run holds it, or it is held from another host.
        OSError: the directory cannot be created or written (callers check writability first).
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / LOCK_NAME
    pid = os.getpid() if pid is None else pid
    rec = {"pid": pid, "host": socket.gethostname(), "start": _proc_start(pid),
           "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv,
           "token": f"{socket.gethostname()}:{pid}:{time.time_ns()}"}
    notes: list[str] = []
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner = json.loads(path.read_text())
                if not isinstance(owner, dict):
                    raise ValueError("not an object")
            except (OSError, ValueError):
                # Being written right now, or garbage: give a writer a moment, then treat it as stale.
                time.sleep(0.2)
                try:
                    owner = json.loads(path.read_text())
                except (OSError, ValueError):
                    owner = {}
                if not isinstance(owner, dict) or "pid" not in owner:
                    notes.append(f"removed an unreadable run lock {path}")
                    path.unlink(missing_ok=True)
                    continue
            same_host = owner.get("host") == socket.gethostname()
            if same_host and not _alive(int(owner.get("pid", -1)), owner.get("start")):
                notes.append(f"removed a stale run lock of {describe_owner(owner, path)}: that process is "
                             "no longer running")
                path.unlink(missing_ok=True)
                continue
            where = "" if same_host else " (another host: lowband cannot check that it still runs; delete " \
                                          "the lock file if it does not)"
            raise LockError(f"run directory {str(d)!r} is in use by {describe_owner(owner, path)}{where}; "
                            "wait for that run to end, or choose another run.name / run.out_dir") from None
        with os.fdopen(fd, "w") as fh:
            json.dump(rec, fh)
        return RunLock(d, path, rec, notes)
    raise LockError(f"could not take the run lock {path}: it keeps reappearing (another run starting at "
                    "the same time?)")


def acquire_all(directories: list[Path], pid: int | None = None) -> list[RunLock]:
    """Lock every directory in order; on failure release the ones taken and re-raise."""
    held: list[RunLock] = []
    try:
        for d in directories:
            held.append(acquire(d, pid))
    except BaseException:
        for lk in held:
            lk.release()
        raise
    return held
