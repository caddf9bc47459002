"""``ddp``: torch ``DistributedDataParallel`` with torch AdamW, the baseline to beat.

Communication: DDP's bucketed gradient all-reduce, routed through :class:`lowband.comm.Comm` by a DDP
communication hook (``all_reduce(avg)`` per bucket, async, tag ``grad``) so the ledger counts it.
State: every rank holds the full parameters, gradients and AdamW moments (replicated).
Gradient accumulation: non-final microbatches run under ``no_sync()``.
"""

# No `from __future__ import annotations`: DDP inspects the comm hook's annotations at run time.

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lowband.comm import Comm
from lowband.train.optimizers import adamw_param_groups
from lowband.train.strategies import register_strategy
from lowband.train.strategies.base import Strategy

_WIRE = {"float32": None, "bfloat16": torch.bfloat16}


def ledger_allreduce_hook(state: tuple[Comm, torch.dtype | None],
                          bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket through ``Comm.all_reduce`` (counted in its ledger)."""
    comm, wire = state
    return comm.all_reduce(bucket.buffer(), "avg", wire_dtype=wire, async_op=True, tag="grad").future()


@register_strategy("ddp")
class DDPStrategy(Strategy):
    def setup(self, model: nn.Module) -> None:
        if self.env.world_size > 1:
            ddp = DistributedDataParallel(
                model, device_ids=[self.env.device.index] if self.env.device.type == "cuda" else None,
                bucket_cap_mb=self.cfg.strategy.bucket_mb, gradient_as_bucket_view=True,
                broadcast_buffers=False)
            ddp.register_comm_hook((self.env.comm, _WIRE[self.cfg.strategy.grad_wire_dtype]),
                                   ledger_allreduce_hook)
            self.model = ddp
        else:
            self.model = model
        o = self.cfg.optim
        self.optimizer = torch.optim.AdamW(adamw_param_groups(model, o.weight_decay), lr=o.lr,
                                           betas=(o.beta1, o.beta2), eps=o.eps, foreach=True)

    @contextlib.contextmanager
    def microbatch(self, last: bool) -> Iterator[None]:
        if last or not isinstance(self.model, DistributedDataParallel):
            yield
        else:
            with self.model.no_sync():
                yield
