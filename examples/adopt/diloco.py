"""Streaming DiLoCo: each rank is a replica that trains on its own; every sync_every / fragments steps
one fragment (a slice of the blocks, from the plan) is averaged across replicas by an outer optimizer.

Run: torchrun --nproc_per_node 2 examples/adopt/diloco.py   (docs/adopt.md)
"""

import torch
import torch.distributed as dist

from lowband.diloco import StreamingDiLoCo, replica_mesh
from tests.external.outside_gpt import outside_plan, random_batch, seeded_model  # your model, plan, data


def main(steps: int = 8, dtype: torch.dtype = torch.float32) -> dict:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = seeded_model(1337, rank, dtype=dtype)  # torch.manual_seed(1337 + rank): ranks differ
    mesh = replica_mesh(num_replicas=dist.get_world_size())  # one replica per rank (no DDP inside)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    diloco = StreamingDiLoCo(model, opt, comm=mesh.replica, sync_every=4, fragments=2,
                             plan=outside_plan(model))  # init_sync: rank 0's weights
    losses = []
    for step in range(steps):
        x, y = random_batch(step, rank)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # local: each replica is its own model
        opt.step()  # DiLoCo's outer sync runs in this call's post-hook
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    diloco.close()
    return {"losses": losses, "model": model, "outer_steps": diloco.committed}


if __name__ == "__main__":
    main()
