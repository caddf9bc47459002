"""``diloco``: Streaming DiLoCo across replica groups, any inner strategy inside each replica.

Mesh: :func:`lowband.parallel.mesh.build_mesh` with ``replica = diloco.num_replicas`` (0 = one per
rank), ``gtp = gtp.size`` (0 = the whole replica) for ``diloco.inner = "gtp"`` (else 1) and ``dp`` the
rest of a replica, laid out replica-major (``rank = (replica * dp + dp_rank) * gtp + gtp_rank``).

Inside a replica: the strategy named by ``diloco.inner``, an ordinary strategy object set up with
:meth:`setup_on_mesh(model, mesh) <lowband.train.strategies.base.Strategy>` on that mesh (its
gradients are averaged over ``mesh.dp``, GTP shards over ``mesh.gtp``):

* ``ddp``: torch DDP over ``dp`` (bucket all-reduce through a ``dp`` :class:`~lowband.comm.Comm`, tag
  ``grad``) + torch AdamW;
* ``sharded-adamw`` / ``sharded-muon``: :class:`lowband.optim.ShardedOptimizer` over ``dp``
  (reduce-scatter, owner update, all-gather; Muon for the hidden matrices, AdamW for the rest), with
  ``param_gather = "step"`` so the DiLoCo hook after ``step()`` reads the updated, gathered weights;
  sparse tables (``sparse.tables``) exchange only their touched rows inside the replica;
* ``gtp``: every linear weight (and plain embedding) row-sharded over ``gtp``, ``gtp.optimizer`` AdamW
  or Muon on the shards, gradients averaged over ``dp``.

The inner strategy is asked only through :class:`~lowband.train.strategies.base.Strategy`'s DiLoCo-inner hooks
(``diloco_inner``, ``inner_gtp_size``, ``validate_inner``, ``check_inner_model``, ``prepare_inner``,
``setup_on_mesh``, ``inner_checkpoint``, ``inner_format``, ``sparse_rows``, ``ft_agreed_sections``): this module
has no branch on its name. This strategy delegates ``microbatch``, ``clip_grad_norm``, ``optimizer_step``,
``skip_step``, ``observe_batch``, ``prepare_resume``, ``unwrapped`` and ``param_shapes`` to the inner strategy.

Across replicas: :class:`lowband.diloco.StreamingDiLoCo` on the ``replica`` group (the ranks with the
same ``(dp, gtp)`` coordinates in every replica), driven by the inner optimizer's step post-hook: one
fragment every ``sync_every / fragments`` steps, its averaged pseudo-gradient on the ``diloco.wire``
format (tags ``diloco:frag<i>``), outer Nesterov SGD on CPU global copies. The fragments are cut from
the model *before* the inner strategy shards it (the plan's ``fragment_units``, by parameter name), so
every inner strategy syncs the same parameters in the same fragments. With ``gtp`` inside, a
parameter is this rank's row shard and its peer in every other replica is the same shard (same gtp
coordinate): the outer all-reduce moves ``1/gtp`` of a sharded weight's bytes per rank.

Fault tolerant (``ft.enabled``): this launch is one replica group (``diloco.num_replicas = 1``); the other
groups are other launches, met through a torchft Lighthouse. Each rank builds a ``torchft.Manager``
(:func:`lowband.diloco.ft_group.build_manager`) and StreamingDiLoCo uses
:class:`lowband.diloco.ft.TorchftMembership`; a group behind the quorum heals from a live peer: the model and
inner optimizer (:mod:`lowband.diloco.ft_state`), DiLoCo's state, and whatever the trainer registers with
:meth:`DilocoStrategy.register_heal_state` (its step and LR schedule). The trainer's settings that must agree
(:func:`ft_agreed_settings`) join DiLoCo's ``agreed_settings``; the data are split ``ft.groups`` ways
(:meth:`DilocoStrategy.data_partition`). docs/diloco.md, "Training across machines".

State per rank: the model and the inner optimizer state in the inner strategy's layout, plus on CPU one
global copy of every (local) parameter, the outer momentum and, with error feedback
(``diloco.error_feedback``, on by default for the message codecs int4 / int2 / topk*), one residual per
parameter (all counted in ``optimizer_state_bytes``).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lowband.comm.codecs import WIRE_CODECS, check_wire
from lowband.comm.compress import check_block_size, check_topk, default_error_feedback
from lowband.diloco import StreamingDiLoCo, outer_sgd, split_fragments
from lowband.diloco.fragments import Fragment
from lowband.diloco.outer import check_alpha, check_ef_decay, check_outer_sgd
from lowband.diloco.schedule import validate_schedule
from lowband.diloco.state import GTPShardLayout
from lowband.diloco.streaming import whole_first
from lowband.parallel.mesh import build_mesh
from lowband.train.errors import ConfigError
from lowband.train.strategies import get_strategy_class, register_strategy
from lowband.train.strategies.base import Strategy

WIRES = tuple(c for c in WIRE_CODECS if c != "fp64")
ERROR_FEEDBACK = {"auto": None, "on": True, "off": False}
INNER = ("ddp", "sharded-adamw", "sharded-muon", "gtp")
"""Strategies that can run inside a DiLoCo replica (``diloco.inner``): those whose class sets
:attr:`Strategy.diloco_inner <lowband.train.strategies.base.Strategy.diloco_inner>` (a unit test checks that this
list, the config's choices and the registry agree)."""


@dataclass(kw_only=True)
class DilocoConfig:
    """Streaming DiLoCo (``strategy.name = "diloco"``); see docs/diloco.md."""

    num_replicas: int = 0
    """Replica groups; 0 = one per rank. world_size / num_replicas ranks per replica train together."""
    inner: str = "ddp"
    """Strategy inside a replica (over its world_size / num_replicas ranks): ddp (torch DDP + AdamW) |
    sharded-adamw | sharded-muon (lowband's sharded optimizer; [sharded], [sparse] tables) | gtp (weights
    row-sharded over gtp.size ranks of the replica, 0 = all of them; [gtp], gtp.optimizer). docs/diloco.md."""
    sync_every: int = 32
    """H: inner steps between two syncs of the same fragment."""
    fragments: int = 2
    """n: fragments (consecutive blocks); one syncs every sync_every / fragments inner steps."""
    delay: int = 1
    """tau: inner steps a fragment's all-reduce overlaps, in [0, sync_every / fragments)."""
    alpha: float = 0.0
    """Merge weight of the local weights after a sync, in [0, 1] (0 = take the new global weights)."""
    outer_lr: float = 0.7
    """Learning rate of the outer SGD step on the averaged pseudo-gradient."""
    outer_momentum: float = 0.9
    """Momentum of the outer SGD step."""
    outer_nesterov: bool = True
    """Nesterov momentum in the outer step."""
    wire: str = "fp32"
    """Pseudo-gradient wire format: fp32 | bf16 | fp8 | int8 | int4 | int2 | topk | topk-int4 | topk-int2 |
    topk-rice | topk-rice-int4 | topk-rice-int2 (fp8/int8/int4/int2 with per-block fp32 scales; topk* keep topk_k
    of every topk_chunk values; topk-rice* send the same values with Rice-coded offsets, fewer bytes)."""
    block_size: int = 256
    """Elements per scale for fp8 / int8 / int4 / int2 (and the kept values of topk-int4 / topk-int2)."""
    topk_chunk: int = 256
    """Top-k chunk (power of two); kept positions travel as log2(topk_chunk)-bit offsets."""
    topk_k: int = 8
    """Values kept per top-k chunk."""
    error_feedback: str = "auto"
    """auto (on for int4/int2/topk*, off for fp32/bf16/fp8/int8) | on | off: keep what the codec dropped
    and add it to the fragment's next pseudo-gradient."""
    ef_decay: float = 1.0
    """In (0, 1]: the kept residual is multiplied by it before it is added (SparseLoCo's error-feedback decay;
    1 = plain error feedback). Below 1 it needs error feedback on."""
    bucket_mb: float = 0.0
    """Bucket cap of a fragment's outer all-reduce in MB; 0 = one bucket per fragment."""


@dataclass(kw_only=True)
class FtConfig:
    """Fault-tolerant DiLoCo across separate launches (torchft; ``pip install 'lowband[ft]'``): each replica
    group is its own ``python -m lowband.train`` / ``torchrun`` launch, possibly on its own machine; groups
    meet through a Lighthouse (``python -m lowband.lighthouse``), may fail and return, and a returning group
    is healed from a live peer. docs/diloco.md, "Training across machines"."""

    enabled: bool = False
    """Run this launch as one replica group of a fault-tolerant run (needs strategy.name = diloco and
    diloco.num_replicas = 1)."""
    lighthouse: str = ""
    """Lighthouse URL, http://HOST:PORT; "" = the TORCHFT_LIGHTHOUSE environment variable."""
    group: int = -1
    """This group's index, in [0, ft.groups): its name (lowband_group_<group>) and its part of the data."""
    groups: int = 1
    """Replica groups the run is planned for: the data are split into this many parts, one per group."""
    min_replicas: int = 1
    """Groups a sync needs; with fewer alive the quorum waits (up to ft.quorum_timeout_s)."""
    host: str = ""
    """Address other machines reach this group at (ManagerServer, TCPStore, heal server); "" = the hostname."""
    timeout_s: float = 60.0
    """Cross-group collectives, commit votes and heal transfers; a hung peer costs at most this."""
    quorum_timeout_s: float = 300.0
    """How long a quorum may wait for ft.min_replicas groups before the run stops (exit 1)."""
    connect_timeout_s: float = 30.0
    """Connecting to the Lighthouse (an unreachable one stops the launch before training, exit 2) and peers."""
    init_sync: bool = False
    """At step 0 copy the first group's model and inner optimizer to every other group (torchft's init_sync).
    Off: groups seeded alike start equal and all contribute from the first sync; groups whose weights differ at
    step 0 (another run.seed, or machines whose random initialization differs) are refused naming them."""


SCHEDULE_KEYS = {"num_fragments": "diloco.fragments", "sync_every": "diloco.sync_every", "delay": "diloco.delay"}
"""The config keys of :func:`lowband.diloco.schedule.validate_schedule`'s arguments (its messages name them)."""


@contextlib.contextmanager
def library_check() -> Iterator[None]:
    """Run a library validator called with the config's key names: its ``ValueError`` / ``TypeError`` (one line
    naming the key) becomes a :class:`ConfigError` with the same message."""
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from e


def inner_class(cfg: Any) -> type[Strategy]:
    """The strategy class of ``diloco.inner`` (``ConfigError`` naming the choices for another name)."""
    if cfg.diloco.inner not in INNER:
        raise ConfigError(f"diloco.inner must be one of {', '.join(INNER)}; got {cfg.diloco.inner!r}")
    return get_strategy_class(cfg.diloco.inner)


def inner_gtp_size(cfg: Any, world_size: int) -> int:
    """GTP group size inside a replica (:meth:`Strategy.inner_gtp_size` of ``diloco.inner``; 1 = none)."""
    per_replica = world_size // (cfg.diloco.num_replicas or world_size)
    return inner_class(cfg).inner_gtp_size(cfg, per_replica)


def lighthouse_url(cfg: Any) -> str:
    """``ft.lighthouse``, else the ``TORCHFT_LIGHTHOUSE`` environment variable ("" if neither)."""
    import os

    return cfg.ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")


def validate_ft(cfg: Any) -> None:
    """The ``[ft]`` section of a fault-tolerant launch (local checks, before any process group)."""
    import importlib.util

    f = cfg.ft
    if cfg.diloco.num_replicas != 1:
        raise ConfigError(f"ft.enabled = true: each launch is one replica group, so diloco.num_replicas must be 1 "
                          f"(the other groups are other launches, met through the Lighthouse); got "
                          f"{cfg.diloco.num_replicas}")
    if not 0 <= f.group < f.groups:
        raise ConfigError(f"ft.group must be in [0, ft.groups = {f.groups}) (this group's index: its name and its "
                          f"part of the data); got {f.group}")
    if f.min_replicas > f.groups:
        raise ConfigError(f"ft.min_replicas ({f.min_replicas}) must be <= ft.groups ({f.groups})")
    url = lighthouse_url(cfg)
    if not url:
        raise ConfigError("ft.lighthouse is empty and TORCHFT_LIGHTHOUSE is not set: give the URL that "
                          "`python -m lowband.lighthouse` printed (http://HOST:PORT)")
    if not url.startswith(("http://", "https://")) or ":" not in url.split("//", 1)[1]:
        raise ConfigError(f"ft.lighthouse must be a URL http://HOST:PORT; got {url!r}")
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError("ft.enabled = true needs torchft: pip install 'lowband[ft]' (torchft==0.2.0)")


AGREED_SECTIONS = ("model", "optim")
"""Config sections every fault-tolerant replica group must share (key by key), besides DiLoCo's own settings."""
AGREED_KEYS = ("run.steps", "run.dtype", "data.batch_size", "data.grad_accum", "data.source", "ft.groups",
               "diloco.inner", "diloco.outer_lr", "diloco.outer_momentum", "diloco.outer_nesterov",
               "strategy.grad_wire_dtype")


def ft_agreed_settings(cfg: Any, world_size: int) -> dict[str, object]:
    """The trainer settings fault-tolerant replica groups must share (a group that differs is refused at
    join, naming the key): the model and optimizer sections, the schedule length, the inner strategy and
    its section, the outer optimizer, and the ranks per group (a heal copies group rank ``r`` to ``r``)."""
    import dataclasses

    out: dict[str, object] = {"ranks per replica group (run.world_size)": world_size}
    for sec in (*AGREED_SECTIONS, *inner_class(cfg).ft_agreed_sections):
        for fld in dataclasses.fields(getattr(cfg, sec)):
            out[f"{sec}.{fld.name}"] = getattr(getattr(cfg, sec), fld.name)
    for key in AGREED_KEYS:
        sec, name = key.split(".")
        out[key] = getattr(getattr(cfg, sec), name)
    return out


@register_strategy("diloco")
class DilocoStrategy(Strategy):
    config_sections = ("strategy", "diloco", "ft")  # + the sections of diloco.inner's strategy (--help-strategy)

    @classmethod
    def accepts_fp8_grads(cls, cfg) -> bool:
        """fp8 gradients are the inner data parallelism's (:meth:`Strategy.accepts_fp8_grads_inner`: a sharded
        inner reduce-scatters them)."""
        return cfg.diloco.inner in INNER and inner_class(cfg).accepts_fp8_grads_inner(cfg)

    @classmethod
    def validate_config(cls, cfg, world_size: int) -> None:
        super().validate_config(cfg, world_size)
        d = cfg.diloco
        replicas = d.num_replicas or world_size
        if d.num_replicas < 0 or world_size % replicas:
            raise ConfigError(f"diloco.num_replicas must be 0 (one per rank) or a divisor of run.world_size "
                              f"({world_size}); got {d.num_replicas}")
        with library_check():  # the rules StreamingDiLoCo and its codecs enforce, by their own validators
            validate_schedule(d.fragments, d.sync_every, d.delay, names=SCHEDULE_KEYS)
            check_alpha(d.alpha, name="diloco.alpha")
            check_wire(d.wire, allowed=WIRES, what="diloco.wire")
            check_block_size(d.block_size, name="diloco.block_size")
            check_topk(d.topk_chunk, d.topk_k, names={"topk_chunk": "diloco.topk_chunk", "topk_k": "diloco.topk_k"})
        if d.error_feedback not in ERROR_FEEDBACK:
            raise ConfigError(f"diloco.error_feedback must be one of {', '.join(ERROR_FEEDBACK)}; "
                              f"got {d.error_feedback!r}")
        with library_check():
            check_ef_decay(d.ef_decay, name="diloco.ef_decay")
        ef_on = ERROR_FEEDBACK[d.error_feedback]
        if d.ef_decay != 1.0 and not (default_error_feedback(d.wire) if ef_on is None else ef_on):
            raise ConfigError(f"diloco.ef_decay = {d.ef_decay} decays the error-feedback residual, but error feedback "
                              f"is off (diloco.wire = {d.wire!r}, diloco.error_feedback = {d.error_feedback!r}): set "
                              "diloco.error_feedback = 'on' or leave diloco.ef_decay at 1")
        with library_check():
            check_outer_sgd(d.outer_lr, d.outer_momentum,
                            names={"lr": "diloco.outer_lr", "momentum": "diloco.outer_momentum"})
        if d.bucket_mb < 0:  # 0 = one bucket per fragment (StreamingDiLoCo's bucket_cap_mb = None)
            raise ConfigError(f"diloco.bucket_mb must be >= 0; got {d.bucket_mb}")
        cls._validate_inner(cfg, world_size // replicas)
        if cfg.ft.enabled:
            validate_ft(cfg)

    @staticmethod
    def _validate_inner(cfg, per_replica: int) -> None:
        """``diloco.inner`` and the settings of the strategy inside a replica of ``per_replica`` ranks (its
        :meth:`Strategy.validate_inner`)."""
        inner_cls = inner_class(cfg)
        if cfg.sparse.tables and not inner_cls.sparse_rows:
            raise ConfigError(f"sparse.tables = {list(cfg.sparse.tables)} needs diloco.inner = "
                              f"{' or '.join(n for n in INNER if get_strategy_class(n).sparse_rows)} (the sharded "
                              f"optimizer exchanges a table's touched rows); got diloco.inner = {cfg.diloco.inner}")
        inner_cls.validate_inner(cfg, per_replica)

    # ------------------------------------------------------------------------------------------ setup
    def setup(self, model: nn.Module) -> None:
        """Build the replica x dp x gtp mesh, set the inner strategy up on it, then Streaming DiLoCo on the
        replica axis. Collectives: the mesh's groups, the inner strategy's initial sync, DiLoCo's
        settings check and initial broadcast over the replica group."""
        d = self.cfg.diloco
        world = self.env.world_size
        replicas = d.num_replicas or world
        gtp = inner_gtp_size(self.cfg, world)
        plan = self.model_plan(model)
        inner_cls = inner_class(self.cfg)
        if inner_cls.needs_parallel_linears and not plan.parallel_linears:
            raise ConfigError(f"diloco.inner = {d.inner} needs the model plan's parallel_linears (the linears "
                              f"to shard); the plan of {type(model).__name__} lists none")
        inner_cls.check_inner_model(model)  # before the mesh's collectives
        # fragments by name, cut from the unsharded model, so every inner strategy syncs the same split
        frag_names = [f.names for f in split_fragments(model, d.fragments, plan=plan)]
        self.mesh = build_mesh(replica=replicas, dp=world // (replicas * gtp), gtp=gtp, ledger=self.env.ledger)
        inner = inner_cls(self.cfg, self.env)
        inner.plan, inner.forward = plan, self.forward
        inner.prepare_inner()
        inner.setup_on_mesh(model, self.mesh)
        self.inner = inner
        self.model, self.optimizer = inner.model, inner.optimizer
        params = dict(inner.unwrapped().named_parameters())
        shards = GTPShardLayout(inner.unwrapped())
        # GTP inside: each fragment lists its whole (replicated) parameters first, then its row shards, with
        # a bucket break between them (whole_first, for every wire): the replicated values are then encoded
        # alone, identically on every rank of the replica, and stay identical there under block / top-k codecs
        fragments, breaks = [], []
        for i, names in enumerate(frag_names):
            frag = Fragment(i, list(names), [params[n] for n in names])
            breaks.append(whole_first(frag))
            fragments.append(frag.params)

        membership = self._ft_membership(inner) if self.cfg.ft.enabled else None
        self.diloco = StreamingDiLoCo(inner.unwrapped(), self.optimizer, comm=self.mesh.replica,
                                      sync_every=d.sync_every, fragments=fragments, delay=d.delay, alpha=d.alpha,
                                      outer_optimizer=outer_sgd(d.outer_lr, d.outer_momentum, d.outer_nesterov),
                                      wire=d.wire, block_size=d.block_size,
                                      topk_chunk=d.topk_chunk, topk_k=d.topk_k,
                                      error_feedback=ERROR_FEEDBACK[d.error_feedback], ef_decay=d.ef_decay,
                                      bucket_cap_mb=d.bucket_mb or None,
                                      bucket_breaks=breaks if shards.weights else None, plan=plan,
                                      membership=membership)
        if membership is not None:  # what every replica group must share, checked at each new quorum
            self.diloco.agreed_settings.update(ft_agreed_settings(self.cfg, world))
            self.diloco.add_attempt_callback(lambda _d, _i, ok: self._count_attempt(ok))
        if shards.weights:  # GTP inside: DiLoCo's per-parameter state is saved in logical (whole) shapes
            self.diloco.state_layout = shards
        if self.env.world_size > 1:  # residual rows as DTensors (logical state): on the mesh's own DeviceMesh
            dev = self.env.device.type
            self.diloco.dcp_meshes[(dev, replicas, world // replicas)] = self.mesh.device_mesh(dev)

    def _ft_membership(self, inner: Strategy) -> Any:
        """This launch as one replica group of a fault-tolerant run: its torchft Manager (healing state: the
        model and inner optimizer, :mod:`lowband.diloco.ft_state`) and the membership StreamingDiLoCo uses."""
        import logging
        import os

        os.environ.setdefault("RUST_LOG", "warn")  # before torchft loads: its Rust side logs every quorum at INFO
        if os.environ.get("LOWBAND_DEBUG", "") in ("", "0"):
            # torchft's Python side warns at every quorum (CPU torch) and logs a traceback for every collective a
            # dead peer broke (routed to a rolled-back sync, not an error): into this rank's log file, not stderr
            from pathlib import Path

            from lowband.train.errors import log_path_for

            path = log_path_for(Path(self.cfg.run.out_dir) / self.cfg.run.name, self.env.rank)
            assert path is not None
            path.parent.mkdir(parents=True, exist_ok=True)
            handler = logging.FileHandler(path, delay=True)
            handler.setLevel(logging.WARNING)
            handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
            ft_logger = logging.getLogger("torchft")
            ft_logger.handlers = [handler]
            ft_logger.propagate = False
        from lowband.diloco.ft import TorchftMembership
        from lowband.diloco.ft_group import FtOptions, build_manager
        from lowband.diloco.ft_state import load_local_state, local_state

        f = self.cfg.ft
        options = FtOptions(lighthouse=lighthouse_url(self.cfg), replica_id=f"lowband_group_{f.group}",
                            min_replicas=f.min_replicas, host=f.host, timeout_s=f.timeout_s,
                            quorum_timeout_s=f.quorum_timeout_s, connect_timeout_s=f.connect_timeout_s,
                            init_sync=f.init_sync)
        model, optimizer = inner.unwrapped(), inner.optimizer
        self.ft_counts = {"heals": 0, "rollbacks": 0}  # for the log line: heals from a peer, rolled-back syncs

        def heal(sd: Any) -> None:
            load_local_state(model, optimizer, sd)
            self.ft_counts["heals"] += 1

        self.ft_manager, self._ft_store = build_manager(
            options, self.env.metrics_comm, state_dict=lambda: local_state(model, optimizer), load_state_dict=heal)
        return TorchftMembership(self.ft_manager, ledger=self.env.ledger)

    def _count_attempt(self, committed: bool) -> None:
        if not committed:
            self.ft_counts["rollbacks"] += 1

    @property
    def fault_tolerant(self) -> bool:
        """This launch is one replica group of a fault-tolerant run (``ft.enabled``)."""
        return getattr(self, "ft_manager", None) is not None

    def register_heal_state(self, key: str, save: Any, load: Any) -> None:
        """Add state a healing group copies from its peer after the model, inner optimizer and DiLoCo state
        (the trainer's step and LR schedule): ``save() -> obj`` on the peer, ``load(obj)`` here."""
        self.ft_manager.register_state_dict_fn(key, load, save)

    def close(self) -> None:
        """Leave the fault-tolerant run (stop this group's torchft Manager); nothing to do otherwise."""
        manager = getattr(self, "ft_manager", None)
        if manager is not None:
            self.ft_manager = None
            manager.shutdown(wait=False)

    @classmethod
    def data_partition(cls, cfg: Any, rank: int, world_size: int) -> tuple[int, int]:
        """Fault-tolerant groups split the data ``ft.groups`` ways: group ``g``'s rank ``r`` reads part
        ``g * world_size + r`` of ``ft.groups * world_size``."""
        if cfg.ft.enabled:
            return cfg.ft.group * world_size + rank, cfg.ft.groups * world_size
        return rank, world_size

    # ------------------------------------------------------------------------------ the step (inner)
    @contextlib.contextmanager
    def microbatch(self, last: bool) -> Iterator[None]:
        with self.inner.microbatch(last):
            yield

    def clip_grad_norm(self, max_norm: float) -> float:
        return self.inner.clip_grad_norm(max_norm)

    def optimizer_step(self) -> None:
        self.inner.optimizer_step()  # the inner optimizer's step post-hook runs the DiLoCo schedule

    def skip_step(self) -> None:
        """No inner step, so the DiLoCo hook does not run; an in-flight fragment stays in flight."""
        self.inner.skip_step()

    def observe_batch(self, tokens: torch.Tensor) -> None:
        self.inner.observe_batch(tokens)

    def unwrapped(self) -> nn.Module:
        return self.inner.unwrapped()

    def replica_id(self) -> int:
        """The mesh's replica coordinate: replicas differ between syncs; the ranks inside one must agree."""
        return self.mesh.coords.replica

    def optimizer_state_bytes(self) -> int:
        total = self.inner.optimizer_state_bytes()
        for o in self.diloco.outer:
            for state in o.state.values():
                total += sum(v.numel() * v.element_size() for v in state.values()
                             if isinstance(v, torch.Tensor))
        total += sum(g.numel() * g.element_size() for gs in self.diloco.globals for g in gs)
        total += sum(r.numel() * r.element_size() for r in self.diloco.residuals if r is not None)
        return total

    def persistent_buffer_bytes(self) -> int:
        """The inner strategy's persistent buffers (sharded flat grads, GTP gather pools), if it has any."""
        fn = getattr(self.inner, "persistent_buffer_bytes", None)
        return int(fn()) if fn is not None else 0

    def log_extras(self) -> dict[str, Any]:
        extras = {**self.inner.log_extras(), "outer_steps": self.diloco.committed}
        if self.fault_tolerant:  # groups in the latest quorum; heals from a peer and rolled-back syncs so far
            extras.update(ft_groups=self.ft_manager.num_participants(), ft_heals=self.ft_counts["heals"],
                          ft_rollbacks=self.ft_counts["rollbacks"])
        return extras

    def summary_extras(self) -> dict[str, Any]:
        """``outer_steps`` (committed outer syncs) and ``diloco_global_sha256``: per rank of this job, the SHA-256
        of that rank's global copies (every fragment, in order, raw bytes); one ``all_gather_object`` of the
        hex strings (tag ``summary``). Replicas that agree have equal digests rank for rank, which is how
        ``python -m lowband.bench goodput`` checks that the groups of a fault-tolerant run ended bitwise equal."""
        digest = hashlib.sha256()
        for gs in self.diloco.globals:
            for g in gs:
                digest.update(g.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        per_rank = self.env.metrics_comm.all_gather_object(digest.hexdigest(), tag="summary")
        return {"outer_steps": self.diloco.committed, "diloco_global_sha256": per_rank}

    # ----------------------------------------------------------------------------------------------
    # Checkpoint hooks (docs/checkpoints.md); layout: lowband.diloco.state.DilocoCheckpoint, rank-local (no
    # gather): the replica's model and inner optimizer state as per-replica (replicas, ...) rows of rank-local
    # chunks (for ddp, torch AdamW's state per parameter; for the others, the inner strategy's own rank-local
    # layout: ShardedStateLayout, GTPStateLayout, GTPMuonStateLayout), global copies / outer momentum /
    # counters / in-flight fragment replicated (with GTP inside: each rank's real rows), error-feedback
    # residuals per replica. The format tag carries the replica count and the inner kind: a checkpoint
    # resumes with as many replicas and the same inner strategy (any dp / gtp size inside a replica).
    # skip_step keeps an in-flight fragment in flight.

    def _ckpt_layout(self):
        from lowband.diloco.state import DilocoCheckpoint

        if getattr(self, "_ckpt", None) is None:
            m = self.mesh
            per = m.shape.dp * m.shape.gtp
            self._ckpt = DilocoCheckpoint(self.unwrapped(), self.optimizer, self.diloco, m.shape.replica, per,
                                          m.coords.replica, inner=self.inner.inner_checkpoint())
        return self._ckpt

    def checkpoint_format(self) -> str | None:
        part = self.inner.inner_format()  # None: the format of the first DiLoCo checkpoints (ddp inside)
        return f"diloco-r{self.mesh.shape.replica}-{part}-v1" if part else f"diloco-r{self.mesh.shape.replica}-v1"

    def resume_settings(self) -> dict[str, Any]:
        """The fragment schedule: a checkpoint holds its position inside a fragment period (the local step) and
        which fragment is in flight, which mean nothing under another ``sync_every``, ``fragments`` or ``delay``;
        whether error feedback is in effect (the residuals) and the outer momentum (its buffers); and the inner
        strategy's own."""
        d = self.cfg.diloco
        return {"diloco.sync_every": d.sync_every, "diloco.fragments": d.fragments, "diloco.delay": d.delay,
                # residuals exist only with error feedback on (auto: on for the message codecs of diloco.wire): a
                # resume without would drop the mass they hold, one with would miss them
                "diloco.error_feedback (in effect, auto follows diloco.wire)": "on" if self.diloco.error_feedback
                else "off",
                # the outer SGD's momentum buffers are saved only with momentum on: a resume without would drop
                # them silently, one with would miss them
                "diloco.outer_momentum (in effect)": "on" if d.outer_momentum != 0 else "off",
                **self.inner.resume_settings()}

    def resume_notices(self) -> dict[str, Any]:
        """The outer SGD's hyperparameters: the checkpoint holds none of them (only the momentum buffers), so a
        resume applies this run's; a change is announced, not refused (as for the inner optimizer's lr)."""
        d = self.cfg.diloco
        return {"diloco.outer_lr": d.outer_lr, "diloco.outer_momentum": d.outer_momentum,
                "diloco.outer_nesterov": d.outer_nesterov}

    def state_dict(self) -> dict[str, Any]:
        return self._ckpt_layout().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._ckpt_layout().load_state_dict(state)

    def fit_resume_template(self, state: dict[str, Any], saved_keys: set[str]) -> None:
        """Files of the first rank-local-less format kept a GTP inner's in-flight fragment in the
        ``inflight`` blob: :meth:`lowband.diloco.state.DilocoCheckpoint.fit_template`."""
        self._ckpt_layout().fit_template(state, saved_keys)

    def prepare_resume(self) -> None:
        self.inner.prepare_resume()

    def param_shapes(self) -> dict[str, tuple[list[int], str]]:
        return self.inner.param_shapes()
