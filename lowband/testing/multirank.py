"""Run a function on N gloo ranks in spawned processes and collect results or tracebacks.

``run_ranks(fn, world_size, *args)`` calls ``fn(*args)`` on every rank inside an initialized gloo
process group (``torch.distributed`` default group, a fresh ``FileStore`` per call), returns the list
of per-rank return values, and re-raises a failure as :class:`DistributedTestError` carrying the
failing rank's traceback. ``fn`` must be importable (module level) because ranks are spawned.

Spawning a process that imports torch costs seconds, so ranks live in a pool per world size that is
reused across calls; each call gets its own process group, which is destroyed afterwards. A failure
after which some rank did not report back (it may still be blocked in a collective), a failed start, or
a timeout tears the pool down so the next call starts clean; a failure every rank reported keeps it. Set
``LOWBAND_TEST_POOL=0`` to spawn fresh processes for every call.

Per call, each rank starts with ``torch.manual_seed(0)``, the default dtype float32, one intra-op
thread, and the process-wide comm ledger reset.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import multiprocessing
import os
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = float(os.environ.get("LOWBAND_TEST_TIMEOUT", "120"))
READY_TIMEOUT_S = 600.0
"""How long a new pool's rank processes may take to start (spawn and import), outside any call's timeout."""
MAX_STARTUP_RETRIES = 2
"""Fresh-process retries of a call whose process group could not be formed."""
RENDEZVOUS_TIMEOUT_S = 60.0
"""How long every rank of a call may take to form its process group (at most half the call's timeout; calls with a
timeout under 20 s keep their plain timeout): gloo's full-mesh set-up under load sometimes logs "connection closed
by peer" and then neither fails nor finishes; such a call is retried on fresh processes (a startup failure) instead
of running into its timeout."""


class DistributedTestError(AssertionError):
    """A rank raised, or the ranks did not finish in time."""


class DistributedTimeout(DistributedTestError):
    """The ranks did not finish within the call's ``timeout`` (they are killed)."""


def _die_with_parent() -> None:
    """Linux: end this pooled rank with SIGKILL when the process that started it dies (a pytest killed with
    SIGKILL would otherwise leave its ranks running, some of them spinning in gloo)."""
    parent = multiprocessing.parent_process()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent.pid:  # it died before the prctl took effect
        os._exit(1)


def _worker(rank: int, world_size: int, tasks: Any, results: Any) -> None:
    _die_with_parent()
    import torch
    import torch.distributed as dist

    from lowband.comm import default_ledger

    results.put((0, rank, True, None, "ready"))  # imports done: the pool's start waits for this
    while True:
        item = tasks.get()
        if item is None:
            return
        call_id, fn, args, kwargs, store_path, pg_timeout_s = item
        phase = "init"
        try:
            torch.manual_seed(0)
            torch.set_default_dtype(torch.float32)
            torch.set_num_threads(1)
            default_ledger().reset()
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=pg_timeout_s))
            phase = "run"
            results.put((call_id, rank, True, None, "joined"))
            try:
                value = fn(*args, **kwargs)
            finally:
                dist.destroy_process_group()
            results.put((call_id, rank, True, value, phase))
        except BaseException:
            results.put((call_id, rank, False, traceback.format_exc(), phase))
        _free_dead_groups()


GLOO_THREAD_LIMIT = 64
"""A pooled rank runs Python's full collection after a call once it holds more gloo threads than this."""


def _free_dead_groups() -> None:
    """Process groups a call left in reference cycles (a ``Comm`` and its private ``Comm`` point at each other;
    a model and its optimizer) stay alive, each with gloo's loop and worker threads, until Python's full
    collection, which a test's small allocations rarely trigger: a pooled rank gathered hundreds of groups
    over a suite. A full collection (0.2 s) runs only when this process holds more than
    :data:`GLOO_THREAD_LIMIT` gloo threads (Linux: ``/proc/self/task``; elsewhere never)."""
    gloo = gloo_threads()
    if gloo is not None and gloo > GLOO_THREAD_LIMIT:
        gc.collect()


def gloo_threads() -> int | None:
    """Threads of this process that gloo runs (``gloo_tcp_loop``, ``pt_gloo_runloop``: a few per live process
    group), read from ``/proc/self/task``; ``None`` where that does not exist."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    gloo = 0
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                gloo += f.read().startswith(("gloo", "pt_gloo"))
        except OSError:  # the thread ended meanwhile
            pass
    return gloo


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, self.tasks[r], self.results),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()
        self.calls = 0
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Block until every rank has imported torch and lowband (seconds, minutes on a loaded machine), so
        that a call's process-group timeout covers only its rendezvous and ``fn``, never a slow spawn."""
        ready: set[int] = set()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(ready) < self.world_size:
            if time.monotonic() > deadline:
                self.close(kill=True)
                raise DistributedTestError(f"{self.world_size} rank processes did not start within "
                                           f"{READY_TIMEOUT_S:.0f}s (ranks {sorted(ready)} did)")
            try:
                _cid, rank, _ok, _value, phase = self.results.get(timeout=1.0)
            except queue.Empty:
                if not self.alive():
                    codes = [p.exitcode for p in self.procs]
                    self.close(kill=True)
                    raise DistributedTestError(f"a rank process died while starting (exit codes {codes})") from None
                continue
            if phase == "ready":
                ready.add(rank)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        for p, q in zip(self.procs, self.tasks, strict=True):
            if not kill and p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + (0 if kill else 5)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)


_POOLS: dict[int, _Pool] = {}
STARTUP_RETRIES = [0]
"""How many calls were retried on fresh processes after a failed process-group start (each replaces a pool)."""


def shutdown_pools() -> None:
    """Stop every pooled rank process (called at interpreter exit by the pytest plugin)."""
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()


@contextlib.contextmanager
def own_pools() -> Iterator[None]:
    """On exit, stop the rank pools created inside the block; pools that existed before belong to the
    caller (a test session calling ``lowband.bench``'s ``main``) and stay up for its next calls."""
    before = {id(pool) for pool in _POOLS.values()}
    try:
        yield
    finally:
        for world_size, pool in list(_POOLS.items()):
            if id(pool) not in before:
                pool.close()
                _POOLS.pop(world_size, None)


class _StartupFailure(DistributedTestError):
    """The process group could not be formed; ``fn`` did not run on the reporting rank."""


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
              timeout: float | None = None, pg_timeout: float | None = None,
              **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return per-rank results.

    Args:
        fn: an importable, module-level callable.
        world_size: number of ranks (1, 2, 4 ...).
        timeout: seconds for the whole call (default ``LOWBAND_TEST_TIMEOUT`` or 120).
        pg_timeout: process-group timeout in seconds (default: ``timeout``).

    Raises:
        DistributedTestError: with the first failing rank's traceback, or on timeout.

    If forming the process group itself fails (gloo's TCP mesh set-up occasionally fails with
    "connection closed by peer" on a loaded machine), the call is retried on fresh processes, up to
    :data:`MAX_STARTUP_RETRIES` times; ``fn`` had not started on the rank that reported it. A new pool's
    processes are waited for (:data:`READY_TIMEOUT_S`) before the call's own timeout starts.
    """
    for _attempt in range(MAX_STARTUP_RETRIES):
        try:
            return _run_ranks_once(fn, world_size, args, kwargs, timeout, pg_timeout)
        except _StartupFailure:
            STARTUP_RETRIES[0] += 1
    return _run_ranks_once(fn, world_size, args, kwargs, timeout, pg_timeout)


def _run_ranks_once(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict,
                    timeout: float | None, pg_timeout: float | None) -> list[Any]:
    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    pg_timeout = timeout if pg_timeout is None else pg_timeout
    use_pool = os.environ.get("LOWBAND_TEST_POOL", "1") != "0"
    pool = _POOLS.get(world_size) if use_pool else None
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close(kill=True)
        pool = _Pool(world_size)
        if use_pool:
            _POOLS[world_size] = pool
    pool.calls += 1
    call_id = pool.calls
    fd, store_path = tempfile.mkstemp(prefix="lowband_store_")
    os.close(fd)
    os.unlink(store_path)
    for q in pool.tasks:
        q.put((call_id, fn, args, kwargs, store_path, pg_timeout))
    results: dict[int, Any] = {}
    joined: set[int] = set()
    failure: tuple[int, str] | None = None
    startup_failed = False
    deadline = time.monotonic() + timeout
    join_window = min(RENDEZVOUS_TIMEOUT_S, timeout / 2) if timeout >= 20 else math.inf
    join_deadline = time.monotonic() + join_window
    healthy = True
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if failure is not None:
                # Give the other ranks a moment to fail on their own, then stop waiting.
                remaining = min(remaining, 3.0)
            if remaining <= 0:
                break
            if failure is None and len(joined) < world_size and time.monotonic() > join_deadline:
                missing = sorted(set(range(world_size)) - joined)
                failure = (missing[0], f"ranks {missing} did not form the process group within {join_window:.0f}s")
                startup_failed = True
                break
            try:
                cid, rank, ok, value, phase = pool.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if not pool.alive():
                    dead = [r for r, p in enumerate(pool.procs) if not p.is_alive()]
                    failure = failure or (dead[0], f"rank process {dead} died (exit codes "
                                          f"{[pool.procs[r].exitcode for r in dead]})")
                    break
                continue
            if cid != call_id:
                continue
            if phase == "joined":
                joined.add(rank)
                continue
            if phase == "init":  # failed while joining: counts as joined for the rendezvous deadline
                joined.add(rank)
            if ok:
                results[rank] = value
            else:
                results[rank] = None
                if failure is None:
                    failure = (rank, value)
                    startup_failed = phase == "init"
        if failure is not None:
            # Every rank reported (each left ``fn`` and destroyed its process group): the processes are
            # fine for the next call. A rank still inside ``fn`` (e.g. blocked in a collective its peer
            # left), or a failed start, takes the pool down.
            healthy = len(results) == world_size and not startup_failed
            error = _StartupFailure if startup_failed else DistributedTestError
            raise error(f"{fn.__module__}.{fn.__qualname__} failed on rank "
                                       f"{failure[0]} of {world_size}:\n{failure[1]}")
        if len(results) < world_size:
            healthy = False
            missing = sorted(set(range(world_size)) - set(results))
            raise DistributedTimeout(f"{fn.__module__}.{fn.__qualname__} timed out after "
                                       f"{timeout:.0f}s on {world_size} ranks; ranks {missing} did "
                                       "not finish")
        return [results[r] for r in range(world_size)]
    finally:
        if os.path.exists(store_path):
            try:
                os.unlink(store_path)
            except OSError:
                pass
        if not healthy or not use_pool:
            pool.close(kill=not healthy)
            _POOLS.pop(world_size, None)
