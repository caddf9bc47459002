"""Fault-tolerant DiLoCo in the trainer: each replica group is its own ``python -m lowband.train`` launch
with an ``[ft]`` section, meeting the others through a Lighthouse (here in the test process).

* a group SIGKILLed mid-run and started again with the same command heals from the live group (model,
  inner optimizer, DiLoCo state, the trainer's step and LR position) and both end with bitwise equal
  models, while the survivor ran every step in one process;
* groups whose settings differ are refused at their first quorum, on both, naming the key (exit 2);
* a Lighthouse that is unreachable at start is one line and exit 2; one that disappears during training
  ends the run after ``ft.quorum_timeout_s`` with one line and exit 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torchft._torchft import LighthouseServer

from tests.cli.cli_util import RUN_TIMEOUT_S, cli_args, cli_env

# tests/cli's tiny run (tiny.toml) as one replica group of a fault-tolerant DiLoCo run
FT_OVERRIDES = ("--run.timeout_s=60", "--strategy.name=diloco", "--diloco.num_replicas=1", "--diloco.sync_every=4",
                "--diloco.fragments=1", "--diloco.delay=1", "--ft.enabled=true", "--ft.groups=2",
                "--ft.host=127.0.0.1", "--ft.timeout_s=20", "--ft.connect_timeout_s=20")


class Group:
    """One replica group's launch; its stdout lines and its stderr are collected as they come, each by a thread of
    its own (nothing else reads the pipes: ``communicate()`` beside the reader took lines from it and closed the file
    under it)."""

    def __init__(self, cwd: Path, group: int, url: str, *overrides: str, steps: int,
                 hold: tuple[Path, ...] = ()) -> None:
        args = cli_args(*FT_OVERRIDES, f"--run.steps={steps}", f"--run.name=g{group}", f"--ft.group={group}",
                        f"--ft.lighthouse={url}", *overrides)
        env = {"RUST_LOG": "error", "LOWBAND_TEST_HOLD": os.pathsep.join(map(str, hold))}
        self.proc = subprocess.Popen(args, cwd=cwd, env=cli_env(env), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.stderr = ""  # all of it, once the process closed it
        self._readers = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._read_err, daemon=True)]
        for r in self._readers:
            r.start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line.rstrip("\n"))

    def _read_err(self) -> None:
        self.stderr = self.proc.stderr.read()  # type: ignore[union-attr]

    def _wait(self, timeout: float | None) -> None:
        """The process ended (or ``TimeoutExpired``) and both pipes were read to their end."""
        self.proc.wait(timeout=timeout)
        for r in self._readers:
            r.join(10)

    def wait_for(self, predicate, what: str) -> str:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + RUN_TIMEOUT_S
        seen = 0
        while time.monotonic() < deadline:
            while seen < len(self.lines):
                seen += 1
                if predicate(self.lines[seen - 1]):
                    return self.lines[seen - 1]
            if self.proc.poll() is not None and seen == len(self.lines):
                self._wait(None)
                if seen == len(self.lines):
                    raise AssertionError(f"the group ended (exit {self.proc.returncode}) before {what}:\n"
                                         + "\n".join(self.lines[-20:]) + "\n" + self.stderr)
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def finish(self) -> tuple[int, str]:
        self._wait(RUN_TIMEOUT_S)
        return self.proc.returncode, self.stderr

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self._wait(None)


def _outer_steps(line: str) -> int:
    return int(line.split("outer_steps ", 1)[1].split()[0]) if "outer_steps " in line else -1


@pytest.fixture
def lighthouse():  # type: ignore[no-untyped-def]
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=30_000, heartbeat_timeout_ms=1_000)
    try:
        yield server, "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]
    finally:
        try:
            server.shutdown()
        except Exception:  # a test already shut it down
            pass


def test_killed_group_rejoins_heals_and_ends_equal(tiny: Path, lighthouse) -> None:  # type: ignore[no-untyped-def]
    _, url = lighthouse
    steps = 48  # a multiple of sync_every: both groups end on a sync, their models then equal the global copy
    # both groups train lowband's GPT through a factory whose forward waits while a file it was given exists:
    # `start` holds both until both are up (their torchft Managers heartbeat), so that on a busy machine one
    # group does not run all its steps before the other has imported torch; `hold` holds group 0 below
    held = ["--model.factory=tests.cli.ft_hold:held_gpt"]
    start, hold = tiny / "start", tiny / "hold"
    start.touch()
    g0 = Group(tiny, 0, url, *held, steps=steps, hold=(start, hold))
    g1 = Group(tiny, 1, url, *held, steps=steps, hold=(start,))
    groups = [g0, g1]
    try:
        for g in groups:
            g.wait_for(lambda ln: ln.startswith("lowband.train: strategy diloco"), "the group's start")
        start.unlink()
        # both groups trained together (either may still have reached its first quorum alone)
        g1.wait_for(lambda ln: _outer_steps(ln) >= 2 and "ft_groups 2 " in ln, "2 outer steps of both groups")
        before_kill = g0.wait_for(lambda ln: _outer_steps(ln) >= 2 and "ft_groups 2 " in ln,
                                  "2 outer steps of both groups")
        # the survivor is held between steps (still in the run: its heartbeats go on) until the new group 1
        # is up, so that on a fast machine it does not finish first, nor, on a slow one, train ahead of it
        hold.touch()
        g1.kill()  # SIGKILL
        try:
            g1 = Group(tiny, 1, url, *held, steps=steps)
            groups.append(g1)
            g1.wait_for(lambda ln: ln.startswith("lowband.train: strategy diloco"), "group 1 restarted")
        finally:
            hold.unlink()
        healed = g1.wait_for(lambda ln: "healed from a live peer" in ln, "group 1 healed")
        (code0, err0), (code1, err1) = g0.finish(), g1.finish()
    finally:
        for g in groups:
            g.kill()
    assert code0 == 0 and code1 == 0, (err0, err1)
    assert "Traceback" not in err0 + err1 and "GET /checkpoint" not in err0 + err1, (err0, err1)
    # the restarted group continued at the survivor's step (not its own step 1), with the survivor's LR position
    at = int(healed.rsplit("its step ", 1)[1])
    assert 4 < at <= steps, healed
    rows = {g: [json.loads(ln) for ln in (tiny / "runs" / f"g{g}" / "metrics.jsonl").read_text().splitlines()]
            for g in (0, 1)}
    survivor = [r["step"] for r in rows[0] if "loss" in r]
    # one process, never restarted: every step from before the kill to the end (it may itself have healed at
    # its start, from a group 1 that started first)
    killed_at = int(before_kill.split()[1].split("/")[0])
    assert survivor[0] == 1 and survivor == sorted(set(survivor))
    assert [s for s in survivor if s >= killed_at] == list(range(killed_at, steps + 1)), survivor
    # the new group 1 started at step 1 (it may train alone until it meets the survivor), then jumped
    restarted = [r["step"] for r in rows[1] if "loss" in r]
    assert restarted[0] == 1 and restarted[-1] == steps and restarted == sorted(set(restarted)), restarted
    assert at in restarted and restarted[restarted.index(at) - 1] < at - 1, (at, restarted)
    by_step = {r["step"]: r for r in rows[1] if "loss" in r}
    summaries = [json.loads((tiny / "runs" / f"g{g}" / "summary.json").read_text()) for g in (0, 1)]
    assert summaries[0]["steps"] == len(survivor) and summaries[1]["steps"] == len(restarted) < steps
    assert summaries[1]["tokens"] == len(restarted) * 2 * 32  # batch 2 x 32 tokens, one rank
    # a row's lr is the one its step used: from the step after the heal on, the survivor's schedule
    assert by_step[at + 1]["lr"] == next(r for r in rows[0] if r.get("step") == at + 1)["lr"]
    final = {g: next(r for r in reversed(rows[g]) if "loss" in r) for g in (0, 1)}
    # every sync commits unless a peer was lost during it (then it is rolled back and the fragment retried at the
    # next sync; on a busy machine a 1 s heartbeat can lapse): the groups agree, one commit fewer per rollback
    outer, rollbacks = [final[g]["extras"]["outer_steps"] for g in (0, 1)], final[0]["extras"]["ft_rollbacks"]
    assert outer[0] == outer[1] and steps // 4 - rollbacks <= outer[0] <= steps // 4, (outer, rollbacks)
    assert final[0]["extras"]["ft_groups"] == final[1]["extras"]["ft_groups"] == 2
    assert final[1]["extras"]["ft_heals"] >= 1  # the survivor may have healed too, at the first quorum
    from safetensors.torch import load_file

    m0 = load_file(tiny / "runs" / "g0" / "model.safetensors")
    m1 = load_file(tiny / "runs" / "g1" / "model.safetensors")
    assert m0.keys() == m1.keys() and all(m0[k].equal(m1[k]) for k in m0), "the groups' final models differ"
    for g in (0, 1):  # each group writes its own model, and says so
        source = json.loads((tiny / "runs" / f"g{g}" / "model.json").read_text())["source"]
        assert f"group {g}'s own model" in source and "fault-tolerant, 2 groups" in source, source


@pytest.mark.parametrize(("both", "other", "named"), [
    ((), "--optim.lr=0.002", "optim.lr"),
    # no group heals at step 0 (the trainer's managers have init_sync off): another seed is another start
    ((), "--run.seed=7", "the weights at step 0 (torchft init_sync off: give every group the same seed and model, "
                         "or turn init_sync on, ft.init_sync in the trainer)"),
    (("--ft.init_sync=true",), "--run.seed=7", None)])  # with it on, group 1 heals from group 0 at step 0: no refusal
def test_groups_with_different_settings_are_refused_by_name(tiny: Path, lighthouse, both: tuple,  # type: ignore[no-untyped-def]
                                                            other: str, named: str | None) -> None:
    _, url = lighthouse
    groups = [Group(tiny, 0, url, "--ft.min_replicas=2", *both, steps=24),
              Group(tiny, 1, url, "--ft.min_replicas=2", *both, other, steps=24)]
    try:
        results = [g.finish() for g in groups]
    finally:
        for g in groups:
            g.kill()
    for code, err in results:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if named is None:
            assert code == 0 and "Traceback" not in err, err
            continue
        assert code == 2 and len(lines) == 1, err
        assert lines[0].startswith(f"lowband.train: error: diloco ft: replica groups disagree on {named} "), err


def test_lighthouse_unreachable_at_start_and_lost_during_training(tiny: Path) -> None:
    # a port this test holds bound but never listens on refuses every connection: one line, exit 2, before any
    # step (a closed socket's port could be taken meanwhile, e.g. by another test's Lighthouse: the group then
    # trained and waited 300 s for a quorum, seen once with two pytest workers)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        start = Group(tiny, 0, dead, "--ft.connect_timeout_s=1", steps=100_000)
        code, err = start.finish()
    assert code == 2 and not any(ln.startswith("step") for ln in start.lines), err
    assert err.strip().startswith(f"lowband.train: error: no torchft Lighthouse answered at {dead} within 1 s"), err
    assert len(err.strip().splitlines()) == 1, err
    # the Lighthouse (its own process: an in-process one keeps answering after shutdown()) is killed after the
    # group trained: the group's next quorum times out, one line, exit 1
    lighthouse = subprocess.Popen([sys.executable, "-m", "lowband.lighthouse", "--min-replicas", "1", "--bind",
                                   "127.0.0.1:0"], cwd=tiny, env=cli_env({"RUST_LOG": "error"}),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    g = None
    try:
        url = lighthouse.stdout.readline().split("listening on ", 1)[1].split(" ", 1)[0]  # type: ignore[union-attr]
        g = Group(tiny, 1, url, "--ft.quorum_timeout_s=2", steps=100_000)
        g.wait_for(lambda ln: _outer_steps(ln) >= 1, "an outer step")
        lighthouse.kill()
        code, err = g.finish()
    finally:
        lighthouse.kill()
        lighthouse.communicate()
        if g is not None:
            g.kill()
    assert code == 1, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("lowband.train: error: diloco ft: no quorum formed within 2 s"), err


def test_every_group_lost_at_once_resumes_from_its_own_checkpoint(tiny: Path, lighthouse) -> None:  # type: ignore[no-untyped-def]
    """Both groups SIGKILLed together after each wrote a checkpoint; started again with the same commands, each
    resumes from its own checkpoint (not from step 1), they meet (the one behind heals from the other) and end
    with bitwise equal models on the last sync."""
    _, url = lighthouse
    steps = 48
    # `start` holds both launches of each phase at their first forward until both are up (as in the test
    # above): on a busy machine one group would otherwise train alone, its model then rightly differs
    start, hold = tiny / "start", tiny / "hold"
    args = ("--model.factory=tests.cli.ft_hold:held_gpt", "--checkpoint.every=8")
    start.touch()
    groups = [Group(tiny, g, url, *args, steps=steps, hold=(start, hold)) for g in (0, 1)]
    try:
        for g in groups:
            g.wait_for(lambda ln: ln.startswith("lowband.train: strategy diloco"), "the group's start")
        start.unlink()
        for g in groups:
            g.wait_for(lambda ln: ln.startswith("lowband.train: checkpoint step-"), "a checkpoint")
        hold.touch()  # both wait at their next forward: neither finishes before the kill
        for g in groups:
            g.kill()  # SIGKILL
        saved = {g: sorted(int(p.name.split("-")[1]) for p in (tiny / "runs" / f"g{g}" / "checkpoint").glob("step-*"))
                 for g in (0, 1)}
        assert all(saved.values()) and all(s[-1] < steps for s in saved.values()), saved
        hold.unlink()
        start.touch()
        groups += [Group(tiny, g, url, *args, steps=steps, hold=(start,)) for g in (0, 1)]
        resumed = [g.wait_for(lambda ln: ln.startswith("lowband.train: resumed from"), "a resume") for g in groups[2:]]
        for g in groups[2:]:
            g.wait_for(lambda ln: ln.startswith("lowband.train: strategy diloco"), "the group's start")
        start.unlink()
        results = [g.finish() for g in groups[2:]]
    finally:
        for g in groups:
            g.kill()
    for (code, err), line, g in zip(results, resumed, (0, 1), strict=True):
        assert code == 0 and "Traceback" not in err, err
        assert int(line.rsplit("(step ", 1)[1].rstrip(")")) in saved[g], (line, saved)  # its own, not step 0
    from safetensors.torch import load_file

    m0 = load_file(tiny / "runs" / "g0" / "model.safetensors")
    m1 = load_file(tiny / "runs" / "g1" / "model.safetensors")
    assert m0.keys() == m1.keys() and all(m0[k].equal(m1[k]) for k in m0), "the groups' final models differ"
    final = [next(json.loads(ln) for ln in reversed((tiny / "runs" / f"g{g}" / "metrics.jsonl").read_text()
                                                     .splitlines()) if "loss" in json.loads(ln)) for g in (0, 1)]
    assert final[0]["step"] == final[1]["step"] == steps
    # every sync commits unless a peer was lost during it (then it is rolled back and the fragment retried at the
    # next sync; on a busy machine a 1 s heartbeat can lapse): the groups agree, one commit fewer per rollback
    outer, rollbacks = [final[g]["extras"]["outer_steps"] for g in (0, 1)], final[0]["extras"]["ft_rollbacks"]
    assert outer[0] == outer[1] and steps // 4 - rollbacks <= outer[0] <= steps // 4, (outer, rollbacks)
