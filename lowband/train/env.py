"""The distributed environment of one trainer process: rank, world, device, and the world `Comm`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from lowband.comm import Comm, CommLedger, default_ledger


@dataclass
class DistEnv:
    """Who this process is and how it talks.

    Attributes:
        rank, world_size, local_rank: from torchrun's environment (0, 1, 0 without it).
        device: the torch device this rank computes on.
        comm: the world :class:`Comm`; training collectives are recorded in ``comm.ledger``.
        metrics_comm: a world :class:`Comm` with its own ledger for logging/validation collectives, so
            they do not count as training traffic.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    comm: Comm
    metrics_comm: Comm
    owns_process_group: bool = False
    extras: dict = field(default_factory=dict)

    @property
    def ledger(self) -> CommLedger:
        return self.comm.ledger

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            from lowband.train.config import ConfigError

            raise ConfigError("run.device = cuda, but CUDA is not available here; use run.device = cpu or auto")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device_name: str = "cpu", timeout_s: float = 300.0) -> DistEnv:
    """Initialize ``torch.distributed`` from torchrun's environment, or use an existing group.

    Without ``WORLD_SIZE`` in the environment and no initialized group, returns a 1-rank env (no
    process group). ``LOWBAND_INIT_METHOD`` (set by the CLI's self-launcher) overrides the ``env://``
    rendezvous. CPU tensors use gloo, CUDA tensors NCCL (``cpu:gloo,cuda:nccl``).
    """
    owns = False
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    elif "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) >= 1 and "RANK" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = resolve_device(device_name, local_rank)
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        if os.environ.get("LOWBAND_INIT_METHOD"):  # the CLI's self-launcher rendezvous (a FileStore)
            kwargs.update(init_method=os.environ["LOWBAND_INIT_METHOD"], rank=rank, world_size=world)
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)
        owns = True
    else:
        rank, world, local_rank = 0, 1, 0
    device = resolve_device(device_name, local_rank)
    comm = Comm(name="world", ledger=default_ledger())
    metrics = Comm(name="world", ledger=CommLedger())
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=device, comm=comm,
                   metrics_comm=metrics, owns_process_group=owns)
