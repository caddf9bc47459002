"""Goodput accounting of the ``goodput`` suite: from what each launch printed, and when, to the suite's figures.

Every launch of a replica group (an *incarnation*: a group is launched once, and again after each kill) is
read from its stdout, each line stamped with the launcher's clock when it arrived (:class:`Incarnation`).
The trainer prints one row per inner step (``run.log_every = 1``)::

    step    37/400 | loss ... | outer_steps 9 | ft_groups 3 | ...
    lowband.train: healed from a live peer at step 5: continuing at its step 36
    lowband.train: checkpoint step-50 (0.12 s)

What counts (:func:`committed_steps`):

* a heal overwrites what the incarnation trained since its last commit before the heal (a group restarted
  from nothing has committed nothing then: every row before its first heal is lost; a live group healed
  again after a failed sync keeps the rows its earlier commits carried into the global copies);
* a fault-tolerant incarnation that was killed keeps the rows up to its last *commit* (the row where
  ``outer_steps`` last grew: the steps before it reached the global copies); the rows after it are lost;
* a ``static`` incarnation that failed keeps the rows up to its last checkpoint (the next launch resumes
  from there and trains the rest again);
* an incarnation that finished keeps every row after its last heal.

:func:`step_gaps` are the gaps between consecutive step rows of each incarnation; the longest is the row's
``max_stall_s`` (a live group that made no step: a failed sync, a quorum wait, a heal); :func:`heal_s` is,
for an incarnation that healed from a peer, the time from its launch to its first row after the heal.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

_STEP = re.compile(r"^step\s+(\d+)/(\d+) \| loss ")
_OUTER = re.compile(r"\| outer_steps (\d+)")
_HEAL = re.compile(r"healed from a live peer at step (\d+): continuing at its step (\d+)")
_CKPT = re.compile(r"^lowband\.train: checkpoint step-(\d+) ")
_RESUMED = re.compile(r"^lowband\.train: resumed from .* \(step (\d+)\)")
_VAL = re.compile(r"^step\s+(\d+)/\d+ \| val_loss ([0-9.eE+-]+|nan|inf)")


@dataclass
class Incarnation:
    """One launch of one replica group (or, for ``static``, of the whole job: its rank 0's lines).

    ``lines`` holds ``(t, text)`` with ``t`` seconds on the launcher's clock since the scenario started.
    """

    group: int
    index: int
    launched_t: float
    lines: list[tuple[float, str]] = field(default_factory=list)
    ended_t: float | None = None
    exit_code: int | None = None
    killed: bool = False
    wire_bytes: int = 0
    """Ledger wire bytes of its rank 0 (from its ``metrics.jsonl`` when it ended)."""

    @property
    def finished(self) -> bool:
        """Ended by itself with exit code 0."""
        return self.exit_code == 0 and not self.killed

    def rows(self) -> list[tuple[float, int, int | None]]:
        """``(t, step, outer_steps)`` of every step row, in order (``outer_steps`` None when not printed)."""
        out = []
        for t, text in self.lines:
            m = _STEP.match(text)
            if m:
                o = _OUTER.search(text)
                out.append((t, int(m.group(1)), int(o.group(1)) if o else None))
        return out

    def heals(self) -> list[tuple[float, int]]:
        """``(t, continuing step)`` of every heal line (the first step row after it is that step + 1)."""
        return [(t, int(m.group(2))) for t, text in self.lines if (m := _HEAL.search(text))]

    def checkpoints(self) -> list[int]:
        return [int(m.group(1)) for _, text in self.lines if (m := _CKPT.match(text))]

    def resumed_step(self) -> int:
        """The step this incarnation resumed from its own checkpoint (0 = fresh)."""
        return next((int(m.group(1)) for _, text in self.lines if (m := _RESUMED.match(text))), 0)

    def final_val_loss(self) -> float | None:
        vals = [float(m.group(2)) for _, text in self.lines if (m := _VAL.match(text))]
        return vals[-1] if vals else None


def _up_to_last_commit(rows: list[tuple[float, int, int | None]]) -> int:
    """Rows up to the last one whose ``outer_steps`` grew over the row before it (0 when it never grew)."""
    keep = 0
    for i in range(1, len(rows)):
        before, now = rows[i - 1][2], rows[i][2]
        if before is not None and now is not None and now > before:
            keep = i + 1
    return keep


def committed_steps(inc: Incarnation, static: bool) -> int:
    """The inner steps of ``inc`` that survive (see the module docstring)."""
    if static:  # one job, resumed from its checkpoints: nothing heals it
        rows = inc.rows()
        if inc.finished:
            return len(rows)
        last = max(inc.checkpoints(), default=inc.resumed_step())
        return sum(1 for _, step, _ in rows if step <= last)
    # the rows between heals: each heal keeps what a commit before it carried into the global copies and
    # overwrites the rest; after the last heal, a finished launch keeps every row, a killed one up to its last commit
    segments: list[list[tuple[float, int, int | None]]] = [[]]
    heal_times = [t for t, _ in inc.heals()]
    for row in inc.rows():
        while heal_times and row[0] >= heal_times[0]:
            heal_times.pop(0)
            segments.append([])
        segments[-1].append(row)
    kept = sum(_up_to_last_commit(seg) for seg in segments[:-1])
    return kept + (len(segments[-1]) if inc.finished else _up_to_last_commit(segments[-1]))


def training_start(incarnations: list[Incarnation]) -> float | None:
    """When every first launch (index 0) has printed its first step row (``None`` before that): the clock of
    the fault schedule and of ``run_s`` starts here, so that start-up (imports, rendezvous) is in neither."""
    first = [inc for inc in incarnations if inc.index == 0]
    starts = [inc.rows()[0][0] if inc.rows() else None for inc in first]
    return None if not starts or None in starts else max(starts)  # type: ignore[type-var]


def step_gaps(incarnations: list[Incarnation]) -> list[float]:
    """Every gap between two consecutive step rows of one incarnation, over all of them."""
    return [b[0] - a[0] for inc in incarnations for a, b in itertools.pairwise(inc.rows())]


def heal_s(inc: Incarnation) -> float | None:
    """Launch to the first step row after the incarnation's first heal; ``None`` when it never healed."""
    heals = inc.heals()
    if not heals:
        return None
    after = [r for r in inc.rows() if r[0] >= heals[0][0]]
    return (after[0][0] - inc.launched_t) if after else None


def goodput(committed_total: int, groups: int, steps: int, run_s: float, fault_free_s: float) -> float:
    """Committed inner steps over all groups / (``groups`` x the steps a fault-free run makes in ``run_s``).

    The fault-free run made ``steps`` steps per group in ``fault_free_s`` (launch to its last step row); in
    ``run_s`` it would make ``steps * run_s / fault_free_s`` (its rate taken as constant)."""
    if run_s <= 0 or fault_free_s <= 0:
        raise ValueError(f"run times must be positive; got {run_s} and {fault_free_s}")
    return committed_total / (groups * steps * run_s / fault_free_s)
