"""The same script with lowband's sharded AdamW: no DDP wrapper; gradients reduce-scattered, each rank
updates its 1/N slice (and keeps only its slice of the AdamW moments), updated slices all-gathered.

Run: torchrun --nproc_per_node 2 examples/adopt/sharded_adamw.py   (docs/adopt.md)
"""

import torch
import torch.distributed as dist

from lowband.optim import ShardedAdamW
from tests.external.outside_gpt import random_batch, seeded_model  # your model and your data


def main(steps: int = 6, dtype: torch.dtype = torch.float32) -> dict:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = seeded_model(1337, rank, dtype=dtype)  # torch.manual_seed(1337 + rank): ranks differ
    opt = ShardedAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, module=model)  # init_sync: rank 0's weights
    losses = []
    for step in range(steps):
        x, y = random_batch(step, rank)
        _, loss = model(x, y)
        loss.backward()
        opt.clip_grad_norm(1.0)  # the global norm (one scalar all-reduce)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "model": model}


if __name__ == "__main__":
    main()
