"""One run per run directory (and per checkpoint directory): ``flock`` on a lock file that names its owner.

``<dir>/.lowband.lock`` is opened (created if missing) and locked with ``flock(LOCK_EX | LOCK_NB)``; the
holder keeps it open for the whole run and writes JSON ``{"pid", "host", "start", "started_at", "argv",
"token"}`` into it, where ``start`` is the owner's start time from ``/proc/<pid>/stat`` (``None`` where there
is no ``/proc``). The kernel decides who wins: of any number of runs started together, exactly one gets the
``flock``; the others are refused with :class:`LockError` naming the owner. The kernel also drops the
``flock`` when its holder dies, by any signal including SIGKILL, so a crashed run's lock is taken over by
the next run (with a warning naming the dead owner); nothing is ever deleted to take a lock over.

On release the holder unlinks the file while still holding the ``flock``. A contender that opened the file
just before that may get the ``flock`` on the unlinked inode, so after locking, :func:`acquire` checks that
the path still names the inode it locked, and starts over if not: two holders can never coexist.

Conservative extras: a record whose owner is on this host and still running, although it holds no
``flock`` (a run of a lowband from before this lock), also makes the directory busy; a record from
another host makes it busy too (``flock`` may not reach across machines on network file systems, and
liveness cannot be checked there): delete the lock file once that run is gone. A lock path that is not a
regular file (a directory, a link, a pipe) is refused by name.

A child created with ``fork()`` (without ``exec``) inherits the locked descriptor and keeps the lock until it
exits too; the ranks are started with ``subprocess`` (``exec``, descriptors closed), which does not.

The CLI takes the locks once per run, before any rank starts (the self-launcher, or rank 0 under
``torchrun``), and releases them when the run ends. No communication.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
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
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    return start is None or _proc_start(pid) in (None, start)


@dataclass
class RunLock:
    """A held lock on ``directory`` (release it with :meth:`release`); ``fd`` is the locked descriptor."""

    directory: Path
    path: Path
    record: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    fd: int | None = None

    def release(self) -> None:
        """Unlink the lock file if it is still ours (the inode we locked), then drop the ``flock``."""
        if self.fd is None:
            return
        try:
            if _same_file(self.path, self.fd):
                self.path.unlink()
        except OSError:
            pass
        finally:
            os.close(self.fd)
            self.fd = None


def _same_file(path: Path, fd: int) -> bool:
    try:
        a, b = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _read_record(fd: int) -> dict | None:
    """The JSON object in the lock file open at ``fd``; ``None`` when empty or unreadable (being written)."""
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, max(size, 1), 0)
        rec = json.loads(data.decode("utf-8"))
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _current_owner(fd: int, host: str) -> dict | None:
    """The holder's record, read from a file another process holds the ``flock`` on. Just after a takeover it
    may still hold the dead previous owner's record (or be half written): read again for a moment (at most
    ~0.5 s) until it names a live process; ``None`` if it never does."""
    for _ in range(50):
        rec = _read_record(fd)
        if rec is not None and "pid" in rec:
            if rec.get("host") != host:
                return rec
            try:
                if _alive(int(rec["pid"]), rec.get("start")):
                    return rec
            except (TypeError, ValueError):
                pass
        time.sleep(0.01)
    return None


def describe_owner(rec: dict, path: Path) -> str:
    return (f"pid {rec.get('pid')} on host {rec.get('host')} (started {rec.get('started_at', '?')}; "
            f"lock file {path})")


def _busy(what: str, d: Path, owner: str, where: str = "") -> LockError:
    return LockError(f"{what} {str(d)!r} is in use by {owner}{where}; wait for that run to end, or choose "
                     "another run.name / run.out_dir" + (" / checkpoint.dir" if what != "run directory" else ""))


def acquire(directory: str | os.PathLike, pid: int | None = None, *, what: str = "run directory") -> RunLock:
    """Take the lock on ``directory`` (created if missing) for process ``pid`` (default: this one).

    Args:
        what: how the messages call the directory ("run directory", "checkpoint directory").

    Raises:
        LockError: another live run holds it, it is held from another host, or the lock path is not a
            regular file.
        OSError: the directory cannot be created or written (callers check writability first).
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / LOCK_NAME
    pid = os.getpid() if pid is None else pid
    host = socket.gethostname()
    rec = {"pid": pid, "host": host, "start": _proc_start(pid),
           "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv,
           "token": f"{host}:{pid}:{time.time_ns()}"}
    for _ in range(100):  # starts over only when a holder released (unlinked) the file we opened
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                raise LockError(f"the lock path {str(path)!r} of {what} {str(d)!r} is not a regular file; "
                                "remove it (lowband creates it as a small JSON file while a run holds the "
                                "directory)")
        except FileNotFoundError:
            pass
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _current_owner(fd, host)
                raise _busy(what, d, describe_owner(owner, path) if owner else
                            f"another run (its owner record is being written; lock file {path})") from None
            if not _same_file(path, fd):
                os.close(fd)  # the holder released and unlinked it under us: try the current file
                continue
            notes: list[str] = []
            owner = _read_record(fd)
            if owner is not None and "pid" in owner:
                if owner.get("host") != host:
                    raise _busy(what, d, describe_owner(owner, path),
                                " (another host: lowband cannot check that it still runs; delete the lock file "
                                "if it does not)")
                try:
                    opid = int(owner["pid"])
                except (TypeError, ValueError):
                    opid = -1
                if _alive(opid, owner.get("start")):
                    raise _busy(what, d, describe_owner(owner, path))
                notes.append(f"removed a stale run lock of {describe_owner(owner, path)}: that process is no "
                             "longer running")
            elif os.fstat(fd).st_size:
                notes.append(f"removed an unreadable run lock {path}")
            data = json.dumps(rec).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            return RunLock(d, path, rec, notes, fd)
        except BaseException:
            try:
                os.close(fd)
            except OSError:
                pass
            raise
    raise LockError(f"could not take the lock {path}: it keeps being released and re-created (many runs "
                    "starting at the same time?)")


def acquire_all(directories: list[Path], pid: int | None = None) -> list[RunLock]:
    """Lock every directory in order; on failure release the ones taken and re-raise.

    ``directories``: the run directory first, then the checkpoint directory (:func:`lowband.train.preflight.
    lock_dirs`'s order); messages call the first "run directory", the others "checkpoint directory".
    """
    held: list[RunLock] = []
    try:
        for i, d in enumerate(directories):
            held.append(acquire(d, pid, what="run directory" if i == 0 else "checkpoint directory"))
    except BaseException:
        for lk in held:
            lk.release()
        raise
    return held
