"""``goodput`` suite: fault-tolerant DiLoCo across machines that fail and return, against a static job restarted.

``python -m lowband.bench goodput [--groups 3] [--bandwidths 100mbit,10mbit] [--faults 1@0.3+0.1,2@0.6+0.1]``
(root) runs, for each bandwidth and contender, ``--groups`` replica groups, each its own
``python -m lowband.train`` launch in its own network namespace (a stand-in machine; :mod:`lowband.bench.netns`:
one veth per namespace to a bridge, ``tbf`` at the bandwidth on both ends), twice: once fault-free, once with
the fault schedule. Contenders:

* ``static``: today's ``diloco`` strategy as one job of ``--groups`` ranks (one replica per rank, each rank in
  its own namespace, torch's env:// rendezvous at rank 0), checkpointing every ``--static-checkpoint-every``
  steps. A kill ends the whole job (the other ranks fail); it is started again, from its last checkpoint, once
  every rank has exited and the killed machine is back: what ``torchrun --max-restarts`` does. Its wire is
  ``--static-wire``.
* ``ft-<wire>``: fault-tolerant DiLoCo (``[ft]``): every group meets the others through a Lighthouse (its own
  namespace); a killed group is started again, from nothing, when its machine is back, and heals from a live
  group; the others go on.

The fault schedule ``G@A+D`` kills group ``G`` (every process of it, SIGKILL) at the fraction ``A`` of the
contender's own fault-free run time and starts it again ``D`` later (fractions of the same time).

Per contender and bandwidth (:mod:`lowband.bench.goodput_account` says exactly what counts): ``goodput`` =
committed inner steps summed over groups / (groups x the steps the fault-free run of the same contender makes in
the same wall time); ``final_val_loss`` (mean over the groups' last launches) and the fault-free run's;
``kills`` and ``rejoins`` (counted from what happened, not from the schedule); ``max_stall_s`` (longest time a
live group made no inner step); ``heal_s`` (a rejoining group: launch to its first step after the heal);
``wire_bytes_total`` (ledger bytes over every launch of every group) and ``iface_tx_bytes_total`` (the
namespaces' interface counters); ``replicas_bitwise_equal`` (the SHA-256 of the global copies of every group's
last launch, from its ``summary.json``, all equal). Outputs: the shared bench JSON, ``<out>.md``,
``<out stem>-goodput.md`` (this suite's table and target checks) and ``<out stem>-<bandwidth>.png`` (training
loss against wall time per contender and group, kills and restarts marked). Launch logs: ``<out stem>-logs/``.

Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and torchft: without them, one line and exit code 2. Every
namespace and process is removed on every exit path; each run is bounded by ``--time-limit``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from lowband.bench.cpuquota import CpuQuotas, controller_root, reap_cpu_leftovers
from lowband.bench.goodput_account import (
    Incarnation,
    committed_steps,
    goodput,
    heal_s,
    step_gaps,
    training_start,
)
from lowband.bench.netns import (
    IFNAME,
    MASTER_PORT,
    ShapedNetwork,
    bandwidth_list,
    format_rate,
    parse_rate,
    privilege_problem,
    reap_leftovers,
    signals_as_exceptions,
)

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = "configs/diloco-bench.toml"
DEFAULT_BANDWIDTHS = "100mbit,10mbit"
DEFAULT_OUT = "bench_out/goodput.json"
LAUNCHER = True
"""``python -m lowband.bench`` runs this suite in its own process (it starts its own ranks; see
``lowband.bench.__main__.launcher_main``)."""
CODECS = ("int8", "int4", "int2", "topk", "topk-int2")
CONTENDERS = ("static", "ft-fp32", *(f"ft-{c}" for c in CODECS))
DEFAULT_FAULTS = "1@0.3+0.1,2@0.6+0.1"
LIGHTHOUSE_PORT = 29510
POLL_S = 0.05
TAG = "lowband.bench goodput"

QUICK = {"groups": 2, "steps": 160, "bandwidths": "100mbit", "faults": "1@0.3+0.1", "contenders": "static,ft-int8",
         "static_checkpoint_every": 40, "sync_every": 4, "fragments": 1}
"""``--quick`` settings (lowband.bench.__main__.apply_quick)."""


@dataclass(frozen=True)
class Fault:
    """Kill group ``group`` at ``at`` x the fault-free run time; start it again ``down`` x that time later."""

    group: int
    at: float
    down: float


def parse_faults(text: str) -> list[Fault]:
    """``"1@0.3+0.1,2@0.6+0.1"`` -> faults (``""`` or ``"none"``: none); raises ``ValueError`` naming the part."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part or part == "none":
            continue
        try:
            g, rest = part.split("@", 1)
            at, down = rest.split("+", 1)
            fault = Fault(int(g), float(at), float(down))
        except ValueError as e:
            raise ValueError(f"--faults: {part!r} is not GROUP@AT+DOWN (e.g. 1@0.3+0.1)") from e
        if fault.group < 0 or not 0 < fault.at < 1 or fault.down <= 0:
            raise ValueError(f"--faults: {part!r} needs group >= 0, 0 < AT < 1 and DOWN > 0")
        out.append(fault)
    return out


def _bandwidths(text: str) -> str:
    """argparse type of ``--bandwidths``: the privilege gate and the rates' check
    (:func:`lowband.bench.netns.bandwidth_list`); returns the text, so that ``--quick`` sees the default."""
    bandwidth_list(text, "goodput")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--groups", type=int, default=3, help="replica groups, each its own launch in its own namespace")
    p.add_argument("--bandwidths", type=_bandwidths, default=DEFAULT_BANDWIDTHS,
                   help="comma-separated tc rates of every machine's link (bit, kbit, mbit, gbit)")
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help=f"comma-separated, from {', '.join(CONTENDERS)}")
    p.add_argument("--faults", default=DEFAULT_FAULTS,
                   help="GROUP@AT+DOWN,...: kill GROUP at AT x the fault-free run time, start it again DOWN x that "
                        "time later; 'none' for no fault")
    p.add_argument("--config", default=DEFAULT_CONFIG,
                   help="the trainer config every group runs (model, data, optimizer); the suite sets the run, "
                        "strategy, diloco wire and ft keys")
    p.add_argument("--steps", type=int, default=400, help="inner steps of every group")
    p.add_argument("--sync-every", type=int, default=4, help="diloco.sync_every")
    p.add_argument("--fragments", type=int, default=2, help="diloco.fragments")
    p.add_argument("--static-wire", default="topk-int2", help="diloco.wire of the static contender")
    p.add_argument("--static-checkpoint-every", type=int, default=50, help="checkpoint.every of the static job")
    p.add_argument("--quorum-timeout", type=float, default=60.0, help="ft.quorum_timeout_s of every group")
    p.add_argument("--pg-timeout", type=float, default=60.0,
                   help="ft.timeout_s of the ft groups and run.timeout_s of the static job")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=5000,
                   help="the Lighthouse's heartbeat timeout (its default): a group silent this long leaves the quorum")
    p.add_argument("--join-timeout-ms", type=int, default=60_000, help="the Lighthouse's join timeout")
    p.add_argument("--time-limit", type=float, default=1800.0, help="seconds per run (then every process is killed)")
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--cpus-per-group", default="auto",
                   help="CPU cap of each group's processes (static: of each rank), a cgroup per stand-in machine, so "
                        "that a killed or restarting group neither frees nor takes CPU of the others; 'auto' = "
                        "min(1, 0.9 x cores / groups), 0 = no cap")


def check_options(opts: dict[str, Any]) -> tuple[list[str], list[Fault]]:
    """``(contenders, faults)``; raises ``ValueError`` naming the bad option before anything is created."""
    groups = int(opts["groups"])
    if groups < 2:
        raise ValueError(f"--groups must be >= 2; got {groups}")
    contenders = [c.strip() for c in opts["contenders"].split(",") if c.strip()]
    bad = [c for c in contenders if c not in CONTENDERS]
    if bad or not contenders:
        raise ValueError(f"--contenders: unknown {', '.join(bad) or '(none given)'}; choose from "
                         f"{', '.join(CONTENDERS)}")
    faults = parse_faults(opts["faults"])
    for f in faults:
        if f.group >= groups:
            raise ValueError(f"--faults: group {f.group} does not exist with --groups {groups}")
    for k in ("steps", "sync_every", "fragments", "static_checkpoint_every"):
        if opts[k] < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1; got {opts[k]}")
    if opts["static_wire"] not in ("fp32", *CODECS):
        raise ValueError(f"--static-wire must be one of fp32, {', '.join(CODECS)}; got {opts['static_wire']!r}")
    if not Path(opts["config"]).is_file() and not (ROOT / opts["config"]).is_file():
        raise ValueError(f"--config: no such file {opts['config']!r}")
    if cpus_per_group(opts) > 0:
        controller_root()  # CpuQuotaError (one line) before anything is created
    return contenders, faults


def cpus_per_group(opts: dict[str, Any]) -> float:
    """``--cpus-per-group`` as a number of CPUs (``auto``: ``min(1, 0.9 x cores / groups)``, 0: no cap)."""
    text = str(opts.get("cpus_per_group", "auto")).strip()
    if text == "auto":
        return min(1.0, round(0.9 * (os.cpu_count() or 1) / int(opts["groups"]), 2))
    try:
        cpus = float(text)
    except ValueError:
        raise ValueError(f"--cpus-per-group must be 'auto', 0 or a positive number of CPUs; got {text!r}") from None
    if cpus < 0 or cpus != cpus:
        raise ValueError(f"--cpus-per-group must be 'auto', 0 or a positive number of CPUs; got {text!r}")
    return cpus


# --------------------------------------------------------------------------------------------------- launches
class Launch:
    """One process started in a namespace; its stdout lines are stamped (scenario clock) into ``inc.lines`` and
    copied to ``log`` as they come."""

    def __init__(self, proc: subprocess.Popen, inc: Incarnation | None, log: IO[str], t0: float) -> None:
        self.proc, self.inc, self.log, self.t0 = proc, inc, log, t0
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            t = time.monotonic() - self.t0
            self.log.write(f"{t:9.3f} {line}")
            self.log.flush()
            if self.inc is not None:
                self.inc.lines.append((t, line.rstrip("\n")))

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def finish(self) -> None:
        """Wait for the process and its reader (after it exited or was killed)."""
        self.proc.wait()
        self.reader.join(10)


def _python_env(threads: int = 1) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "OMP_NUM_THREADS": str(threads), "GLOO_SOCKET_IFNAME": IFNAME, "RUST_LOG": "warn"}


def _no_rank_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                      "MASTER_ADDR", "MASTER_PORT", "LOWBAND_DEBUG")}


def trainer_args(opts: dict[str, Any], contender: str, out_dir: Path, run_name: str) -> list[str]:
    """The ``python -m lowband.train`` arguments shared by every launch of ``contender``."""
    config = opts["config"] if Path(opts["config"]).is_file() else str(ROOT / opts["config"])
    static = contender == "static"
    wire = opts["static_wire"] if static else contender.removeprefix("ft-")
    args = [sys.executable, "-m", "lowband.train", "--config", config, f"--run.steps={opts['steps']}",
            f"--run.name={run_name}", f"--run.out_dir={out_dir}", "--run.log_every=1", "--run.val_every=0",
            "--run.plot=false", "--run.export=false", "--run.threads=1", "--strategy.name=diloco",
            f"--diloco.sync_every={opts['sync_every']}", f"--diloco.fragments={opts['fragments']}",
            "--diloco.delay=0", f"--diloco.wire={wire}"]
    if static:
        return [*args, f"--run.world_size={opts['groups']}", f"--diloco.num_replicas={opts['groups']}",
                f"--run.timeout_s={opts['pg_timeout']}", f"--checkpoint.every={opts['static_checkpoint_every']}",
                "--checkpoint.keep_last=2"]
    return [*args, "--run.world_size=1", "--diloco.num_replicas=1", "--ft.enabled=true",
                   f"--ft.groups={opts['groups']}", "--ft.min_replicas=1", f"--ft.timeout_s={opts['pg_timeout']}",
            f"--ft.quorum_timeout_s={opts['quorum_timeout']}"]


def _iface_tx_bytes(ns: str) -> int:
    p = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show", IFNAME], capture_output=True, text=True,
                       timeout=30, check=True)
    return int(json.loads(p.stdout)[0]["stats64"]["tx"]["bytes"])


def _ledger_bytes(run_dir: Path, after_step: int) -> int:
    """Wire bytes of the metrics rows of ``run_dir`` with a step past ``after_step`` (a killed writer's last,
    partial line is skipped)."""
    total = 0
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("step", 0) > after_step and "wire_bytes_total" in row:
            total += int(row["wire_bytes_total"])
    return total


def _summary(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def run_scenario(opts: dict[str, Any], contender: str, rate: str, faults: list[Fault], fault_free_s: float | None,
                 work: Path, logdir: Path) -> dict[str, Any]:
    """One run of ``contender`` at ``rate`` (fault-free when ``faults`` is empty): start the groups, carry out
    the fault schedule, wait (bounded by ``--time-limit``), and account for it."""
    groups, static = int(opts["groups"]), contender == "static"
    kind = "faults" if faults else "fault-free"
    out_dir = work / f"{contender}-{rate}-{kind}"
    logdir.mkdir(parents=True, exist_ok=True)
    logs: list[IO[str]] = []
    launches: list[Launch] = []
    incs: list[Incarnation] = []
    events: list[tuple[float, str, int]] = []  # (t, "kill" | "start", group)

    def log(name: str) -> IO[str]:
        f = open(logdir / f"{rate}-{contender}-{kind}-{name}.log", "w")
        logs.append(f)
        return f

    # one namespace per group (static: per rank of the job), and one for the Lighthouse
    load_before = os.getloadavg()  # other work on the machine slows one run and not the other: both are reported
    cpus = cpus_per_group(opts)
    names = [f"{'r' if static else 'g'}{g}" for g in range(groups)]
    with contextlib.ExitStack() as stack:
        quotas = stack.enter_context(CpuQuotas(names, cpus)) if cpus > 0 else None
        net = stack.enter_context(ShapedNetwork(groups + (0 if static else 1), rate, mtu=opts["mtu"]))

        def capped(g: int) -> Any:
            return None if quotas is None else quotas.preexec(names[g])

        base_env = _no_rank_env({**os.environ, **_python_env()})
        url = None
        if not static:
            lh_addr = net.rank_addr(groups)
            lh = net._start(net.rank_ns(groups), [
                sys.executable, "-m", "lowband.lighthouse", "--min-replicas", "1", "--bind",
                f"{lh_addr}:{LIGHTHOUSE_PORT}", "--heartbeat-timeout-ms", str(opts["heartbeat_timeout_ms"]),
                "--join-timeout-ms", str(opts["join_timeout_ms"])], base_env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True)
            lh_launch = Launch(lh, None, log("lighthouse"), time.monotonic())
            url = _wait_lighthouse(lh_launch, logdir / f"{rate}-{contender}-{kind}-lighthouse.log")
        t0 = time.monotonic()
        latest: dict[int, Launch] = {}  # ft: group -> its latest launch; static: rank -> its process
        job_index = 0

        def start_group(g: int, index: int) -> None:
            inc = Incarnation(g, index, time.monotonic() - t0)
            incs.append(inc)
            args = [*trainer_args(opts, contender, out_dir, f"g{g}-i{index}"), f"--ft.group={g}",
                    f"--ft.lighthouse={url}", f"--ft.host={net.rank_addr(g)}"]
            p = net._start(net.rank_ns(g), args, base_env, before_exec=capped(g), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
            latest[g] = Launch(p, inc, log(f"g{g}-i{index}"), t0)
            launches.append(latest[g])

        def start_job(index: int) -> None:
            inc = Incarnation(0, index, time.monotonic() - t0)
            incs.append(inc)
            args = trainer_args(opts, contender, out_dir, "job")
            for r in range(groups):  # torchrun's environment, rendezvous at rank 0's address (a new port per launch)
                env = {**base_env, "RANK": str(r), "WORLD_SIZE": str(groups), "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": net.rank_addr(0),
                       "MASTER_PORT": str(MASTER_PORT + index)}
                p = net._start(net.rank_ns(r), args, env, before_exec=capped(r), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
                latest[r] = Launch(p, inc if r == 0 else None, log(f"job{index}-rank{r}"), t0)
                launches.append(latest[r])

        def end(inc: Incarnation, code: int, now: float, run_dir: Path) -> None:
            latest_launch = next(la for la in reversed(launches) if la.inc is inc)
            latest_launch.reader.join(10)  # every line it printed is in inc.lines
            inc.exit_code, inc.ended_t = code, now
            inc.wire_bytes = _ledger_bytes(run_dir, inc.resumed_step())

        if static:
            start_job(0)
        else:
            for g in range(groups):
                start_group(g, 0)
        base = fault_free_s or 0.0
        pending: list[tuple[float, str, int]] = []  # (t, "kill" | "start", group), once training has started
        scheduled = not faults
        down: set[int] = set()
        unkilled: set[int] = set()  # ft groups whose kill came after they finished: no restart either
        next_index = dict.fromkeys(range(groups), 1)
        deadline = t0 + float(opts["time_limit"])
        try:
            while True:
                now = time.monotonic() - t0
                if not scheduled and (start := training_start(incs)) is not None:
                    pending = sorted([(start + f.at * base, "kill", f.group) for f in faults]
                                     + [(start + (f.at + f.down) * base, "start", f.group) for f in faults])
                    scheduled = True
                while pending and pending[0][0] <= now:
                    _, what, g = pending.pop(0)
                    alive = [h for h, la in latest.items() if la.proc.poll() is None]
                    if static:  # a kill while the job is down (waiting for a machine) still takes that machine
                        ended = all(la.proc.poll() == 0 for la in latest.values())
                    else:
                        ended = g not in alive if what == "kill" else (not alive or g in unkilled)
                    if ended:
                        # the run ended before this fault (a fault-free run slowed by load sets the schedule):
                        # no kill to count, and no live group to rejoin
                        events.append((now, f"{what} skipped: the run had ended", g))
                        if what == "kill":
                            unkilled.add(g)
                        continue
                    events.append((now, what, g))
                    if what == "kill":
                        victim = latest[g]
                        victim.kill()
                        victim.proc.wait()
                        if not static:
                            assert victim.inc is not None
                            victim.inc.killed = True
                            end(victim.inc, -signal.SIGKILL, now, out_dir / f"g{g}-i{victim.inc.index}")
                        down.add(g)
                    else:
                        down.discard(g)
                        if not static:
                            start_group(g, next_index[g])
                            next_index[g] += 1
                if static:
                    codes = [latest[r].proc.poll() for r in range(groups)]
                    if all(c is not None for c in codes):
                        job = latest[0].inc
                        assert job is not None
                        if job.ended_t is None:
                            end(job, codes[0], now, out_dir / "job")
                        if all(c == 0 for c in codes):
                            break
                        if not any(e[1] == "kill" and e[0] >= job.launched_t for e in events):
                            raise RuntimeError(f"goodput: the static job failed without a fault (exit codes {codes} at "
                                               f"{rate}); see {logdir}")
                        job.killed = True  # failed with a peer: its work since the last checkpoint is lost
                        if not down:  # every machine is back: the whole job again, from its last checkpoint
                            job_index += 1
                            start_job(job_index)
                else:
                    for g, launch in latest.items():
                        inc = launch.inc
                        assert inc is not None
                        code = launch.proc.poll()
                        if code is not None and inc.ended_t is None:
                            end(inc, code, now, out_dir / f"g{g}-i{inc.index}")
                            if code != 0:
                                raise RuntimeError(f"goodput: group {g} exited with code {code} ({contender} at "
                                                   f"{rate}); see {logdir}")
                    if scheduled and not pending and all(launch.inc.ended_t is not None for launch in latest.values()):  # type: ignore[union-attr]
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"goodput: {contender} at {rate} passed --time-limit "
                                       f"{opts['time_limit']:.0f} s; every process killed")
                time.sleep(POLL_S)
            iface = sum(_iface_tx_bytes(net.rank_ns(g)) for g in range(groups))
        finally:
            for launch in launches:
                launch.kill()
            for launch in launches:
                launch.finish()
            for f in logs:
                f.close()
    return {**account(opts, contender, incs, events, out_dir, iface),
            "load_avg": [list(load_before), list(os.getloadavg())]}


def _wait_lighthouse(launch: Launch, log_path: Path, timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log_path.read_text() if log_path.is_file() else ""
        if "listening on " in text:
            return text.split("listening on ", 1)[1].split()[0]
        if launch.proc.poll() is not None:
            raise RuntimeError(f"goodput: the Lighthouse exited ({launch.proc.returncode}): {text.strip()}")
        time.sleep(POLL_S)
    raise TimeoutError(f"goodput: the Lighthouse did not start within {timeout_s:.0f} s")


def account(opts: dict[str, Any], contender: str, incs: list[Incarnation], events: list[tuple[float, str, int]],
            out_dir: Path, iface_tx: int) -> dict[str, Any]:
    """The figures of one run from its incarnations (see :mod:`lowband.bench.goodput_account`)."""
    groups, static = int(opts["groups"]), contender == "static"
    ends = [r[0] for inc in incs for r in inc.rows()[-1:]]
    run_s = max(ends, default=0.0) - (training_start(incs) or 0.0)
    if static:
        committed = [sum(committed_steps(inc, static=True) for inc in incs)] * groups
        wire = groups * sum(inc.wire_bytes for inc in incs)  # rank 0's ledger; every rank of the ring sends alike
        last = {0: incs[-1]}
        rejoins = sum(1 for inc in incs[1:] if inc.rows())
        summaries = {0: _summary(out_dir / "job")}
        digests = summaries[0]["diloco_global_sha256"] if summaries[0] else []
        equal = bool(digests) and len(set(digests)) == 1
        vals = [summaries[0]["final_val_loss"]] if summaries[0] else []
    else:
        committed = [sum(committed_steps(inc, static=False) for inc in incs if inc.group == g) for g in range(groups)]
        wire = sum(inc.wire_bytes for inc in incs)
        last = {g: [inc for inc in incs if inc.group == g][-1] for g in range(groups)}
        rejoins = sum(1 for inc in incs if inc.index > 0 and inc.heals() and inc.finished)
        summaries = {g: _summary(out_dir / f"g{g}-i{inc.index}") for g, inc in last.items()}
        digests = [tuple(s["diloco_global_sha256"]) for s in summaries.values() if s]
        equal = len(digests) == groups and len(set(digests)) == 1
        vals = [s["final_val_loss"] for s in summaries.values() if s]
    heals = [h for inc in incs if inc.index > 0 and (h := heal_s(inc)) is not None]
    gaps = step_gaps(incs)
    return {"run_s": run_s, "committed_steps": committed, "kills": sum(1 for e in events if e[1] == "kill"),
            "rejoins": rejoins, "max_stall_s": max(gaps, default=0.0), "heal_s_each": heals,
            "heal_s": max(heals, default=None), "median_step_gap_s": statistics.median(gaps) if gaps else None,
            "wire_bytes_total": wire, "iface_tx_bytes_total": iface_tx, "replicas_bitwise_equal": equal,
            "final_val_loss": statistics.fmean(vals) if vals and None not in vals else None,
            "finished": all(inc.finished for inc in last.values()), "events": events,
            "curves": {f"g{inc.group}-i{inc.index}": _curve(inc) for inc in incs}}


def _curve(inc: Incarnation, points: int = 200) -> list[list[float]]:
    """``[t, step, loss]`` of the incarnation's step rows, at most ``points`` of them (evenly spaced)."""
    rows = [(t, text) for t, text in inc.lines if text.startswith("step") and "| loss " in text]
    stride = max(1, len(rows) // points)
    out = []
    for t, text in rows[::stride]:
        step = int(text.split()[1].split("/")[0])
        loss = float(text.split("| loss ", 1)[1].split()[0])
        out.append([round(t, 3), step, loss])
    return out


# --------------------------------------------------------------------------------------------------- suite
def contender_row(opts: dict[str, Any], contender: str, rate: str, ff: dict[str, Any],
                  faulty: dict[str, Any]) -> dict[str, Any]:
    """One result row: the fault-free run ``ff`` and the run with faults ``faulty`` of ``contender``."""
    from lowband.bench.harness import result_row

    groups, steps = int(opts["groups"]), int(opts["steps"])
    gp = goodput(sum(faulty["committed_steps"]), groups, steps, faulty["run_s"], ff["run_s"])
    val, ff_val = faulty["final_val_loss"], ff["final_val_loss"]
    return result_row(
        f"{contender}@{rate}", [faulty["median_step_gap_s"] or 0.0],
        wire_bytes=round(ff["wire_bytes_total"] / (groups * steps)), final_loss=val, contender=contender,
        bandwidth=rate, bandwidth_bits=parse_rate(rate), goodput=gp, final_val_loss=val,
        fault_free_final_val_loss=ff_val, val_loss_ratio=(val / ff_val) if val and ff_val else None,
        kills=faulty["kills"], rejoins=faulty["rejoins"], max_stall_s=faulty["max_stall_s"],
        fault_free_max_stall_s=ff["max_stall_s"],
        heal_s=faulty["heal_s"], heal_s_each=faulty["heal_s_each"], wire_bytes_total=faulty["wire_bytes_total"],
        fault_free_wire_bytes_total=ff["wire_bytes_total"], iface_tx_bytes_total=faulty["iface_tx_bytes_total"],
        replicas_bitwise_equal=faulty["replicas_bitwise_equal"],
        fault_free_replicas_bitwise_equal=ff["replicas_bitwise_equal"], run_s=faulty["run_s"],
        fault_free_s=ff["run_s"], committed_steps=faulty["committed_steps"], finished=faulty["finished"],
        events=faulty["events"], curves=faulty["curves"], fault_free_curves=ff["curves"],
        load_avg={"fault_free": ff.get("load_avg"), "faults": faulty.get("load_avg")})


def launch(opts: dict[str, Any], stem: Path) -> dict[str, Any]:
    """Every bandwidth and contender, fault-free and with the fault schedule (the launcher side); returns
    ``{"config", "results"}``. Launch logs go to ``<stem>-logs/``."""
    import shutil
    import tempfile

    problem = privilege_problem("goodput")
    if problem is not None:
        raise PermissionError(problem)
    contenders, faults = check_options(opts)
    if any(c != "static" for c in contenders):
        try:
            import torchft  # noqa: F401
        except ImportError as e:
            raise ValueError("the ft contenders need torchft: pip install 'lowband[ft]'") from e
    rates = [format_rate(parse_rate(r)) for r in _bandwidths(opts["bandwidths"]).split(",") if r.strip()]
    from lowband.data import builtin_corpus

    builtin_corpus()  # build the corpus cache once, before the groups start
    reap_leftovers()
    reap_cpu_leftovers()
    logdir = stem.with_name(f"{stem.name}-logs")
    results: list[dict[str, Any]] = []
    runs: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="lowband_goodput_"))
    interrupted = None
    try:
        with signals_as_exceptions():
            for rate, c in ((rate, c) for rate in rates for c in contenders):
                try:
                    t0 = time.monotonic()
                    try:
                        ff = run_scenario(opts, c, rate, [], None, work, logdir)
                        faulty = run_scenario(opts, c, rate, faults, ff["run_s"], work, logdir) if faults else ff
                    except (RuntimeError, TimeoutError) as e:
                        runs[f"{c}@{rate}"] = {"wall_s": time.monotonic() - t0, "error": str(e)}
                        results.append({"name": f"{c}@{rate}", "contender": c, "bandwidth": rate, "error": str(e)})
                        print(f"{TAG}: {c} at {rate} FAILED: {e}", file=sys.stderr, flush=True)
                        continue
                    results.append(contender_row(opts, c, rate, ff, faulty))
                    runs[f"{c}@{rate}"] = {"wall_s": time.monotonic() - t0}
                    print(f"{TAG}: {c} at {rate}: goodput {results[-1]['goodput']:.3f} "
                          f"({runs[f'{c}@{rate}']['wall_s']:.0f} s)", file=sys.stderr, flush=True)
                except (KeyboardInterrupt, SystemExit) as e:  # the runs that finished are still reported
                    interrupted = f"interrupted during {c} at {rate} ({type(e).__name__})"
                    print(f"{TAG}: {interrupted}: writing the contenders that finished", file=sys.stderr, flush=True)
                    break
    finally:
        shutil.rmtree(work, ignore_errors=True)
    config = {"groups": opts["groups"], "bandwidths": rates, "contenders": contenders,
              "faults": [f.__dict__ for f in faults], "config": opts["config"], "steps": opts["steps"],
              "sync_every": opts["sync_every"], "fragments": opts["fragments"], "static_wire": opts["static_wire"],
              "static_checkpoint_every": opts["static_checkpoint_every"], "quorum_timeout_s": opts["quorum_timeout"],
              "pg_timeout_s": opts["pg_timeout"], "heartbeat_timeout_ms": opts["heartbeat_timeout_ms"],
              "join_timeout_ms": opts["join_timeout_ms"], "mtu": opts["mtu"], "cpus_per_group": cpus_per_group(opts),
              "runs": runs, "interrupted": interrupted,
              "goodput": "committed inner steps over groups / (groups x steps x run_s / fault_free_s); run_s: "
                         "from the first step of the last group to start to the last step row"}
    return {"config": config, "results": results}


def default_out(opts: dict[str, Any]) -> Path:
    return Path(opts.get("out") or DEFAULT_OUT)


def run(env: Any, opts: dict[str, Any]) -> dict[str, Any]:
    """Suite entry of ``python -m lowband.bench goodput`` (called in that process, as rank 0: ``LAUNCHER``;
    ``--world`` is not used, ``--groups`` is)."""
    from lowband.bench.goodput_report import finish_outputs
    from lowband.bench.harness import launcher_doc, write_outputs

    stem = default_out(opts).with_suffix("")
    body = launch(opts, stem)
    doc = launcher_doc("goodput", int(opts["groups"]), body)
    paths = finish_outputs(doc, stem)
    print(f"{TAG}: wrote {', '.join(map(str, paths))}", file=sys.stderr)
    if body["config"]["interrupted"]:  # the shared JSON and table now, then the exit status of an interrupt
        print(f"{TAG}: wrote {', '.join(map(str, write_outputs(doc, default_out(opts))))}", file=sys.stderr)
        raise SystemExit(130)
    return body
