"""Single-process reference for the GTP / TP external tests: OutsideGPT trained on the global batch.

The global batch of a step is the union of every rank's ``random_batch(step, rank)``. The reference
starts from rank 0's per-rank-seeded model (what ``init_sync`` broadcasts), computes one loss per data
lane (what DDP computes: a GTP rank is a lane, a TP group is one lane), averages the lanes' gradients,
clips with ``torch.nn.utils.clip_grad_norm_`` and steps torch AdamW.
"""

from __future__ import annotations

import torch

from tests.external.outside_gpt import OutsideConfig, random_batch, seeded_model

SEED = 7
LR = 1e-2
WD = 0.1
BATCH = 2  # rows per rank per step


def global_batch(step: int, ranks: list[int] | range, cfg: OutsideConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The union, in rank order, of the given ranks' batches of ``step``."""
    xs, ys = zip(*(random_batch(step, r, BATCH, cfg) for r in ranks))
    return torch.cat(xs), torch.cat(ys)


def lanes_of(world: int, tp: int = 1) -> list[list[int]]:
    """Data lanes: the ranks whose batches one forward sees together (a TP group), one lane per DP rank."""
    return [list(range(d * tp, (d + 1) * tp)) for d in range(world // tp)]


def reference_step(model: torch.nn.Module, step: int, lanes: list[list[int]], cfg: OutsideConfig) -> list[float]:
    """Forward/backward of one step as the data-parallel ranks see it: one loss per lane (OutsideGPT
    takes its cross-entropy in float32, so the per-lane losses are the same float32 reductions the
    parallel run makes), gradients the average over lanes (float64). Returns the lanes' losses."""
    losses = []
    for lane in lanes:
        x, y = global_batch(step, lane, cfg)
        _, loss = model(x, y)
        (loss / len(lanes)).backward()
        losses.append(float(loss.detach()))
    return losses


def reference_run(cfg: OutsideConfig, lanes: list[list[int]], steps: int, max_norm: float) -> dict:
    """Train the single-process reference ``steps`` steps; per step the lanes' losses and the pre-clip
    norm; the final parameters by name."""
    model = seeded_model(SEED, 0, cfg, torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, norms = {}, {}
    for step in range(1, steps + 1):
        losses[step] = reference_step(model, step, lanes, cfg)
        norms[step] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "norms": norms, "model": model, "opt": opt,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
