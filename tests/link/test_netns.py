"""Namespace set-up and tear-down of the link suite (lowband.bench.netns): what is created, and that
nothing is left after a normal end, an exception, SIGINT/SIGTERM, a killed rank or a crashed run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowband.bench.link import check_options, wait_ranks
from lowband.bench.netns import (
    IFNAME,
    ShapedNetwork,
    list_namespaces,
    parse_rate,
    reap_leftovers,
)
from tests.link.conftest import needs_netns

ROOT = Path(__file__).resolve().parents[2]


def _qdisc(ns: str, dev: str) -> str:
    return subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True,
                          check=True).stdout


def test_parse_rate_and_bad_options() -> None:
    assert parse_rate("1gbit") == 10**9 and parse_rate("100mbit") == 10**8 and parse_rate("10MBIT") == 10**7
    for bad in ("fast", "10mb", "-1mbit", "1kbit"):
        with pytest.raises(ValueError, match="rate"):
            parse_rate(bad)
    with pytest.raises(ValueError, match="--nodes must divide"):
        ShapedNetwork(4, "10mbit", nodes=3)
    base = {"world": 4, "nodes": 0, "global_batch": 16, "steps": 4, "eval_every": 2, "val_batches": 1,
            "compute_steps": 2, "max_steps_factor": 2, "time_cap": 2.0, "time_limit": 60.0}
    assert check_options(base) == (4, 4)
    assert check_options({**base, "nodes": 2}) == (4, 2)
    with pytest.raises(ValueError, match="--nodes"):
        check_options({**base, "nodes": 3})
    with pytest.raises(ValueError, match="--global-batch"):
        check_options({**base, "global_batch": 6})


@needs_netns
def test_flat_network_created_and_removed() -> None:
    with ShapedNetwork(2, "10mbit") as net:
        names = set(net.leftovers())
        assert names == {net.hub, net.rank_ns(0), net.rank_ns(1)}
        for r in range(2):  # both directions of every rank's link are shaped
            assert "tbf" in _qdisc(net.rank_ns(r), IFNAME) and "10Mbit" in _qdisc(net.rank_ns(r), IFNAME)
            assert "10Mbit" in _qdisc(net.hub, f"r{r}")
        addr = subprocess.run(["ip", "-n", net.rank_ns(1), "-4", "addr", "show", IFNAME], capture_output=True,
                              text=True, check=True).stdout
        assert f"{net.rank_addr(1)}/24" in addr
        ping = subprocess.run(["ip", "netns", "exec", net.rank_ns(1), sys.executable, "-c",
                               "import socket; s = socket.socket(); s.settimeout(2); "
                               f"print(s.connect_ex(('{net.rank_addr(0)}', 9)))"],
                              capture_output=True, text=True, timeout=30)
        assert ping.stdout.strip() == "111"  # ECONNREFUSED from rank 0: reachable over the bridge
    assert net.leftovers() == []


@needs_netns
def test_two_level_topology_shapes_only_the_node_links() -> None:
    with ShapedNetwork(4, "20mbit", nodes=2) as net:
        assert len(net.leftovers()) == 1 + 2 + 4
        for node in range(2):
            assert "20Mbit" in _qdisc(net.node_ns(node), "up0") and "20Mbit" in _qdisc(net.hub, f"n{node}")
        for r in range(4):
            assert "tbf" not in _qdisc(net.rank_ns(r), IFNAME)
            assert "tbf" not in _qdisc(net.node_ns(r // 2), f"r{r}")
        assert net.rank_env(3)["LOCAL_RANK"] == "1" and net.rank_env(3)["MASTER_ADDR"] == net.rank_addr(0)
    assert net.leftovers() == []


@needs_netns
def test_exception_removes_everything() -> None:
    with pytest.raises(RuntimeError, match="boom"), ShapedNetwork(2, "10mbit") as net:
        p = net.popen(0, ["sleep", "60"])
        raise RuntimeError("boom")
    assert net.leftovers() == []
    assert p.poll() is not None


_SCRIPT = """
import sys, time
from lowband.bench.netns import ShapedNetwork, signals_as_exceptions
with signals_as_exceptions(), ShapedNetwork(2, "10mbit") as net:
    p = net.popen(1, ["sleep", "60"])
    print(net.tag, p.pid, flush=True)
    time.sleep(60)
"""


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_removes_everything(sig: signal.Signals) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        tag, pid = proc.stdout.readline().split()  # type: ignore[union-attr]
        assert any(ns.startswith(tag) for ns in list_namespaces())
        proc.send_signal(sig)
        assert proc.wait(timeout=30) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not [ns for ns in list_namespaces() if ns.startswith(tag)]
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)


@needs_netns
def test_killed_rank_ends_the_run_and_cleans_up(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="rank 1 exited with code -9"), ShapedNetwork(2, "10mbit") as net:
        procs = []
        for r in range(2):
            (tmp_path / f"10mbit-rank{r}.log").write_text("")
            procs.append(net.popen(r, ["sleep", "60"]))
        time.sleep(0.2)
        procs[1].kill()
        wait_ranks(procs, 30.0, tmp_path, "10mbit")
    assert procs[0].poll() is not None
    assert net.leftovers() == []


@needs_netns
def test_leftover_of_a_crashed_run_is_removed_and_a_live_run_kept() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    crashed, live = f"lbk{dead.pid}x0000h", f"lbk{os.getpid()}xfffeh"
    for ns in (crashed, live):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        removed = reap_leftovers(log=False)
        assert crashed in removed and live not in removed
        names = list_namespaces()
        assert crashed not in names and live in names
    finally:
        for ns in (crashed, live):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.parametrize("suite", ["link", "goodput"])
def test_without_privileges_one_line_and_exit_2(suite: str) -> None:
    cmd = [sys.executable, "-m", "lowband.bench", suite, "--world", "2"]
    if os.geteuid() == 0:  # stay uid 0 (the checkout may be readable by root only) but drop every capability
        cmd = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", *cmd]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HOME": "/tmp"})
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"the {suite} suite needs root" in lines[0], p.stderr
