"""Generalized tensor parallelism: every nn.Linear and nn.Embedding weight sharded by rows over the ranks,
gathered just in time in forward/backward, weight gradients reduce-scattered; each rank still trains on
its own data (a data lane). The head tied to the embedding stays replicated.

Run: torchrun --nproc_per_node 2 examples/adopt/gtp.py   (docs/adopt.md)
"""

import torch
import torch.distributed as dist

from lowband.parallel import (
    GTPRuntime,
    build_mesh,
    clip_grad_norm_,
    shard_embeddings,
    shard_linears,
    unsharded_copy,
)
from tests.external.outside_gpt import random_batch, seeded_model  # your model and your data


def main(steps: int = 6, dtype: torch.dtype = torch.float32) -> dict:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = seeded_model(1337, rank, dtype=dtype)  # torch.manual_seed(1337 + rank): ranks differ
    rt = GTPRuntime(build_mesh(gtp=dist.get_world_size()).gtp)
    shard_embeddings(model, rt)  # init_sync: rank 0's weights, then this rank's rows
    shard_linears(model, rt)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x, y = random_batch(step, rank)
        _, loss = model(x, y)
        loss.backward()  # also averages the replicated parameters' grads (norms, biases, head), as DDP
        clip_grad_norm_(model, 1.0)  # the global norm over shards and replicated parameters
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    plain = unsharded_copy(model)  # an ordinary nn.Module: evaluate or save it on rank 0 alone
    return {"losses": losses, "model": plain}


if __name__ == "__main__":
    main()
