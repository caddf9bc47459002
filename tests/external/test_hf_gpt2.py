"""Hugging Face ``transformers``' ``GPT2LMHeadModel`` trained by lowband's trainer (issue 11, Done-when).

A tiny random ``GPT2Config`` (no download; ``transformers`` is the test-only extra ``[hf]`` that
scripts/setup.sh installs), built per rank with ``seed + rank`` by ``tests.external.factories:hf_gpt2``
with its plan, called the Hugging Face way (``model(input_ids)`` returns an object with ``.logits``;
``model.forward = "auto"`` detects it and the trainer takes the next-token loss). Every run is float64.

What GPT-2 brings that lowband's GPT does not: ``Conv1D`` projections (transposed weights, not
``nn.Linear``: TP and GTP are refused naming them), the token embedding tied to the head (a sparse table
on it is refused), LayerNorm with bias, learned positions.

Tolerances: float64 runs that differ from their reference only in the summation order of gradient
averages (ring/reduce-scatter over 2 or 4 ranks vs one process; 4-6 AdamW steps) agree to a few hundred
ulps of O(1) weights; 1e-10 relative (~5e5 ulps) leaves room for that and is far below what a missed
weight sync or a dropped gradient makes (>1e-4). Stop/resume on the same world size is bitwise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lowband.testing import run_ranks
from lowband.train.config import Config, ConfigError
from lowband.train.trainer import train
from tests.external.conftest import VOCAB

FACTORY = "tests.external.factories:hf_gpt2"
TOL = 1e-10  # float64, see the module docstring


def hf_config(shard: str, world: int, strategy: str, batch: int, *, steps: int = 4, ckpt_dir: str = "",
              every: int = 0) -> Config:
    cfg = Config()
    cfg.run.world_size, cfg.run.steps, cfg.run.dtype, cfg.run.seed = world, steps, "float64", 5
    cfg.run.val_every, cfg.run.val_batches, cfg.run.log_every, cfg.run.threads = 0, 1, 1, 1
    cfg.model.factory = FACTORY
    cfg.model.vocab_size, cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = VOCAB, 2, 32, 2, 16
    cfg.data.source, cfg.data.train_bin, cfg.data.batch_size = "bin", shard, batch
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay, cfg.optim.grad_clip = 1e-2, 1, 0.1, 0.5
    cfg.optim.muon_ns_dtype = "float64"
    cfg.strategy.name = strategy
    cfg.checkpoint.dir, cfg.checkpoint.every = ckpt_dir, every
    return cfg


def _run(cfg: Config, stop_after: int | None = None) -> dict:
    res = train(cfg, write_run_dir=False, log=False, stop_after=stop_after)
    model = res.strategy.unwrapped()
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "tied": model.transformer.wte.weight is model.lm_head.weight,
            "class": type(model).__name__, "forward": res.strategy.forward,
            "losses": [r["loss"] for r in res.rows if "loss" in r], "start": res.start_step,
            "tags": sorted({r.tag for r in res.strategy.env.ledger.records})}


def _errors(cfgs: list[Config]) -> list[str]:
    out = []
    for cfg in cfgs:
        try:
            train(cfg, write_run_dir=False, log=False)
            out.append("no error")
        except (ConfigError, ValueError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def assert_params_close(out: dict, ref: dict, tol: float = TOL) -> None:
    assert out["class"] == "GPT2LMHeadModel" and out["tied"]
    assert out["params"].keys() == ref["params"].keys()
    for k, v in ref["params"].items():
        torch.testing.assert_close(out["params"][k], v, rtol=tol, atol=tol, msg=k)


@pytest.fixture(scope="module")
def reference(shard: str) -> dict:
    """``single`` on one process over the global batch of 4, seeded like rank 0."""
    return run_ranks(_run, 1, hf_config(shard, 1, "single", 4))[0]


@pytest.mark.parametrize("strategy", ["ddp", "sharded-adamw"])
@pytest.mark.parametrize("world", [2, 4])
def test_hf_gpt2_equals_single_process(shard: str, reference: dict, strategy: str, world: int) -> None:
    assert reference["forward"] == "logits"  # auto-detected: a transformers model, called without labels
    out = run_ranks(_run, world, hf_config(shard, world, strategy, 4 // world), timeout=240)
    for r in out:
        assert_params_close(r, reference)
        # the trainer's cross-entropy runs on the float64 logits: the logged loss (a mean of per-rank means)
        # differs from one process's mean only in summation order
        np.testing.assert_allclose(r["losses"], reference["losses"], rtol=TOL)
        if strategy == "sharded-adamw":
            assert "init_sync" in r["tags"]  # the per-rank-seeded weights were synced from rank 0


@pytest.mark.parametrize("world", [2, 4])
def test_hf_gpt2_sharded_muon_equals_one_rank(shard: str, world: int) -> None:
    """Muon takes GPT-2's Conv1D matrices (2-D, not embeddings), AdamW the tied wte/lm_head, wpe and the
    vectors; N ranks equal one rank of the same strategy on the same global batch."""
    ref = run_ranks(_run_groups, 1, hf_config(shard, 1, "sharded-muon", 4, steps=3))[0]
    out = run_ranks(_run_groups, world, hf_config(shard, world, "sharded-muon", 4 // world, steps=3), timeout=240)
    assert ref["muon"] == [f"transformer.h.{i}.{m}.weight" for i in range(2)
                           for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert "transformer.wte.weight" in ref["adamw"] and "lm_head.weight" not in ref["adamw"]
    for r in out:
        assert (r["muon"], r["adamw"]) == (ref["muon"], ref["adamw"])
        for k, v in ref["params"].items():
            torch.testing.assert_close(r["params"][k], v, rtol=TOL, atol=TOL, msg=k)


def _run_groups(cfg: Config) -> dict:
    res = train(cfg, write_run_dir=False, log=False)
    model = res.strategy.unwrapped()
    names = {id(p): n for n, p in model.named_parameters()}
    groups: dict[str, list[str]] = {"muon": [], "adamw": []}
    for g in res.strategy.optimizer.param_groups:
        groups[g["algorithm"]] += [names[id(p)] for p in g["params"]]
    return {**groups, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def test_hf_gpt2_tp_gtp_and_tied_sparse_table_are_refused_on_every_rank(shard: str) -> None:
    """Each is a clear error raised on every rank alike before any collective (the run returns)."""
    gtp, tp = hf_config(shard, 2, "gtp", 2), hf_config(shard, 2, "tp", 2)
    sparse = hf_config(shard, 2, "sharded-adamw", 2)
    sparse.sparse.tables = ["wte"]
    errs = run_ranks(_errors, 2, [gtp, tp, sparse], timeout=240)
    assert errs[0] == errs[1]
    e_gtp, e_tp, e_sparse = errs[0]
    for e, name in ((e_gtp, "gtp"), (e_tp, "tp")):
        assert e.startswith("ConfigError: ") and f"strategy {name!r}" in e and "GPT2LMHeadModel" in e, e
        assert "Conv1D" in e, e
    assert "sparse.tables" in e_sparse and "lm_head.weight" in e_sparse, e_sparse


def test_hf_gpt2_dcp_stop_resume_is_bitwise_and_reshards(shard: str, tmp_path: Path) -> None:
    """sharded-adamw: a DCP checkpoint at step 2 (of 4) resumes bitwise on 2 ranks, and on 4 ranks continues
    like the uninterrupted 2-rank run (to the reduction-order tolerance)."""
    full = run_ranks(_run, 2, hf_config(shard, 2, "sharded-adamw", 2), timeout=240)
    cfg = hf_config(shard, 2, "sharded-adamw", 2, ckpt_dir=str(tmp_path), every=2)
    first = run_ranks(_run, 2, cfg, stop_after=2, timeout=240)
    assert (tmp_path / "step-2").is_dir()
    resumed = run_ranks(_run, 2, cfg, timeout=240)
    for f, a, b in zip(full, first, resumed):
        assert (a["start"], b["start"]) == (0, 2)
        for k, v in f["params"].items():
            assert torch.equal(b["params"][k], v), k
        assert a["losses"] + b["losses"] == f["losses"]
    at4 = hf_config(shard, 4, "sharded-adamw", 1, ckpt_dir=str(tmp_path / "w4"))
    at4.checkpoint.resume = str(tmp_path / "step-2")  # an explicit path loads even with every = 0
    out4 = run_ranks(_run, 4, at4, timeout=240)
    for r in out4:
        assert r["start"] == 2
        assert_params_close(r, full[0])


def test_hf_gpt2_diloco_replicas_of_one_equal_replicas_of_two(shard: str) -> None:
    """DiLoCo, 2 replicas: 1 rank each (world 2) equals 2 DDP ranks each (world 4) on the same global batch;
    the fragments come from the plan, and after the last sync (step 4 = 2 x sync_every, one fragment, no
    delay) every rank holds the same weights."""
    def config(world: int) -> Config:
        cfg = hf_config(shard, world, "diloco", 4 // world)
        d = cfg.diloco
        d.num_replicas, d.sync_every, d.fragments, d.delay, d.outer_lr, d.outer_momentum = 2, 2, 1, 0, 0.7, 0.9
        return cfg

    two = run_ranks(_run, 2, config(2), timeout=240)
    four = run_ranks(_run, 4, config(4), timeout=240)
    for r in two + four:
        assert "diloco:frag0" in r["tags"]
        assert_params_close(r, two[0])
    for k, v in two[0]["params"].items():
        assert torch.equal(two[1]["params"][k], v), k
