"""What a failed or stopped trainer process tells a person: one line, a documented exit code, a log.

Every exception that ends ``python -m lowband.train`` is classified into an :class:`Outcome`:

=========  ====  =====================================================================================
kind       exit  meaning
=========  ====  =====================================================================================
input      2     a bad config value, data file, checkpoint to load, or a run directory in use; raised
                 before the first training collective and alike on every rank
failed     1     the run failed while training: non-finite steps, a checkpoint save or the final model export
                 that failed (a full disk, ...), ranks whose weights drifted apart
                 (``run.check_replicas_every``, :mod:`lowband.consistency`)
peer       1     a collective failed because another rank died or hung (a consequence, not a cause)
died       1     (launcher only) a rank process ended by a signal or without reporting
unexpected 1     any other exception (a bug): the line names the type; the traceback is in the log
stopped    128+s stopped by signal ``s`` (SIGINT 130, SIGTERM 143), cleanly at a step boundary
=========  ====  =====================================================================================

The one line is ``lowband.train: error: <message>`` (``stopped`` outcomes: ``lowband.train: <message>``);
the launcher adds ``rank R of N:`` when not every rank reported the same message. The full traceback
goes to ``<run_dir>/logs/rank<R>.log`` (appended, with a timestamp) and, with ``--debug`` or
``LOWBAND_DEBUG=1``, to stderr as well.

No communication.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INPUT = 2
PREFIX = "lowband.train"

# Sort order of kinds in the launcher's summary: causes first, consequences last.
KIND_ORDER = {"input": 0, "failed": 1, "unexpected": 1, "died": 2, "peer": 3, "stopped": 4}


class ConfigError(ValueError):
    """A bad config value; the message names the field and the allowed values.

    Defined here, in a module with no lowband imports, so that the config sections in the strategy modules
    and :mod:`lowband.train.config` (which re-exports it) can both raise it without an import cycle.
    """


class StopRequested(Exception):
    """The run stopped at a step boundary because of a signal (every rank agreed on the step)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


def warn(line: str) -> None:
    """Print ``lowband.train: warning: <line>`` to stderr (one line)."""
    import sys

    print(f"{PREFIX}: warning: {line}", file=sys.stderr, flush=True)


def debug_enabled(argv_flag: bool = False) -> bool:
    """``--debug`` or ``LOWBAND_DEBUG`` set to anything but ``""``/``0``: print tracebacks to stderr."""
    return argv_flag or os.environ.get("LOWBAND_DEBUG", "") not in ("", "0")


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass
class Outcome:
    """How one process ended: exit ``code``, ``kind`` (see the module table) and the one-line ``message``."""

    code: int
    kind: str
    message: str
    rank: int = 0
    world_size: int = 1

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> Outcome:
        return Outcome(**json.loads(text))


def _first_line(text: str) -> str:
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[0].strip() if lines else ""


def _loaded_classes(*names: tuple[str, str]) -> tuple[type, ...]:
    """The classes ``(module, name)`` of modules already imported (others cannot have raised)."""
    out = []
    for mod, name in names:
        cls = getattr(sys.modules.get(mod), name, None)
        if isinstance(cls, type):
            out.append(cls)
    return tuple(out)


def classify(exc: BaseException, rank: int = 0, world_size: int = 1, log_path: Path | None = None) -> Outcome:
    """The :class:`Outcome` of an exception that ended a trainer process."""
    # An exception can only be an instance of a class whose module is already imported, so the error
    # classes are looked up in sys.modules: a config error in the launcher never imports torch for this.
    failed = _loaded_classes(("lowband.train.checkpoint", "CheckpointSaveError"),
                             ("lowband.train.guards", "NonFiniteStepError"), ("lowband.train.export", "ExportError"),
                             ("lowband.consistency", "ReplicaDivergenceError"), ("lowband.diloco.ft", "FtQuorumError"))
    bad_input = (ConfigError, *_loaded_classes(("lowband.data.shards", "ShardError"),
                                               ("lowband.train.checkpoint", "CheckpointError"),
                                               ("lowband.train.lock", "LockError"),
                                               ("lowband.diloco.ft_group", "LighthouseUnreachableError"),
                                               ("lowband.diloco.ft", "FtSettingsError")))
    peer = _loaded_classes(("lowband.train.guards", "PeerFailureError"))
    if isinstance(exc, StopRequested):
        return Outcome(128 + exc.signum, "stopped", str(exc), rank, world_size)
    if isinstance(exc, KeyboardInterrupt):
        return Outcome(128 + signal.SIGINT, "stopped", "stopped at once by a second SIGINT/SIGTERM "
                       "(no final checkpoint)", rank, world_size)
    if isinstance(exc, failed):
        return Outcome(EXIT_FAILED, "failed", _first_line(str(exc)), rank, world_size)
    if isinstance(exc, bad_input):
        return Outcome(EXIT_INPUT, "input", _first_line(str(exc)), rank, world_size)
    if isinstance(exc, peer):
        return Outcome(EXIT_FAILED, "peer", _first_line(getattr(exc, "detail", str(exc))), rank, world_size)
    where = f"; traceback in {log_path.parent}/" if log_path is not None else ""
    text = _first_line(str(exc))
    return Outcome(EXIT_FAILED, "unexpected",
                   f"unexpected {type(exc).__name__}{': ' + text[:300] if text else ''} (not a lowband "
                   f"error; please report it{where}, or rerun with --debug to print it)", rank, world_size)


def format_line(outcome: Outcome, qualifier: str = "") -> str:
    """``lowband.train: error: [qualifier: ]message`` (``stopped``: ``lowband.train: message``)."""
    head = f"{PREFIX}: " if outcome.kind == "stopped" else f"{PREFIX}: error: "
    return head + (f"{qualifier}: " if qualifier else "") + outcome.message


def log_path_for(run_dir: Path | None, rank: int) -> Path | None:
    return None if run_dir is None else run_dir / "logs" / f"rank{rank}.log"


def append_log(path: Path | None, text: str) -> bool:
    """Append ``text`` (with a UTC timestamp) to ``path``; ``False`` when it cannot be written."""
    if path is None:
        return False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as fh:
            fh.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} pid {os.getpid()}\n{text}")
            if not text.endswith("\n"):
                fh.write("\n")
        return True
    except OSError:
        return False


def traceback_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def ranks_phrase(ranks: list[int], world_size: int) -> str:
    """``rank 1 of 4`` / ``ranks 0, 2 of 4`` / ``ranks 0-2 of 4``."""
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]} of {world_size}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"ranks {ranks[0]}-{ranks[-1]} of {world_size}"
    return f"ranks {', '.join(map(str, ranks))} of {world_size}"


def summarize(outcomes: list[Outcome], world_size: int) -> tuple[int, list[str]]:
    """The exit code and one line per distinct message of the ranks' outcomes (launcher).

    Identical messages are merged; a message every rank reported carries no rank qualifier, so the
    same error reads the same at one rank and at many. Causes come before consequences (``peer``
    lines, then ``stopped``); the exit code is that of the first line (0 when nothing failed).
    """
    bad = [o for o in outcomes if o.code != EXIT_OK]
    if not bad:
        return EXIT_OK, []
    groups: dict[tuple[str, str], list[Outcome]] = {}
    for o in bad:  # peer failures are consequences: one line for all of them (the lowest rank's words)
        groups.setdefault((o.kind, "" if o.kind == "peer" else o.message), []).append(o)
    ordered = sorted(groups.values(), key=lambda g: (KIND_ORDER.get(g[0].kind, 1), min(o.rank for o in g)))
    lines = []
    for g in ordered:
        ranks = [o.rank for o in g]
        qualifier = "" if len(set(ranks)) == world_size else ranks_phrase(ranks, world_size)
        lines.append(format_line(g[0], qualifier))
    return ordered[0][0].code, lines
