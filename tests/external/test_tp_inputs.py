"""A TP group's ranks must compute on the same replicated activations: what a user's script can do to break
that, and lowband's input check (lowband.parallel.tensor: each replicated TP input's digest rides on the next TP
collective).

Before the check, dropout on the residual stream of an outside-style GPT under TP 2 with per-rank seeds (the
nanoGPT habit) drew other masks on each rank: every TP layer then computed its slice from other inputs, and the
replicated LayerNorm weights were 0.039 apart after 3 steps, with no error. Per-rank batches fed to the TP model
without ``TPInputGather`` did the same. Now every rank raises ``TPInputMismatchError`` naming the layer at the
first TP collective after it; seeding the ranks of a TP group alike (``seed + dp_rank``) keeps them in step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowband.comm import Comm
from lowband.consistency import check_replicas
from lowband.parallel import (
    ColumnParallelLinear,
    TPInputGather,
    TPInputMismatchError,
    clip_grad_norm_,
    shard_tp,
    unsharded_copy,
)
from lowband.parallel.gtp import reduce_grads
from lowband.parallel.mesh import build_mesh
from lowband.testing import run_ranks
from tests.external.outside_gpt import OutsideConfig, outside_plan, random_batch, seeded_model

MISMATCH = "on different inputs"


def _dropout_run(seeding: str) -> dict[str, Any]:
    """Outside GPT with dropout (p = 0.1) after every attention and MLP block, TP 2 (x DP 2 on 4 ranks), torch
    AdamW, 3 steps through TPInputGather; ``seeding`` = "rank" (torch.manual_seed(1337 + rank) before training)
    or "dp" (1337 + dp rank: the ranks of a TP group alike)."""
    rank = dist.get_rank()
    cfg = OutsideConfig(tie=False)
    model = seeded_model(1337, rank, cfg, torch.float64)
    for block in model.transformer.h:  # a submodule of the block, so model.eval() turns it off
        block.resid_drop = nn.Dropout(0.1)
        block.attn.register_forward_hook(lambda mod, args, out, b=block: b.resid_drop(out))
        block.mlp.register_forward_hook(lambda mod, args, out, b=block: b.resid_drop(out))
    mesh = build_mesh(tp=2)
    shard_tp(model, outside_plan(model), mesh.tp, sync_comm=Comm())
    torch.manual_seed(1337 + (rank if seeding == "rank" else mesh.dp.rank))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wrapped = TPInputGather(model, mesh.tp)
    model.train()
    try:
        for step in range(3):
            x, y = random_batch(step, rank, 2, cfg)  # per-rank batches from a generator of their own
            _, loss = wrapped(x, y)
            loss.backward()
            if mesh.dp.size > 1:
                reduce_grads(mesh.dp, model.parameters(), "avg", tag="grad")
            clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
    except TPInputMismatchError as e:
        return {"error": str(e), "step": step}
    check_replicas(model, Comm())  # replicated weights bitwise equal on every rank, TP slices within their DP copies
    return {"error": None, "ln_f": model.transformer.ln_f.weight.detach().clone()}


@pytest.mark.parametrize("world", [2, 4])
def test_dropout_with_per_rank_seeds_is_refused_on_every_rank(world: int) -> None:
    res = run_ranks(_dropout_run, world, "rank")
    for r, out in enumerate(res):
        assert out["error"] is not None, r
        assert out["step"] == 0, out  # at the first forward: the attention's dropout feeds the MLP's c_fc
        assert "'transformer.h.0.mlp.c_fc'" in out["error"] and MISMATCH in out["error"], out["error"]
        assert "torch.manual_seed(seed + dp_rank)" in out["error"]


@pytest.mark.parametrize("world", [2, 4])
def test_dropout_with_a_tp_group_seeded_alike_trains_in_step(world: int) -> None:
    """The recipe the error names: the ranks of a TP group draw the same masks; check_replicas in the worker
    found every replicated weight bitwise equal on every rank after 3 steps."""
    res = run_ranks(_dropout_run, world, "dp")
    assert all(out["error"] is None for out in res), [out["error"] for out in res]
    assert all(torch.equal(out["ln_f"], res[0]["ln_f"]) for out in res)


def _per_rank_batches(how: str) -> dict[str, Any]:
    """TP 2 on 2 ranks, no dropout, each rank its own batch fed straight to the TP model (no TPInputGather):
    ``how`` = "train" (forward + backward) or "eval" (a forward under torch.no_grad, which has no backward
    collective: the row-parallel forward all-reduce carries the check)."""
    rank = dist.get_rank()
    cfg = OutsideConfig(tie=False)
    model = seeded_model(1337, rank, cfg, torch.float64)
    mesh = build_mesh(tp=2)
    shard_tp(model, outside_plan(model), mesh.tp, sync_comm=Comm())
    x, y = random_batch(0, rank, 2, cfg)
    try:
        if how == "eval":
            with torch.no_grad():
                model(x, y)
        else:
            model(x, y)[1].backward()
    except TPInputMismatchError as e:
        return {"error": str(e)}
    return {"error": None}


@pytest.mark.parametrize("how", ["train", "eval"])
def test_per_rank_batches_without_the_input_gather_are_refused(how: str) -> None:
    for r, out in enumerate(run_ranks(_per_rank_batches, 2, how)):
        assert out["error"] is not None, r
        assert "'transformer.h.0.attn.c_attn'" in out["error"] and MISMATCH in out["error"], out["error"]
        assert "TPInputGather(model, tp_comm)" in out["error"]


def _gathered_output(same: bool) -> dict[str, Any]:
    """A ColumnParallelLinear with gather_output=True (its forward collective is an all-gather) on 2 ranks, fed
    the same input or each rank its own."""
    rank = dist.get_rank()
    layer = ColumnParallelLinear(6, 4, Comm(), gather_output=True, dtype=torch.float64,
                                 generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0 if same else rank))
    try:
        y = layer(x)
    except TPInputMismatchError as e:
        return {"error": str(e)}
    return {"error": None, "y": y.detach()}


def test_the_all_gather_path_checks_too() -> None:
    same = run_ranks(_gathered_output, 2, True)
    assert all(out["error"] is None for out in same) and torch.equal(same[0]["y"], same[1]["y"])
    for r, out in enumerate(run_ranks(_gathered_output, 2, False)):
        assert out["error"] is not None and "'ColumnParallelLinear #1'" in out["error"], (r, out)


def _trainer_run(cfg: Any, stop_after: int | None = None) -> dict[str, Any]:
    from lowband.train.trainer import train

    res = train(cfg, write_run_dir=False, log=False, stop_after=stop_after)
    model = unsharded_copy(res.strategy.unwrapped())
    return {"losses": [r["loss"] for r in res.rows if "loss" in r], "start": res.start_step,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _trainer_config(shard: str, world: int, ckpt_dir: str = "", every: int = 0) -> Any:
    from tests.external.test_trainer_outside import outside_config

    cfg = outside_config(shard, world, "tp", 2, steps=4, factory="tests.external.factories:outside_gpt_dropout",
                         ckpt_dir=ckpt_dir, every=every)
    cfg.tp.size, cfg.run.check_replicas_every = 2, 1
    return cfg


@pytest.mark.parametrize("world", [2, 4])
def test_the_tp_strategy_seeds_a_tp_group_alike(shard: str, world: int) -> None:
    """The trainer's ``tp`` strategy with a factory that seeds per rank and a model with dropout: it seeds every
    rank ``run.seed + dp_rank`` after sharding (before, the run stopped at the first step with
    TPInputMismatchError; without the check it trained on silently); the replica check runs every step."""
    res = run_ranks(_trainer_run, world, _trainer_config(shard, world))
    for out in res:
        assert out["losses"] == res[0]["losses"] and len(out["losses"]) == 4
        for k, v in res[0]["params"].items():
            assert torch.equal(out["params"][k], v), k


def test_tp_with_dropout_resumes_bitwise(shard: str, tmp_path: Path) -> None:
    """Stop at 2, resume to 4: the masks continue from each rank's saved RNG state (bitwise the uninterrupted run)."""
    full = run_ranks(_trainer_run, 2, _trainer_config(shard, 2))
    cfg = _trainer_config(shard, 2, str(tmp_path), 2)
    first = run_ranks(_trainer_run, 2, cfg, stop_after=2)
    second = run_ranks(_trainer_run, 2, cfg)
    for f, a, b in zip(full, first, second, strict=True):
        assert b["start"] == 2 and a["losses"] + b["losses"] == f["losses"]
        for k, v in f["params"].items():
            assert torch.equal(b["params"][k], v), k


def _ragged(mode: str) -> dict[str, Any]:
    """TP 2 (x DP 2 on 4 ranks) through TPInputGather, rank r passing a batch of 1 + r % 2 sequences ("ragged")
    or, on TP rank 1, sequences of half the length ("seq"); returns the loss and the dense model's gradient."""
    rank = dist.get_rank()
    cfg = OutsideConfig(tie=False)
    model = seeded_model(1337, rank, cfg, torch.float64)
    mesh = build_mesh(tp=2)
    shard_tp(model, outside_plan(model), mesh.tp, sync_comm=Comm())
    wrapped = TPInputGather(model, mesh.tp)
    x, y = random_batch(0, rank, 1 + mesh.tp.rank, cfg)
    if mode == "seq" and mesh.tp.rank == 1:
        x, y = x[:, :8].contiguous(), y[:, :8].contiguous()
    try:
        _, loss = wrapped(x, y)
    except ValueError as e:
        return {"error": str(e)}
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"error": None, "loss": float(loss.detach()), "ln_f": grads["transformer.ln_f.weight"]}


@pytest.mark.parametrize("world", [2, 4])
def test_a_ragged_batch_dimension_is_joined_exactly(world: int) -> None:
    """A smaller last batch on some ranks: the TP group computes on the union of the real rows (no padding in
    it), equal to the dense model on that union. The model is float64 with a float32 cross-entropy: the float64
    logits differ from the reference's by sums in another order (~1e-16 relative), which can flip a float32
    rounding of the loss's softmax (2^-24 relative), so loss and gradients are compared to 1e-6 relative (a
    padded row in the union or a lost one moves them by O(1) of their size)."""
    res = run_ranks(_ragged, world, "ragged")
    cfg = OutsideConfig(tie=False)
    for group in range(world // 2):
        ranks = [2 * group, 2 * group + 1]
        ref = seeded_model(1337, 0, cfg, torch.float64)
        xs, ys = zip(*(random_batch(0, r, 1 + r % 2, cfg) for r in ranks))
        _, loss = ref(torch.cat(xs), torch.cat(ys))
        loss.backward()
        for r in ranks:
            out = res[r]
            assert out["error"] is None, out["error"]
            want = float(loss.detach())
            assert abs(out["loss"] - want) <= 1e-6 * abs(want), (r, out["loss"], want)
            torch.testing.assert_close(out["ln_f"], ref.transformer.ln_f.weight.grad, rtol=1e-6, atol=1e-12)


def test_other_sizes_beyond_the_batch_dimension_are_refused_on_every_rank() -> None:
    """Sequences of other lengths cannot be joined: before, the input all-gather of mismatched sizes aborted the
    process (gloo's EnforceNotMet); now one ValueError on every rank, naming each rank's shapes."""
    for r, out in enumerate(run_ranks(_ragged, 2, "seq")):
        assert out["error"] is not None, r
        assert "rank 0: int64(1, 16), int64(1, 16); rank 1: int64(2, 8), int64(2, 8)" in out["error"], out["error"]


class _ManyInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = ColumnParallelLinear(6, 4, Comm(), gather_output=True, dtype=torch.float64,
                                          generator=torch.Generator().manual_seed(0))

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.layer(sum(x[:, :6] for x in xs))


def _many_inputs(differ: bool) -> dict[str, Any]:
    """40 tensor arguments: a header too long to list them, so the ranks must agree exactly (no ragged join)."""
    rank = dist.get_rank()
    xs = [torch.full((3, 6), float(k), dtype=torch.float64) for k in range(40)]
    if differ and rank == 1:
        xs[-1] = torch.zeros(3, 7, dtype=torch.float64)
    try:
        y = TPInputGather(_ManyInputs(), Comm())(*xs)
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None, "shape": tuple(y.shape)}


def test_many_tensor_arguments_must_agree_exactly() -> None:
    same = run_ranks(_many_inputs, 2, False)
    assert all(out["error"] is None and out["shape"] == (6, 4) for out in same), same
    for r, out in enumerate(run_ranks(_many_inputs, 2, True)):
        assert out["error"] is not None and "too many to list" in out["error"], (r, out)
