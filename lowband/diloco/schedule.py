"""The Streaming DiLoCo schedule: which fragment is prepared and synced after which inner step.

Pure functions, no state and no communication. With ``n`` fragments, ``sync_every`` ``H`` and delay
``tau`` (``0 <= tau < K``, ``K = H / n``), a private local step counts inner steps since the last sync
attempt. After the inner step that makes it ``K - tau`` the fragment ``committed % n`` is
*prepared* (pseudo-gradient computed, its all-reduce started); after the one that makes it ``K`` the
same fragment is *synced* (all-reduce waited, outer step, merge) and the local step returns to 0,
whether or not the sync committed. ``committed`` is the number of committed outer steps, so each
fragment is synced every ``H`` inner steps while every sync commits, and a failed sync retries the
same fragment ``K`` steps later. With ``tau = 0`` prepare and sync fall on the same step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

PREPARE = "prepare"
SYNC = "sync"


@dataclass(frozen=True)
class ScheduleConfig:
    """Validated schedule parameters.

    Attributes:
        num_fragments: n, at least 1.
        sync_every: H, a multiple of n.
        delay: tau, in ``[0, H / n)``.
    """

    num_fragments: int
    sync_every: int
    delay: int = 0

    def __post_init__(self) -> None:
        validate_schedule(self.num_fragments, self.sync_every, self.delay)

    @property
    def steps_per_fragment(self) -> int:
        """K = H / n: inner steps between two fragment syncs."""
        return self.sync_every // self.num_fragments


SCHEDULE_NAMES = {"num_fragments": "diloco num_fragments", "sync_every": "diloco sync_every", "delay": "diloco delay"}
"""How :func:`validate_schedule`'s messages call its arguments unless told otherwise."""


def validate_schedule(num_fragments: int, sync_every: int, delay: int, *,
                      names: Mapping[str, str] | None = None) -> None:
    """Raise ``ValueError`` naming the bad value unless ``n >= 1``, ``H`` is a positive multiple of ``n``
    and ``0 <= tau < H/n`` (``TypeError`` for a value that is not an int).

    The one check of these rules: :class:`ScheduleConfig` (so :class:`~lowband.diloco.StreamingDiLoCo`) and
    the trainer's config validation both call it.

    Args:
        names: how the message calls each argument, by argument name (``num_fragments``, ``sync_every``,
            ``delay``); the default is :data:`SCHEDULE_NAMES` (``"diloco num_fragments"`` ...). The trainer
            passes its config keys, e.g. ``{"num_fragments": "diloco.fragments"}``, for messages such as
            ``diloco.fragments must be >= 1; got 0``.
    """
    nm = {**SCHEDULE_NAMES, **(names or {})}
    for name, v in (("num_fragments", num_fragments), ("sync_every", sync_every), ("delay", delay)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{nm[name]} must be an int, got {v!r}")
    if num_fragments < 1:
        raise ValueError(f"{nm['num_fragments']} must be >= 1; got {num_fragments}")
    if sync_every < num_fragments or sync_every % num_fragments:
        raise ValueError(f"{nm['sync_every']} must be a positive multiple of {nm['num_fragments']} "
                         f"({num_fragments}); got {sync_every}")
    k = sync_every // num_fragments
    if not 0 <= delay < k:
        raise ValueError(f"{nm['delay']} must be in [0, {nm['sync_every']} / {nm['num_fragments']}) = [0, {k}); "
                         f"got {delay}")


def actions_at(local_step: int, cfg: ScheduleConfig) -> tuple[str, ...]:
    """Actions due right after the inner step that brought the local step to ``local_step``.

    Returns ``()``, ``("prepare",)``, ``("sync",)`` or ``("prepare", "sync")`` (``tau = 0``).
    """
    k = cfg.steps_per_fragment
    if not 1 <= local_step <= k:
        raise ValueError(f"diloco local_step={local_step} is outside [1, {k}]")
    out: tuple[str, ...] = ()
    if local_step == k - cfg.delay:
        out += (PREPARE,)
    if local_step == k:
        out += (SYNC,)
    return out


def fragment_for(committed: int, num_fragments: int) -> int:
    """The fragment synced next after ``committed`` committed outer steps."""
    return committed % num_fragments


def plan(total_steps: int, cfg: ScheduleConfig) -> list[tuple[int, str, int]]:
    """Every ``(inner step, action, fragment)`` for steps ``1..total_steps`` when every sync commits.

    Inner steps are counted from 1 (the first ``optimizer.step()``).
    """
    events: list[tuple[int, str, int]] = []
    local, committed = 0, 0
    for step in range(1, total_steps + 1):
        local += 1
        for action in actions_at(local, cfg):
            events.append((step, action, fragment_for(committed, cfg.num_fragments)))
            if action == SYNC:
                committed += 1
                local = 0
    return events
