"""A user's own torchrun script before lowband: nanoGPT-style model, per-rank seed, DDP + AdamW.

Run: torchrun --nproc_per_node 2 examples/adopt/ddp.py   (docs/adopt.md; tested in tests/external/test_adopt.py)
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.external.outside_gpt import random_batch, seeded_model  # your model and your data


def main(steps: int = 6, dtype: torch.dtype = torch.float32) -> dict:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = seeded_model(1337, rank, dtype=dtype)  # torch.manual_seed(1337 + rank): ranks differ
    ddp = DDP(model)  # broadcasts rank 0's weights
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x, y = random_batch(step, rank)
        _, loss = ddp(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "model": model}


if __name__ == "__main__":
    main()
