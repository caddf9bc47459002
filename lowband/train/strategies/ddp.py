"""``ddp``: torch ``DistributedDataParallel`` with torch AdamW, the baseline to beat.

Communication: DDP's bucketed gradient all-reduce, routed through :class:`lowband.comm.Comm` by a DDP
communication hook (``all_reduce(avg)`` per bucket, async, tag ``grad``) so the ledger counts it.
State: every rank holds the full parameters, gradients and AdamW moments (replicated).
Gradient accumulation: non-final microbatches run under ``no_sync()``.

Parameters that get no gradient on some steps (conditional branches, MoE routing, early exits) need
``strategy.find_unused_parameters = true`` (torch DDP's ``find_unused_parameters``: one graph walk per
step marks them ready; one used on some ranks only is averaged with zeros, one used on no rank keeps
``.grad = None`` and torch AdamW leaves it untouched). Without it, the first step that leaves a parameter
without a gradient ends the run with one line naming the key (:func:`unused_parameters_error`, exit 2)
instead of torch's error. Frozen parameters (``requires_grad=False``) need nothing: DDP skips them.
"""

# No `from __future__ import annotations`: DDP inspects the comm hook's annotations at run time.

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lowband.comm import Comm
from lowband.parallel.mesh import ParallelMesh
from lowband.train.config import Config, ConfigError
from lowband.train.optimizers import torch_adamw
from lowband.train.strategies import register_strategy
from lowband.train.strategies.base import Strategy

_WIRE = {"float32": None, "bfloat16": torch.bfloat16}


def ledger_allreduce_hook(state: tuple[Comm, torch.dtype | None],
                          bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket through ``Comm.all_reduce`` (counted in its ledger)."""
    comm, wire = state
    return comm.all_reduce(bucket.buffer(), "avg", wire_dtype=wire, async_op=True, tag="grad").future()


def wrap_ddp(model: nn.Module, device: torch.device, comm: Comm, cfg: Config) -> DistributedDataParallel:
    """``model`` in torch DDP over ``comm``'s group, its bucket all-reduce routed through ``comm``.

    DDP's construction broadcasts parameters and buffers from the group's first rank (its init sync, on the
    process group directly); ``forward_sync_buffers=False`` (torch 2.13's name for the deprecated
    ``broadcast_buffers=False``, which warned) skips DDP's buffer broadcast before every forward."""
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, process_group=comm.group,
        bucket_cap_mb=cfg.strategy.bucket_mb, gradient_as_bucket_view=True, forward_sync_buffers=False,
        find_unused_parameters=cfg.strategy.find_unused_parameters)
    ddp.register_comm_hook((comm, _WIRE[cfg.strategy.grad_wire_dtype]), ledger_allreduce_hook)
    return ddp


UNFINISHED = "Expected to have finished reduction"
"""The start of torch DDP's error for a parameter that got no gradient (``find_unused_parameters=False``)."""


def unused_parameters_error(where: str) -> ConfigError:
    """The one-line error that replaces torch's "Expected to have finished reduction ..." (``where`` is the
    strategy as the config names it)."""
    return ConfigError(f"{where}: a trainable parameter got no gradient in this step (a branch, route or layer "
                       "the loss did not use); set strategy.find_unused_parameters = true (on the CLI: "
                       "--strategy.find_unused_parameters=true), or freeze it with requires_grad_(False)")


@contextlib.contextmanager
def unused_parameters_as_config_error(model: nn.Module, where: str) -> Iterator[None]:
    """Turn torch DDP's unused-parameter ``RuntimeError`` raised in the body into
    :func:`unused_parameters_error`; other exceptions pass unchanged."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(model, DistributedDataParallel) and UNFINISHED in str(e):
            raise unused_parameters_error(where) from e
        raise


def check_reduction_finished(model: nn.Module, where: str) -> None:
    """After the last microbatch's backward: raise :func:`unused_parameters_error` if DDP (without
    ``find_unused_parameters``) did not reduce every bucket, i.e. some parameter got no gradient on this
    rank, before the optimizer would apply partly averaged gradients. Local: no communication."""
    if isinstance(model, DistributedDataParallel) and not model.find_unused_parameters:
        with unused_parameters_as_config_error(model, where):
            model._check_reducer_finalized()


@register_strategy("ddp")
class DDPStrategy(Strategy):
    config_sections = ("strategy",)
    diloco_inner = True

    def setup(self, model: nn.Module) -> None:
        if self.env.world_size > 1:
            self.model = wrap_ddp(model, self.env.device, self.env.comm, self.cfg)
        else:
            self.model = model
        o = self.cfg.optim
        self.optimizer = torch_adamw(model, o)

    def setup_on_mesh(self, model: nn.Module, mesh: ParallelMesh) -> None:
        """DDP over ``mesh.dp`` (e.g. the ranks of one DiLoCo replica) + torch AdamW; ``mesh.gtp`` and
        ``mesh.tp`` must have size 1. DDP's construction broadcasts the weights from the group's first
        rank, so the ranks of ``mesh.dp`` start equal; replicas are made equal by the caller (DiLoCo's
        ``init_sync`` broadcast over ``mesh.replica``). :meth:`setup` keeps DDP over the world ``Comm``."""
        if mesh.gtp.size != 1 or mesh.tp.size != 1:
            raise ValueError(f"strategy ddp: the mesh has gtp = {mesh.gtp.size}, tp = {mesh.tp.size}; DDP "
                             "replicates the model over the dp axis only (both must be 1)")
        self.mesh = mesh
        self.where = "diloco.inner = ddp"
        self.model = wrap_ddp(model, self.env.device, mesh.dp, self.cfg) if mesh.dp.size > 1 else model
        self.optimizer = torch_adamw(model, self.cfg.optim)

    where = "strategy ddp"
    """How errors name this strategy (``diloco.inner = ddp`` inside DiLoCo)."""

    def inner_checkpoint(self) -> None:
        """Inside DiLoCo the inner torch AdamW's state is saved per parameter (``DilocoCheckpoint``'s own)."""
        return None

    def inner_format(self) -> None:
        """The first DiLoCo checkpoint format, ``diloco-r<R>-v1``, unchanged."""
        return None

    @contextlib.contextmanager
    def microbatch(self, last: bool) -> Iterator[None]:
        with unused_parameters_as_config_error(self.model, self.where):
            if last or not isinstance(self.model, DistributedDataParallel):
                yield
            else:
                with self.model.no_sync():
                    yield
            if last:
                check_reduction_finished(self.model, self.where)
