"""CPU-capped cgroups per stand-in machine (``lowband.bench.cpuquota``, used by the ``goodput`` suite)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lowband.bench.cpuquota import PREFIX, CpuQuotaError, CpuQuotas, controller_root, group_of, reap_cpu_leftovers
from lowband.bench.goodput import cpus_per_group


def _problem() -> str | None:
    try:
        controller_root()
    except CpuQuotaError as e:
        return str(e)
    return None


needs_cgroups = pytest.mark.skipif(_problem() is not None, reason=f"needs a writable cpu cgroup: {_problem()}")


@needs_cgroups
def test_a_child_joins_its_capped_group_and_every_group_is_removed() -> None:
    with CpuQuotas(["g0", "g1"], 0.25) as cq:
        assert cq.quota("g0") == 0.25 and cq.quota("g1") == 0.25
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=cq.preexec("g1"))
        try:
            assert group_of(p.pid).endswith(f"/{cq.base.name}/g1"), group_of(p.pid)
            assert not group_of(os.getpid()).endswith("/g1")  # the parent stays where it was
            assert str(p.pid) in (cq.path("g1") / "cgroup.procs").read_text().split()
        finally:
            p.kill()
            p.wait()
        base = cq.base
        with pytest.raises(KeyError, match="no group 'g2'"):
            cq.path("g2")
    assert not base.exists()


@needs_cgroups
def test_groups_are_removed_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), CpuQuotas(["a"], 0.5) as cq:
        base = cq.base
        assert (base / "a").is_dir()
        raise RuntimeError("boom")
    assert not base.exists()


@needs_cgroups
def test_leftovers_of_a_dead_launcher_are_reaped_and_a_live_ones_kept() -> None:
    root, _ = controller_root()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    gone = root / f"{PREFIX}{int(dead.stdout)}xbeef"
    live = root / f"{PREFIX}{os.getpid()}xcafe"
    try:
        (gone / "g0").mkdir(parents=True)
        (live / "g0").mkdir(parents=True)
        removed = reap_cpu_leftovers()  # a copy of this suite running beside may reap ``gone`` first: same code
        assert live.name not in removed
        assert not gone.exists() and live.exists()
    finally:
        for d in (gone, live):
            if (d / "g0").exists():
                (d / "g0").rmdir()
            if d.exists():
                d.rmdir()


def test_cpus_per_group_option() -> None:
    assert cpus_per_group({"cpus_per_group": "auto", "groups": 3}) == min(1.0, round(0.9 * (os.cpu_count() or 1) / 3,
                                                                                       2))
    assert cpus_per_group({"cpus_per_group": "0", "groups": 3}) == 0.0
    assert cpus_per_group({"cpus_per_group": "0.5", "groups": 3}) == 0.5
    for bad in ("-1", "lots", "nan"):
        with pytest.raises(ValueError, match="--cpus-per-group must be 'auto', 0 or a positive number"):
            cpus_per_group({"cpus_per_group": bad, "groups": 3})
    with pytest.raises(ValueError, match="cpus must be > 0"):
        CpuQuotas(["a"], 0)
    with pytest.raises(ValueError, match="plain directory names"):
        CpuQuotas(["../x"], 0.5)
