"""The strategy interface: how a model is distributed and optimized.

A strategy receives the freshly built model and returns, via ``setup``, the module to call in forward
(``self.model``) and a ``torch.optim.Optimizer`` (``self.optimizer``) whose ``param_groups`` the
trainer's LR schedule scales. Ranks may have built different initial weights (a factory that seeds
``seed + rank``); ``setup`` makes them agree (DDP's broadcast, the components' ``init_sync``).

Before ``setup`` the trainer sets ``self.plan`` (the model's :class:`~lowband.plan.ModelPlan`: what to
split, which tables are sparse, the fragments; strategies read model structure from it, never from
attribute names) and ``self.forward`` (the loss convention, :mod:`lowband.train.forward`). The trainer
loop is::

    for micro in range(accum):
        with strategy.microbatch(last=micro == accum - 1):
            (lm_loss(strategy.model, x, y, strategy.forward) / accum).backward()
    grad_norm = strategy.clip_grad_norm(max_norm)
    strategy.optimizer_step()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from lowband.plan import ModelPlan, plan_for
from lowband.train.errors import ConfigError
from lowband.train.forward import lm_loss

if TYPE_CHECKING:
    from lowband.train.config import Config
    from lowband.train.env import DistEnv


class Strategy:
    """Base class; subclasses register with :func:`lowband.train.strategies.register_strategy`."""

    name: ClassVar[str] = "base"
    min_world_size: ClassVar[int] = 1
    max_world_size: ClassVar[int | None] = None
    config_sections: ClassVar[tuple[str, ...]] = ()
    """Config sections (besides run, model, data, optim, checkpoint, guard) this strategy reads; ``--help-strategy``
    prints them."""
    needs_parallel_linears: ClassVar[bool] = False
    fp8_grads: ClassVar[bool] = False
    """True for strategies whose gradient reduce-scatter can carry block-scaled fp8
    (``strategy.grad_wire_dtype = "fp8"``, :func:`lowband.comm.codecs.codec_reduce_scatter`)."""
    """True for strategies that split the plan's ``parallel_linears`` (tp, gtp): the trainer refuses a
    model whose plan lists none, naming the strategy and the model class."""

    def __init__(self, cfg: Config, env: DistEnv) -> None:
        self.cfg = cfg
        self.env = env
        self.model: nn.Module
        self.optimizer: torch.optim.Optimizer
        self.plan: ModelPlan | None = None
        """The model's plan (set by the trainer before :meth:`setup`); read it through :meth:`model_plan`."""
        self.forward: str = "targets"
        """The model's resolved loss convention, ``targets`` or ``logits`` (set by the trainer)."""

    def model_plan(self, model: nn.Module) -> ModelPlan:
        """The plan the trainer gave (:attr:`plan`), else ``lowband.plan.plan_for(model)`` (a strategy set up
        outside the trainer, e.g. by a benchmark)."""
        return self.plan if self.plan is not None else plan_for(model)

    @classmethod
    def validate_config(cls, cfg: Config, world_size: int) -> None:
        """Raise ``ConfigError`` if this strategy cannot run ``cfg`` on ``world_size`` ranks."""
        if world_size < cls.min_world_size or (cls.max_world_size is not None
                                                and world_size > cls.max_world_size):
            hi = "any" if cls.max_world_size is None else str(cls.max_world_size)
            raise ConfigError(f"strategy.name = {cls.name!r} needs between {cls.min_world_size} and {hi} "
                              f"ranks; run.world_size is {world_size}")
        if cfg.strategy.grad_wire_dtype == "fp8" and not cls.accepts_fp8_grads(cfg):
            raise ConfigError(f"strategy.grad_wire_dtype = 'fp8' (block-scaled fp8 gradients) is implemented for "
                              f"sharded-adamw, sharded-muon and gtp (and diloco.inner = sharded-*) only; "
                              f"strategy.name is {cls.name!r}: use float32 or bfloat16")

    @classmethod
    def accepts_fp8_grads(cls, cfg: Config) -> bool:
        """Whether ``strategy.grad_wire_dtype = "fp8"`` works with this strategy under ``cfg``."""
        return cls.fp8_grads

    def setup(self, model: nn.Module) -> None:
        raise NotImplementedError

    # ----------------------------------------------------------------------------------------------
    # Inside a DiLoCo replica (``diloco.inner``). The ``diloco`` strategy builds the replica x dp x gtp mesh,
    # sets the inner strategy up on it with :meth:`setup_on_mesh` and asks it only through these hooks, so a
    # strategy becomes a DiLoCo inner by implementing them (no branch on its name in ``diloco``).

    diloco_inner: ClassVar[bool] = False
    """Whether this strategy can run inside a DiLoCo replica (it implements :meth:`setup_on_mesh`)."""
    sparse_rows: ClassVar[bool] = False
    """Whether this strategy exchanges only the touched rows of ``sparse.tables`` (else they are refused)."""
    ft_agreed_sections: ClassVar[tuple[str, ...]] = ()
    """This strategy's config sections that fault-tolerant replica groups running it must share, key by key."""

    @classmethod
    def inner_gtp_size(cls, cfg: Config, per_replica: int) -> int:
        """The size of the mesh's ``gtp`` axis this strategy shards over inside a replica of ``per_replica``
        ranks (the rest is ``dp``). Default 1: no GTP axis."""
        return 1

    @classmethod
    def validate_inner(cls, cfg: Config, per_replica: int) -> None:
        """Raise ``ConfigError`` if this strategy cannot run ``cfg`` inside a DiLoCo replica of ``per_replica``
        ranks (local checks, every rank alike). Default: nothing."""

    @classmethod
    def accepts_fp8_grads_inner(cls, cfg: Config) -> bool:
        """Whether ``strategy.grad_wire_dtype = "fp8"`` works with this strategy inside a DiLoCo replica."""
        return False

    @classmethod
    def check_inner_model(cls, model: nn.Module) -> None:
        """Refuse (``ConfigError``, no communication) a model this strategy cannot shard inside a replica,
        before the mesh's collectives. Default: nothing."""

    def setup_on_mesh(self, model: nn.Module, mesh: Any) -> None:
        """:meth:`setup` on the ranks of ``mesh`` (a :class:`lowband.parallel.mesh.ParallelMesh`, e.g. one DiLoCo
        replica's): the data-parallel group is ``mesh.dp``, GTP shards over ``mesh.gtp``."""
        raise NotImplementedError(f"strategy {self.name} cannot run inside a DiLoCo replica")

    def prepare_inner(self) -> None:
        """Called inside DiLoCo after construction, before :meth:`setup_on_mesh` (a strategy whose updated
        weights arrive after ``step()`` makes them arrive within it: DiLoCo's step hook reads them). Default:
        nothing."""

    def inner_checkpoint(self) -> Any:
        """What :class:`lowband.diloco.state.DilocoCheckpoint` nests as the replica's model and optimizer: an
        object with rank-local ``state_dict()`` / ``load_state_dict(state)`` in the ``{"model", "optim"}`` form
        (default: this strategy's own checkpoint hooks), or ``None`` for the inner torch optimizer's state per
        parameter."""
        return self

    def inner_format(self) -> str | None:
        """This strategy's part of the DiLoCo checkpoint format tag (``diloco-r<R>-<part>-v1``; ``None``: the
        first DiLoCo format, ``diloco-r<R>-v1``). A checkpoint resumes only with the same inner strategy."""
        return self.name

    @contextlib.contextmanager
    def microbatch(self, last: bool) -> Iterator[None]:
        """Context for one microbatch's forward+backward; ``last`` is False while accumulating."""
        yield

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global gradient norm (clipped to ``max_norm`` if > 0); grads are already synchronized."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        if max_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True))
        return float(torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True))

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state tensors held by this rank."""
        total = 0
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total

    def log_extras(self) -> dict[str, Any]:
        """Extra per-step metrics for the log line and metrics.jsonl."""
        return {}

    def observe_batch(self, tokens: torch.Tensor) -> None:
        """Called once per step with the step's host (CPU) input tokens, all microbatches, before they
        move to the device (sparse embedding comms read their touched rows here). Default: nothing."""

    @classmethod
    def data_partition(cls, cfg: Config, rank: int, world_size: int) -> tuple[int, int]:
        """``(part, parts)``: which of how many data streams this rank reads (default: its rank of the world;
        fault-tolerant DiLoCo groups, separate launches, each take their own parts)."""
        return rank, world_size

    fault_tolerant: bool = False
    """This launch is one replica group of a fault-tolerant run: the trainer registers its step and LR
    schedule with :meth:`register_heal_state` (DiLoCo with ``ft.enabled``)."""

    def register_heal_state(self, key: str, save: Any, load: Any) -> None:
        """Only fault-tolerant strategies heal from a peer."""
        raise NotImplementedError(f"strategy {self.name} does not heal from a peer")

    def summary_extras(self) -> dict[str, Any]:
        """Strategy-specific fields of the run summary (``summary.json``), called once at the end of the run on
        every rank alike (it may run a collective). Default: none."""
        return {}

    def close(self) -> None:
        """Release what :meth:`setup` started outside the process group (called once, at the end of the run,
        also after an error). Default: nothing."""

    def unwrapped(self) -> nn.Module:
        """The plain model (for evaluation and checkpoints)."""
        return getattr(self.model, "module", self.model)

    def replica_id(self) -> int:
        """Which model replica this rank trains, for the trainer's replica check (``run.check_replicas_every``,
        :func:`lowband.consistency.check_replicas` over the world): ranks with the same id must hold bitwise
        equal replicated parameters (and equal shards where they hold the same GTP/TP shard). 0 on every rank,
        except under DiLoCo, whose replicas legitimately differ between syncs."""
        return 0

    # ----------------------------------------------------------------------------------------------
    # Checkpoint and guard hooks (see docs/checkpoints.md). The defaults fit a strategy whose state is
    # the full model on every rank plus one torch optimizer over its parameters (``single``, ``ddp``).
    # A strategy with sharded or extra state overrides all of them.

    def checkpoint_format(self) -> str | None:
        """Tag of the layout :meth:`state_dict` produces; a checkpoint loads only into a run whose strategy
        returns the same tag. ``None`` (the default for strategies that have not implemented their hooks)
        makes the trainer refuse to save or load. ``single`` and ``ddp`` share ``"replicated"``."""
        return _DEFAULT_CHECKPOINT_FORMATS.get(self.name)

    def resume_settings(self) -> dict[str, Any]:
        """Config keys (dotted name -> value) a checkpoint of this strategy must have been saved with to be
        resumed, beyond the model and the state format (recorded in the marker; a resume with other values is
        refused naming the key). Default: none."""
        return {}

    def resume_notices(self) -> dict[str, Any]:
        """Config keys (dotted name -> value) recorded in the marker whose change a resume accepts: the run trains
        with its own value, as its config says, and rank 0 prints one line naming each changed key with both
        values (the optimizer's hyperparameters get the same treatment from the checkpointer). Default: none."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """This rank's view of the strategy state, as ``torch.distributed.checkpoint`` (DCP) saves it.

        Values must be DCP-reshardable: plain tensors only where every rank holds the same full tensor
        under the same key (replicated; DCP writes one copy), ``DTensor`` for sharded state (DCP writes
        each shard once and reshards on load to any mesh), and small picklable objects that are the same
        on every rank. Keys must not depend on the rank or the world size.

        Default: ``{"model": ..., "optim": ...}`` from ``get_state_dict(model, optimizer)`` with flattened
        optimizer keys (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``), parameter FQNs without
        wrapper prefixes. Called on a fresh optimizer this runs ``optimizer.step()`` once with lr 0 and
        zero grads on every rank (DCP's state initialization), so it is called on all ranks alike.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer,
                                            options=StateDictOptions(flatten_optimizer_state_dict=True))
        return {"model": model_sd, "optim": optim_sd}

    def prepare_resume(self) -> None:
        """Called on every rank right before a checkpoint is loaded into this freshly set-up strategy.

        Brings one-time lazy state to where an uninterrupted run has it after its first step, so the
        resumed steps run the same arithmetic. Default: if ``self.model`` is ``DistributedDataParallel``,
        one throwaway forward/backward on a zero batch (gradients discarded, no optimizer step; one
        gradient all-reduce per bucket, before the first logged step), because DDP rebuilds its gradient
        buckets in gradient-ready order after its first synchronized backward, and with more than two
        ranks the ring all-reduce rounds differently for a different bucket layout.
        """
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(self.model, DistributedDataParallel):
            return
        seq = self.cfg.model.seq_len
        x = torch.zeros(1, seq, dtype=torch.long, device=self.env.device)
        lm_loss(self.model, x, x, self.forward).backward()
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.model.parameters():
            p.grad = None

    def fit_resume_template(self, state: dict[str, Any], saved_keys: set[str]) -> None:
        """Adapt the load template ``state`` (a fresh :meth:`state_dict`) to the checkpoint about to be
        loaded, whose flattened DCP keys (relative to this strategy's state) are ``saved_keys``: a layout
        that changed what it writes keeps loading the files of its earlier form. Default: nothing."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Apply ``state`` (a :meth:`state_dict` filled in by ``dcp.load``) to the model and optimizer."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"],
                       options=StateDictOptions(flatten_optimizer_state_dict=True))

    def param_shapes(self) -> dict[str, tuple[list[int], str]]:
        """Global (unsharded) shape and dtype of every parameter by FQN; checked against a checkpoint's
        before loading. Sharded strategies report the full shapes, not their local shards."""
        return {n: (list(p.shape), str(p.dtype).removeprefix("torch."))
                for n, p in self.unwrapped().named_parameters()}

    def skip_step(self) -> None:
        """Drop this step's gradients without touching parameters or optimizer state (the non-finite
        guard decided, identically on every rank, to skip the update). A strategy with gradient
        communication still in flight, or with state updated outside ``optimizer.step``, drains it
        here so that nothing is left half-updated."""
        self.optimizer.zero_grad(set_to_none=True)


_DEFAULT_CHECKPOINT_FORMATS = {"single": "replicated", "ddp": "replicated"}
