"""Pure pieces of the goodput suite (no namespaces, no launches): what counts as a committed step, stalls,
heal times, goodput, the fault schedule and options, the result row, the target checks and the report.

The suite end to end (namespaces, a Lighthouse, kills) is the benchmark itself (``python -m lowband.bench
goodput``; its numbers are in docs/PERFORMANCE.md), not a test: a run with a fault must outlast a restarted
group's start-up, minutes on this machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowband.bench.goodput import check_options, contender_row, parse_faults, trainer_args
from lowband.bench.goodput_account import (
    Incarnation,
    committed_steps,
    goodput,
    heal_s,
    step_gaps,
    training_start,
)
from lowband.bench.goodput_report import goodput_markdown, target_checks
from tests.link.conftest import needs_netns


def _row(step: int, outer: int, total: int = 20, loss: float = 4.0) -> str:
    return f"step {step:>5}/{total} | loss {loss:.4f} | lr 3.00e-03 | tok/s 1,000 | outer_steps {outer} | ft_groups 2"


def _inc(group: int, index: int, launched: float, rows: list[tuple[float, str]], *, code: int | None = 0,
         killed: bool = False) -> Incarnation:
    inc = Incarnation(group, index, launched, lines=[(launched, "lowband.train: strategy diloco | world 1"), *rows])
    inc.exit_code, inc.killed = code, killed
    return inc


def test_a_killed_ft_launch_keeps_the_steps_up_to_its_last_commit() -> None:
    # sync every 4: outer_steps grows at steps 4 and 8; killed after step 10: steps 9 and 10 are lost
    rows = [(1.0 + s, _row(s, s // 4)) for s in range(1, 11)]
    killed = _inc(1, 0, 0.0, rows, code=-9, killed=True)
    assert committed_steps(killed, static=False) == 8
    # the same rows, finished normally: every row counts
    assert committed_steps(_inc(1, 0, 0.0, rows), static=False) == 10
    # killed before its first commit: nothing counts
    assert committed_steps(_inc(1, 0, 0.0, rows[:3], code=-9, killed=True), static=False) == 0


def test_a_heal_discards_what_the_launch_trained_before_it() -> None:
    # a restarted group trains steps 1-4 alone, heals at its sync to the peer's step 12, trains 13..20
    rows = [(10.0 + s, _row(s, 0)) for s in range(1, 5)]
    rows.append((15.0, "lowband.train: healed from a live peer at step 4: continuing at its step 12"))
    rows += [(15.0 + 0.5 * (s - 12), _row(s, s // 4)) for s in range(13, 21)]
    inc = _inc(1, 1, 8.0, rows)
    assert committed_steps(inc, static=False) == 8
    assert heal_s(inc) == pytest.approx(15.5 - 8.0)  # launch to its first step after the heal
    assert heal_s(_inc(0, 0, 0.0, rows[:4])) is None


def test_a_second_heal_keeps_what_earlier_commits_carried() -> None:
    # healed at its first sync (steps 1-4 lost), commits at steps 16 and 20, trains 21-22, its sync fails and it
    # is healed again to the peer's step 24: rows 13-20 were committed (8), 21-22 are overwritten; then 25-28
    rows = [(10.0 + s, _row(s, 0)) for s in range(1, 5)]
    rows.append((15.0, "lowband.train: healed from a live peer at step 4: continuing at its step 12"))
    rows += [(15.0 + 0.5 * (s - 12), _row(s, s // 4, total=28)) for s in range(13, 23)]
    rows.append((30.0, "lowband.train: healed from a live peer at step 22: continuing at its step 24"))
    rows += [(30.0 + 0.5 * (s - 24), _row(s, s // 4, total=28)) for s in range(25, 29)]
    assert committed_steps(_inc(1, 1, 8.0, rows), static=False) == 8 + 4
    # killed after step 26, before the commit at 28: the rows after the second heal do not count
    assert committed_steps(_inc(1, 1, 8.0, rows[:-2], code=-9, killed=True), static=False) == 8
    # heal time stays the first heal's
    assert heal_s(_inc(1, 1, 8.0, rows)) == pytest.approx(15.5 - 8.0)


def test_a_failed_static_launch_keeps_the_steps_up_to_its_last_checkpoint() -> None:
    rows = [(1.0 + s, _row(s, s // 4)) for s in range(1, 8)]
    rows.insert(5, (6.5, "lowband.train: checkpoint step-5 (0.01 s)"))
    failed = _inc(0, 0, 0.0, rows, code=1, killed=True)
    assert committed_steps(failed, static=True) == 5
    resumed = _inc(0, 1, 30.0, [(30.5, "lowband.train: resumed from /x/checkpoint/step-5 (step 5)"),
                                *[(31.0 + s, _row(s, s // 4)) for s in range(6, 9)]], code=1, killed=True)
    assert resumed.resumed_step() == 5 and committed_steps(resumed, static=True) == 0  # no checkpoint of its own


def test_stall_training_start_and_goodput() -> None:
    a = _inc(0, 0, 0.0, [(2.0, _row(1, 0)), (2.5, _row(2, 0)), (9.0, _row(3, 0)), (9.2, _row(4, 1))])
    b = _inc(1, 0, 0.0, [(3.0, _row(1, 0)), (3.1, _row(2, 0))])
    assert max(step_gaps([a, b])) == pytest.approx(6.5)
    assert training_start([a, b]) == 3.0
    assert training_start([a, _inc(1, 0, 0.0, [])]) is None  # group 1 has not stepped yet
    assert training_start([a, b, _inc(1, 1, 20.0, [])]) == 3.0  # a restart does not move it
    # 3 groups, 100 steps each in 50 s fault-free; the faulty run took 55 s and committed 270 steps
    assert goodput(270, 3, 100, 55.0, 50.0) == pytest.approx(270 / (300 * 1.1))
    with pytest.raises(ValueError, match="positive"):
        goodput(1, 3, 100, 0.0, 50.0)


def test_fault_schedule_and_options() -> None:
    assert parse_faults("1@0.3+0.1, 2@0.6+0.1") == [parse_faults("1@0.3+0.1")[0], parse_faults("2@0.6+0.1")[0]]
    f = parse_faults("2@0.6+0.15")[0]
    assert (f.group, f.at, f.down) == (2, 0.6, 0.15)
    assert parse_faults("none") == [] and parse_faults("") == []
    for bad in ("1@0.3", "x@0.3+0.1", "1@1.2+0.1", "1@0.3+0"):
        with pytest.raises(ValueError, match="--faults"):
            parse_faults(bad)
    opts = {"groups": 3, "contenders": "static,ft-topk-int2", "faults": "1@0.3+0.1", "steps": 10, "sync_every": 4,
            "fragments": 2, "static_checkpoint_every": 5, "static_wire": "topk-int2",
            "config": "configs/diloco-bench.toml"}
    contenders, faults = check_options(opts)
    assert contenders == ["static", "ft-topk-int2"] and faults[0].group == 1
    for key, value, match in (("groups", 1, "--groups"), ("contenders", "ft-zip", "--contenders: unknown ft-zip"),
                              ("faults", "3@0.3+0.1", "group 3 does not exist"), ("steps", 0, "--steps"),
                              ("static_wire", "zip", "--static-wire"), ("config", "nope.toml", "--config")):
        with pytest.raises(ValueError, match=match):
            check_options({**opts, key: value})


def test_trainer_arguments_of_each_contender() -> None:
    opts = {"groups": 3, "steps": 40, "sync_every": 4, "fragments": 2, "static_wire": "topk-int2",
            "static_checkpoint_every": 10, "pg_timeout": 30.0, "quorum_timeout": 20.0,
            "config": "configs/diloco-bench.toml"}
    ft = trainer_args(opts, "ft-int4", Path("/w"), "g1-i2")
    assert "--diloco.wire=int4" in ft and "--ft.enabled=true" in ft and "--ft.groups=3" in ft
    assert "--diloco.num_replicas=1" in ft and "--run.name=g1-i2" in ft and "--run.log_every=1" in ft
    assert "--ft.quorum_timeout_s=20.0" in ft and not any(a.startswith("--checkpoint") for a in ft)
    static = trainer_args(opts, "static", Path("/w"), "job")
    assert "--diloco.wire=topk-int2" in static and "--diloco.num_replicas=3" in static
    assert "--run.world_size=3" in static and "--checkpoint.every=10" in static
    assert not any(a.startswith("--ft.") for a in static)


def _scenario(run_s: float, committed: list[int], val: float, kills: int = 0, rejoins: int = 0,
              stall: float = 0.5, equal: bool = True) -> dict:
    return {"run_s": run_s, "committed_steps": committed, "kills": kills, "rejoins": rejoins, "max_stall_s": stall,
            "heal_s_each": [4.0] * rejoins, "heal_s": 4.0 if rejoins else None, "median_step_gap_s": 0.1,
            "wire_bytes_total": 3_000_000, "iface_tx_bytes_total": 3_300_000, "replicas_bitwise_equal": equal,
            "final_val_loss": val, "finished": True, "events": [(12.0, "kill", 1), (16.0, "start", 1)][: 2 * kills],
            "curves": {"g0-i0": [[1.0, 1, 5.0], [40.0, 100, 3.0]]}, "load_avg": [[run_s / 10, 0, 0], [1.0, 0, 0]]}


def test_rows_targets_and_report() -> None:
    opts = {"groups": 3, "steps": 100}
    ff = _scenario(40.0, [100, 100, 100], 3.00)
    rows = [contender_row(opts, "static", "10mbit", ff, _scenario(80.0, [100, 100, 100], 3.00, kills=2, rejoins=2)),
            contender_row(opts, "ft-topk-int2", "10mbit", ff,
                          _scenario(41.0, [100, 88, 90], 3.05, kills=2, rejoins=2, stall=5.0)),
            {"name": "ft-int8@10mbit", "contender": "ft-int8", "bandwidth": "10mbit", "error": "boom"}]
    static, ft = rows[0], rows[1]
    assert static["goodput"] == pytest.approx(0.5) and ft["goodput"] == pytest.approx(278 / (300 * 41 / 40))
    assert ft["val_loss_ratio"] == pytest.approx(3.05 / 3.0) and ft["wire_bytes_per_step_per_rank"] == 10_000
    doc = {"torch": "x", "results": rows,
           "config": {"groups": 3, "bandwidths": ["10mbit"], "faults": [{"group": 1, "at": 0.3, "down": 0.1},
                                                                       {"group": 2, "at": 0.6, "down": 0.1}],
                      "config": "c.toml", "steps": 100, "sync_every": 4, "fragments": 2, "static_wire": "topk-int2",
                      "static_checkpoint_every": 50, "quorum_timeout_s": 60.0, "heartbeat_timeout_ms": 2000}}
    checks = target_checks(doc, "10mbit")
    assert checks[0] == f"10mbit: ft-topk-int2 goodput {ft['goodput']:.3f} (>= 0.9): met"
    assert checks[1].startswith("10mbit: ft-topk-int2 goodput / static's 0.500 = 1.81") and checks[1].endswith("MISSED")
    assert checks[2].endswith("met") and checks[3].endswith("met") and checks[4].endswith("met")
    assert checks[5] == "10mbit: ft-topk-int2 kills 2, rejoins 2 (the schedule has 2): met"
    md = goodput_markdown(doc)
    assert "| yes | 4.0-1.0; 4.1-1.0 |" in md  # the load average around each of its two runs
    assert "Incomplete" not in md
    assert "**Incomplete**: interrupted during ft-int4" in goodput_markdown(
        {**doc, "config": {**doc["config"], "interrupted": "interrupted during ft-int4 at 10mbit (SystemExit)"}})
    assert "| ft-topk-int2 | 0.904 |" in md and "| ft-int8 | error: boom |" in md and "MISSED" in md
    # a run whose groups ended apart, or that lost a rejoin, fails those checks
    bad = contender_row(opts, "ft-int4", "10mbit", ff, _scenario(41.0, [100, 88, 90], 3.2, kills=2, rejoins=1,
                                                                 equal=False))
    lines = target_checks({**doc, "results": [bad]}, "10mbit")
    assert lines[1].endswith("not checked") and lines[2].endswith("MISSED") and lines[3].endswith("MISSED")
    assert lines[5].endswith("MISSED")


@needs_netns
def test_an_interrupt_keeps_the_contenders_that_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGINT / SIGTERM during the second contender: the first one's row is returned, the run says where it
    stopped (no namespace is built here: the runs themselves are replaced)."""
    from lowband.bench import goodput as suite

    def fake(opts, contender, rate, faults, fault_free_s, work, logdir):  # type: ignore[no-untyped-def]
        if contender == "ft-int8":
            raise KeyboardInterrupt
        return _scenario(40.0, [100, 100], 3.0, kills=len(faults), rejoins=len(faults))

    monkeypatch.setattr(suite, "run_scenario", fake)
    opts = {"groups": 2, "contenders": "ft-topk-int2,ft-int8,static", "faults": "1@0.3+0.1", "steps": 100,
            "sync_every": 4, "fragments": 1, "static_checkpoint_every": 50, "static_wire": "topk-int2",
            "config": "configs/diloco-bench.toml", "bandwidths": "10mbit", "quorum_timeout": 60.0, "pg_timeout": 60.0,
            "heartbeat_timeout_ms": 5000, "join_timeout_ms": 60000, "mtu": 1500}
    body = suite.launch(opts, tmp_path / "goodput")
    assert [r["contender"] for r in body["results"]] == ["ft-topk-int2"]
    assert body["config"]["interrupted"] == "interrupted during ft-int8 at 10mbit (KeyboardInterrupt)"
