"""Signals in a rank: SIGINT/SIGTERM request a clean stop; a rank never outlives its launcher.

:func:`install_stop_handlers` makes the first SIGINT or SIGTERM only record the request
(:func:`requested` returns its number). The training loop's non-finite guard carries that flag in its
per-step all-reduce (``lowband.train.guards``), so every rank stops after the same step, saves a final
checkpoint when checkpointing is on, and exits with ``128 + signal``. A second signal raises
``KeyboardInterrupt`` at once (no checkpoint).

:func:`watch_parent` ends this process when its parent (the self-launcher) goes away, even by SIGKILL:
``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on Linux, plus a daemon thread that polls ``os.getppid()`` (for
other systems, and for the window before ``prctl`` took effect). No communication.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from types import FrameType

_requested = 0
_PR_SET_PDEATHSIG = 1


def requested() -> int:
    """The signal number of a pending stop request, or 0."""
    return _requested


def request(signum: int) -> None:
    """Record a stop request (what the handler does; tests call it directly)."""
    global _requested
    _requested = int(signum)


def reset() -> None:
    global _requested
    _requested = 0


def _handler(signum: int, frame: FrameType | None) -> None:
    if _requested:
        raise KeyboardInterrupt(f"second signal {signum}")
    request(signum)


def install_stop_handlers() -> None:
    """First SIGINT/SIGTERM: request a clean stop; a second one: ``KeyboardInterrupt`` (main thread only)."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _handler)


def watch_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Exit (SIGKILL to self) as soon as ``parent_pid`` is no longer this process's parent."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)

    def poll() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=poll, name="lowband-parent-watch", daemon=True).start()
