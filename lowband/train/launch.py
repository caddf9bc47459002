"""The CLI's self-launcher: start ``run.world_size`` CPU ranks on this machine, supervise, summarize.

``python -m lowband.train`` without ``torchrun`` and with ``run.world_size > 1`` comes here after the
config validated. The launcher (one process):

1. prints the cores warning, runs the local pre-flight checks (``lowband.train.preflight``: device,
   data, directories) and locks the run directory (``lowband.train.lock``); a problem exits 2 with one
   line before any rank starts;
2. starts every rank as ``python -m lowband.train <same arguments>`` in its own process group, with
   ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set, a ``FileStore`` rendezvous in a private temporary folder
   (``LOWBAND_INIT_METHOD``), and ``LOWBAND_LAUNCHER_PID`` (each rank dies with the launcher:
   ``lowband.train.stop.watch_parent``), and ``LOWBAND_REPORT_FILE`` where the rank leaves its
   :class:`~lowband.train.errors.Outcome`;
3. forwards SIGINT and SIGTERM to every rank once (they stop together after the same step, with a final
   checkpoint when checkpointing is on) and waits; a second signal kills the ranks. A signal that comes
   before every rank has installed its handlers (``LOWBAND_READY_FILE``; they are still importing
   torch, nothing has trained) kills the ranks at once;
4. when a rank fails, gives the others ``FAIL_GRACE_S`` to report their own errors, then SIGTERM and,
   ``KILL_GRACE_S`` later, SIGKILL;
5. prints one line per distinct error (``lowband.train.errors.summarize``) and returns the exit code,
   the same one a single rank would have returned.

Ranks print their own stdout (rank 0 logs) and any warning directly; the launcher prints the error
lines. No torch elastic agent is involved, so no ``ChildFailedError`` report. No communication.

The temporary folder is removed on every exit path: by the launcher itself, or, when the launcher is killed
(SIGKILL, the OOM killer, a job scheduler), by a small janitor process in its own session
(:func:`start_janitor`) that sees the launcher's end of a pipe close.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from lowband.train.config import Config
from lowband.train.errors import EXIT_FAILED, Outcome, log_path_for, signal_name, summarize, warn

FAIL_GRACE_S = 10.0
"""After a rank fails, how long the others get to end (and report) on their own."""
KILL_GRACE_S = 5.0
"""After SIGTERM, how long before SIGKILL."""
POLL_S = 0.05


class _Signals:
    """Signals received by the launcher, in order (the handler only records)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._old: dict[int, object] = {}

    def install(self) -> None:
        for s in (signal.SIGINT, signal.SIGTERM):
            self._old[s] = signal.signal(s, self._handle)

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)


def _send(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass


def _read_outcome(path: Path, rank: int, world: int, proc: subprocess.Popen, run_dir: Path,
                  killed_by_us: bool) -> Outcome | None:
    try:
        return Outcome.from_json(path.read_text())
    except (OSError, ValueError, TypeError):
        pass
    code = proc.returncode
    if code == 0 or killed_by_us:
        return None
    log = log_path_for(run_dir, rank)
    if code is not None and code < 0:
        what = f"the rank process was killed by {signal_name(-code)} without reporting an error"
        hint = " (out of memory? see dmesg)" if -code == signal.SIGKILL else ""
    else:
        what, hint = f"the rank process exited with code {code} without reporting an error", ""
    return Outcome(EXIT_FAILED, "died", f"{what}{hint}; its log: {log}", rank, world)


def launch(argv: list[str], cfg: Config) -> int:
    """Run ``cfg.run.world_size`` ranks of ``python -m lowband.train argv``; return the exit code."""
    from lowband.train import preflight
    from lowband.train.lock import acquire_all

    world = cfg.run.world_size
    preflight.local_checks(cfg, world, world)
    locks = acquire_all(preflight.lock_dirs(cfg))
    for lk in locks:
        for line in lk.warnings:
            warn(line)
    try:
        preflight.check_run_outputs(cfg)
    except BaseException:
        for lk in locks:
            lk.release()
        raise
    work = Path(tempfile.mkdtemp(prefix="lowband-launch-"))
    janitor = start_janitor(work)
    sigs = _Signals()
    sigs.install()
    try:
        return _supervise(argv, cfg, work, sigs)
    finally:
        sigs.restore()
        for lk in locks:
            lk.release()
        shutil.rmtree(work, ignore_errors=True)
        stop_janitor(janitor)


JANITOR_CODE = """import shutil, sys, time
if sys.stdin.buffer.read() != b"done":  # the launcher died without removing its folder
    for _ in range(2):  # again after its ranks (killed with it: PR_SET_PDEATHSIG) surely stopped writing
        shutil.rmtree(sys.argv[1], ignore_errors=True)
        time.sleep(5)
"""


def start_janitor(work: Path) -> subprocess.Popen | None:
    """A process in its own session (a kill of the launcher's process group does not reach it) that removes
    ``work`` when the launcher's end of its stdin pipe closes without the word ``done``: the launcher was killed
    before its own ``finally`` ran. ``None`` if it could not start (the launcher still removes ``work`` on every
    exit path it lives through)."""
    try:
        return subprocess.Popen([sys.executable, "-I", "-S", "-c", JANITOR_CODE, str(work)], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        return None


def stop_janitor(janitor: subprocess.Popen | None) -> None:
    """Tell the janitor the folder is gone (it exits at once) and reap it."""
    if janitor is None or janitor.stdin is None:
        return
    try:
        janitor.stdin.write(b"done")
        janitor.stdin.close()
        janitor.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        janitor.kill()


def _supervise(argv: list[str], cfg: Config, work: Path, sigs: _Signals) -> int:
    world = cfg.run.world_size
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    base = dict(os.environ, WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0",
                MASTER_ADDR="127.0.0.1", LOWBAND_LAUNCHER_PID=str(os.getpid()), LOWBAND_LAUNCHED="1",
                LOWBAND_INIT_METHOD=f"file://{work / 'store'}")
    if "LOWBAND_DEBUG" not in os.environ or os.environ["LOWBAND_DEBUG"] in ("", "0"):
        base.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # gloo's C++ warnings; --debug keeps them
    procs: list[subprocess.Popen] = []
    for r in range(world):
        env = dict(base, RANK=str(r), LOCAL_RANK=str(r), LOWBAND_REPORT_FILE=str(work / f"rank{r}.json"),
                   LOWBAND_READY_FILE=str(work / f"rank{r}.ready"))
        procs.append(subprocess.Popen([sys.executable, "-m", "lowband.train", *argv], env=env, process_group=0))
    handled = 0
    fail_at: float | None = None
    term_at: float | None = None
    kill_at: float | None = None
    killed_by_us = [False] * world
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        while handled < len(sigs.received):
            sig = sigs.received[handled]
            handled += 1
            if handled == 1 and all((work / f"rank{r}.ready").exists() for r in range(world)):
                _send(procs, sig)  # ranks agree on the step and stop cleanly
                kill_at = now + cfg.run.timeout_s + 30.0
            elif handled == 1:  # some rank is still starting: nothing has trained, nothing to save
                kill_at = now
            else:  # a second signal: kill every rank now (no final checkpoint)
                kill_at = now
        if fail_at is None and any(p.returncode not in (None, 0) for p in procs):
            fail_at = now
        if fail_at is not None and term_at is None and now - fail_at > FAIL_GRACE_S:
            for r, p in enumerate(procs):
                if p.poll() is None:
                    killed_by_us[r] = True
            _send(procs, signal.SIGTERM)
            term_at = now
            kill_at = min(kill_at or now + KILL_GRACE_S, now + KILL_GRACE_S)
        if kill_at is not None and now >= kill_at:
            for r, p in enumerate(procs):
                if p.poll() is None:
                    killed_by_us[r] = True
            _send(procs, signal.SIGKILL)
            kill_at = now + 3600.0
        time.sleep(POLL_S)
    outcomes = [o for r, p in enumerate(procs)
                if (o := _read_outcome(work / f"rank{r}.json", r, world, p, run_dir, killed_by_us[r])) is not None]
    if sigs.received and any(killed_by_us):
        outcomes = [Outcome(128 + sigs.received[0], "stopped", f"stopped by {signal_name(sigs.received[0])}: "
                            "the ranks were killed (before training started, or after a second signal)", 0,
                            world)]
    code, lines = summarize(outcomes, world)
    for line in lines:
        print(line, file=sys.stderr, flush=True)
    return code
