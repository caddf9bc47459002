"""Sharded AdamW with the token embedding's gradient sent row-sparse: only the rows a step touched
travel, to the rank that owns them. Needs an untied embedding (a table tied to the head is refused).

Run: torchrun --nproc_per_node 2 examples/adopt/sparse_table.py   (docs/adopt.md)
"""

import torch
import torch.distributed as dist

from lowband.optim import ShardedAdamW
from lowband.optim.sparse_rows import sparse_tables_from_plan
from tests.external.outside_gpt import OutsideConfig, outside_plan, random_batch, seeded_model


def main(steps: int = 6, dtype: torch.dtype = torch.float32) -> dict:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = seeded_model(1337, rank, OutsideConfig(tie=False), dtype=dtype)  # untied head
    tables = sparse_tables_from_plan(model, ["wte"], plan=outside_plan(model))
    opt = ShardedAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, module=model,
                       sparse_tables=tables, sparse_mode="sparse")  # or "auto": whichever is fewer bytes
    losses = []
    for step in range(steps):
        x, y = random_batch(step, rank)
        opt.observe_tokens(x)  # the step's token ids, before forward
        _, loss = model(x, y)
        loss.backward()
        opt.clip_grad_norm(1.0)  # the global norm (one scalar all-reduce)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "model": model, "stats": opt.sparse_stats()["wte"]}


if __name__ == "__main__":
    main()
