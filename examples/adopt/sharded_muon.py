"""Sharded Muon for the hidden matrices, sharded AdamW for the rest (embeddings, the tied head, vectors).

Run: torchrun --nproc_per_node 2 examples/adopt/sharded_muon.py   (docs/adopt.md)
"""

import torch
import torch.distributed as dist

from lowband.optim import ShardedMuon
from lowband.plan import muon_split
from tests.external.outside_gpt import outside_plan, random_batch, seeded_model  # your model, plan, data


def main(steps: int = 6, dtype: torch.dtype = torch.float32) -> dict:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = seeded_model(1337, rank, dtype=dtype)  # torch.manual_seed(1337 + rank): ranks differ
    muon, adamw = muon_split(model, outside_plan(model))  # 2-D hidden matrices vs the rest
    opt = ShardedMuon(muon, adamw, lr=0.02, momentum=0.95, adamw_lr=3e-3, ns_dtype=dtype, module=model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))  # scales both lrs
    losses = []
    for step in range(steps):
        x, y = random_batch(step, rank)
        _, loss = model(x, y)
        loss.backward()
        opt.clip_grad_norm(1.0)  # the global norm (one scalar all-reduce)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "model": model, "muon": muon, "opt": opt}


if __name__ == "__main__":
    main()
