"""Contenders of the ``link`` suite: every trainer strategy (and torch's own ZeRO and FSDP2) as a
trainable thing with a step, an evaluation model and a byte count.

A contender is registered by name in :data:`CONTENDERS` as a :class:`LinkSpec`: either a trainer
strategy from ``lowband.train.strategies`` with config overrides (which may depend on the topology,
e.g. DiLoCo's replicas = nodes), or a torch-native builder. Any later strategy becomes a contender
with one :func:`register_contender` call (or ``--contenders strategy:NAME`` on the command line).
DiLoCo gets one contender per wire codec that :mod:`lowband.comm.codecs` defines at run time, so
codecs added there are picked up by name.

Communication of each contender is whatever its strategy does; the strategies route their
collectives through ``lowband.comm`` (counted in the ledger). ``zero`` and ``fsdp2`` run torch's
collectives, so they report ring-model bytes computed from the parameter sizes (as the ``dp``
suite's :mod:`lowband.bench.dp_torch` does).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lowband.bench.dp import strategy_resident_bytes, strategy_step, tensor_bytes
from lowband.bench.dp_torch import build_fsdp2, build_zero, fsdp2_wire_bytes, local_tensor, resident_bytes, torch_step
from lowband.comm import ring_wire_bytes
from lowband.train.config import Config, override_value
from lowband.train.env import DistEnv
from lowband.train.trainer import build_model


@dataclass(frozen=True)
class LinkTopo:
    """What a contender may adapt to: ranks, nodes (2-level topology) and ranks per node."""

    world: int
    nodes: int

    @property
    def ranks_per_node(self) -> int:
        return self.world // self.nodes


@dataclass
class Trainee:
    """One contender, built on one rank.

    Attributes:
        step: ``step(x, y) -> local loss`` runs one optimizer step on this rank's batch.
        eval_model: the module to evaluate (full parameters on this rank; waits for in-flight updates).
        state_bytes: optimizer-state bytes on this rank.
        resident_bytes: parameters + gradients + optimizer state on this rank.
        wire_bytes_per_step: for contenders whose collectives bypass ``lowband.comm``: ring-model bytes
            per training step per rank; ``None`` = read the ledger.
        once_wire_bytes: bytes per rank moved once, outside the steps (FSDP2's first forward, the
            evaluation before training, gathers the weights).
    """

    step: Callable[[torch.Tensor, torch.Tensor], float]
    eval_model: Callable[[], nn.Module]
    state_bytes: Callable[[], int]
    resident_bytes: Callable[[], int]
    wire_bytes_per_step: int | None = None
    once_wire_bytes: int = 0


Overrides = dict[str, Any]
"""``{"section.key": value}``; a key may list alternatives ``"sharded.param_wire_dtype|strategy.param_wire_dtype"``
(the first that exists in the config is set), so a contender survives a config key moving sections."""


def set_key(cfg: Config, dotted: str, value: Any) -> None:
    """Set the first of the ``|``-separated ``section.key`` alternatives that exists in ``cfg``."""
    for alt in dotted.split("|"):
        section, key = alt.split(".", 1)
        obj = getattr(cfg, section, None)
        if obj is not None and dataclasses.is_dataclass(obj) and key in {f.name for f in dataclasses.fields(obj)}:
            setattr(obj, key, value)
            return
    raise ValueError(f"link contender override {dotted!r}: no such config key")


@dataclass(frozen=True)
class LinkSpec:
    """A registered contender.

    Attributes:
        strategy: trainer strategy name, or ``""`` for a torch-native ``builder``.
        overrides: :data:`Overrides` applied to the run's config, or a function of the topology
            returning them.
        builder: ``(cfg, env) -> Trainee`` for contenders that are not trainer strategies.
        note: one line for the report (what this contender is).
        in_all: part of ``--contenders all`` (the default); ``False``: run only when named.
    """

    strategy: str = ""
    overrides: Overrides | Callable[[LinkTopo], Overrides] = field(default_factory=dict)
    builder: Callable[[Config, DistEnv], Trainee] | None = None
    note: str = ""
    in_all: bool = True

    def config(self, base: Config, topo: LinkTopo) -> Config:
        cfg = copy.deepcopy(base)
        if self.strategy:
            cfg.strategy.name = self.strategy
        ov = self.overrides(topo) if callable(self.overrides) else self.overrides
        for dotted, value in ov.items():
            set_key(cfg, dotted, value)
        return cfg

    def build(self, base: Config, env: DistEnv, topo: LinkTopo) -> Trainee:
        cfg = self.config(base, topo)
        if self.builder is not None:
            return self.builder(cfg, env)
        return strategy_trainee(cfg, env)


def strategy_trainee(cfg: Config, env: DistEnv) -> Trainee:
    """A trainer strategy as a :class:`Trainee`: the trainer's own step (observe_batch, microbatch,
    clip, optimizer step), one microbatch per step."""
    from lowband.train.strategies import get_strategy_class

    cls = get_strategy_class(cfg.strategy.name)
    cls.validate_config(cfg, env.world_size)
    strategy = cls(cfg, env)
    strategy.setup(build_model(cfg, env.device))
    return Trainee(strategy_step(strategy, cfg), strategy.unwrapped, strategy.optimizer_state_bytes,
                   lambda: strategy_resident_bytes(strategy))


def zero_trainee(cfg: Config, env: DistEnv) -> Trainee:
    """torch ``ZeroRedundancyOptimizer`` (AdamW) over torch DDP: gradient all-reduce ``2(N-1)/N P``
    plus one broadcast per parameter from its owner ``(N-1)/N P`` per step (ring model)."""
    ddp, model, opt = build_zero(cfg, env)
    n = env.world_size
    pbytes = tensor_bytes(model.parameters())

    def state() -> int:
        return sum(tensor_bytes(st.values()) for st in opt.optim.state.values())

    wire = ring_wire_bytes("all_reduce", n, pbytes) + ring_wire_bytes("broadcast", n, pbytes)
    return Trainee(torch_step(ddp, model, cfg, [opt]), lambda: model, state,
                   lambda: resident_bytes(model, state()), wire)


def fsdp2_trainee(cfg: Config, env: DistEnv) -> Trainee:
    """torch FSDP2 (``fully_shard`` per block, then the root; ``reshard_after_forward=False``) with
    AdamW. Per step: one all-gather of the (dim-0 padded) parameters in forward, ``(N-1)/N Ppad``, and
    one reduce-scatter of the gradients, which gloo carries out as an all-reduce (``2(N-1)/N Ppad``;
    ``(N-1)/N Ppad`` on NCCL), plus the clipping norm's scalar all-reduce; once, the first forward (the
    evaluation before training) gathers the parameters. Checked against the interface counters of the
    ``link`` suite (agreement within TCP/IP overhead on 2 and 4 ranks)."""
    model, opt, padded = build_fsdp2(cfg, env)
    n = env.world_size

    def state() -> int:
        return sum(tensor_bytes(local_tensor(v) for v in st.values()) for st in opt.state.values())

    gather = ring_wire_bytes("all_gather", n, padded)
    return Trainee(torch_step(model, model, cfg, [opt]), lambda: model, state, lambda: resident_bytes(model, state()),
                   fsdp2_wire_bytes(cfg, n, padded), once_wire_bytes=gather)


def _diloco_overrides(wire: str) -> Callable[[LinkTopo], Overrides]:
    """One replica per node (per rank when flat); the rest of ``[diloco]`` comes from the run config
    (error feedback: the config's default, ``auto`` where the config has it)."""

    def ov(topo: LinkTopo) -> Overrides:
        return {"diloco.wire": wire, "diloco.num_replicas": topo.nodes}
    return ov


def _gtp_overrides(topo: LinkTopo) -> Overrides:
    """GTP over the whole world when flat; inside each node (DP across nodes) in the 2-level topology."""
    return {"gtp.size|strategy.gtp_size": 0 if topo.nodes == topo.world else topo.ranks_per_node}


CONTENDERS: dict[str, LinkSpec] = {
    "ddp": LinkSpec("ddp", note="torch DDP + AdamW, gradient all-reduce (the baseline)"),
    "zero": LinkSpec(builder=zero_trainee, note="torch ZeroRedundancyOptimizer over DDP"),
    "fsdp2": LinkSpec(builder=fsdp2_trainee, note="torch FSDP2 fully_shard per block"),
    "sharded-adamw": LinkSpec("sharded-adamw", note="lowband sharded AdamW, fp32 wire"),
    "sharded-adamw-bf16": LinkSpec("sharded-adamw", {"strategy.grad_wire_dtype": "bfloat16",
                                                     "sharded.param_wire_dtype|strategy.param_wire_dtype": "bfloat16"},
                                   note="lowband sharded AdamW, bf16 gradients and parameters on the wire"),
    "sharded-adamw-fp8": LinkSpec("sharded-adamw", {"strategy.grad_wire_dtype": "fp8",
                                                    "sharded.param_wire_dtype|strategy.param_wire_dtype": "bfloat16"},
                                  note="lowband sharded AdamW, block-scaled fp8 gradients, bf16 parameters",
                                  in_all=False),
    "sharded-adamw-fp8-ef": LinkSpec("sharded-adamw", {"strategy.grad_wire_dtype": "fp8",
                                                       "sharded.param_wire_dtype|strategy.param_wire_dtype": "bfloat16",
                                                       "sharded.grad_error_feedback": True},
                                     note="lowband sharded AdamW, fp8 gradients with error feedback, bf16 parameters",
                                     in_all=False),
    "sharded-adamw-p2p": LinkSpec("sharded-adamw", {"sharded.exchange": "p2p"},
                                  note="lowband sharded AdamW, fp32 wire, every peer at once instead of the ring",
                                  in_all=False),
    "sharded-muon": LinkSpec("sharded-muon", note="lowband sharded Muon (hidden matrices) + AdamW"),
    "sharded-adamw-sparse": LinkSpec("sharded-adamw", {"sparse.tables|strategy.sparse_embeddings": ["bigram"],
                                                       "sparse.mode|strategy.sparse_mode": "auto"},
                                     note="lowband sharded AdamW, bigram-table gradient row-sparse"),
    "gtp": LinkSpec("gtp", _gtp_overrides, note="generalized tensor parallelism (GTP inside a node)"),
    "gtp-fp8-gather": LinkSpec("gtp", lambda topo: {**_gtp_overrides(topo), "gtp.gather": "fp8", "gtp.fp8_block": 16},
                               note="GTP, fp8 weight gathers (16x16 block scales)", in_all=False),
    "gtp-fp8": LinkSpec("gtp", lambda topo: {**_gtp_overrides(topo), "gtp.gather": "fp8", "gtp.fp8_block": 16,
                                             "strategy.grad_wire_dtype": "fp8"},
                        note="GTP, fp8 weight gathers and fp8 gradient reduce-scatters", in_all=False),
}


def register_contender(name: str, spec: LinkSpec) -> None:
    """Add (or replace) a contender of the link suite."""
    CONTENDERS[name] = spec


def _register_diloco() -> None:
    """One contender per DiLoCo wire codec that exists now (``WIRE_CODECS``, else ``CODECS``); the Rice-coded
    top-k ones run only when named (they decode what ``topk*`` decodes, in fewer bytes)."""
    from lowband.comm import codecs

    for wire in getattr(codecs, "WIRE_CODECS", codecs.CODECS):
        if wire != "fp64":
            register_contender(f"diloco-{wire}", LinkSpec("diloco", _diloco_overrides(wire),
                                                          note=f"Streaming DiLoCo, {wire} pseudo-gradients",
                                                          in_all="rice" not in wire))


_register_diloco()


def _sparseloco_overrides(delay: int, chunk: int | None = None,
                          k: int | None = None) -> Callable[[LinkTopo], Overrides]:
    """Rice-coded top-k + int2 with error feedback decayed by 0.95 (SparseLoCo's decay), ``delay`` steps of
    overlap; ``k`` of every ``chunk`` values (default: the run config's, 8 of 256)."""

    def ov(topo: LinkTopo) -> Overrides:
        extra = {} if chunk is None else {"diloco.topk_chunk": chunk, "diloco.topk_k": k}
        return {**_diloco_overrides("topk-rice-int2")(topo), "diloco.ef_decay": 0.95, "diloco.delay": delay, **extra}
    return ov


for _delay in (0, 1):
    _d = "-d1" if _delay else ""
    register_contender(f"diloco-topk-rice-int2-ef95{_d}",
                       LinkSpec("diloco", _sparseloco_overrides(_delay), in_all=False,
                                note=f"Streaming DiLoCo, topk-rice-int2, error feedback decay 0.95, delay {_delay}"))
    # configs/diloco.toml's codec: the 3000-step frontier of docs/PERFORMANCE.md (40 of every 4096 values)
    register_contender(f"diloco-rice40of4096-ef95{_d}",
                       LinkSpec("diloco", _sparseloco_overrides(_delay, 4096, 40), in_all=False,
                                note=f"Streaming DiLoCo, topk-rice-int2 40 of 4096, error feedback decay 0.95, "
                                     f"delay {_delay}"))


VARIANT_SEP = "/"
"""``NAME/section.key=value/...``: a registered contender (or ``strategy:NAME``) with config keys changed, e.g.
``diloco-topk-rice-int2-ef95/diloco.topk_k=16/diloco.fragments=1`` (values parsed and checked against the field's
type as the trainer's ``--section.key=value`` overrides are)."""


def _variant(base: LinkSpec, name: str, items: list[str]) -> LinkSpec:
    extra: Overrides = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or "." not in key or not value:
            raise ValueError(f"link suite: contender {name!r}: {item!r} is not section.key=value")
        extra[key] = override_value(key, value)  # raises naming an unknown key or a mistyped value

    def ov(topo: LinkTopo) -> Overrides:
        inherited = base.overrides(topo) if callable(base.overrides) else base.overrides
        return {**inherited, **extra}
    return dataclasses.replace(base, overrides=ov, in_all=False,
                               note=f"{base.note}; {', '.join(f'{k} = {v!r}' for k, v in extra.items())}")


def resolve(name: str) -> LinkSpec:
    """A registered contender, or ``strategy:NAME`` for any trainer strategy with default settings, either one
    optionally followed by ``/section.key=value`` changes (:data:`VARIANT_SEP`)."""
    head, *items = name.split(VARIANT_SEP)
    if items:
        return _variant(resolve(head), name, items)
    if name in CONTENDERS:
        return CONTENDERS[name]
    if name.startswith("strategy:"):
        from lowband.train.strategies import get_strategy_class

        get_strategy_class(name.removeprefix("strategy:"))  # raises ConfigError naming the allowed ones
        return LinkSpec(name.removeprefix("strategy:"), note="trainer strategy with default settings")
    raise ValueError(f"link suite: unknown contender {name!r}; allowed: {', '.join(CONTENDERS)} "
                     "or strategy:<name>, each optionally followed by /section.key=value")
