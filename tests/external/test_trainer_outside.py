"""The trainer runs an outside model named by ``model.factory`` end to end (issue 11, item 4).

The model is :mod:`tests.external.outside_gpt` (nanoGPT-style: tied ``wte``/``lm_head``, biases, its
own module names, ``forward`` returning ``(logits, loss)``, per-rank seeds ``seed + rank``), built by
``tests.external.factories:outside_gpt``. Every distributed run is compared with the ``single``
strategy on one process over the same global batch, seeded like rank 0 (DDP broadcasts rank 0's
weights, the components' ``init_sync`` does the same), in float64.

Tolerances: float64 runs whose reductions differ from the reference only in summation order (a ring
or reduce-scatter average of 2 or 4 partial gradients, then AdamW's elementwise update over 6 steps)
agree to a few hundred ulps of the O(1) weights; 1e-10 relative is ~5e5 ulps (eps 2.2e-16) and still
far below the 1e-3 changes a missed sync or a dropped gradient row makes. Stop/resume is bitwise.
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

FACTORY = "tests.external.factories:outside_gpt"
RUNNING_LOSS = "tests.external.factories:outside_gpt_running_loss"
TOL = 1e-10  # float64, see the module docstring
LOSS_TOL = 1e-6  # the model's float32 loss (see assert_matches)


def outside_config(shard: str, world: int, strategy: str, batch: int, *, steps: int = 6, factory: str = FACTORY,
                   ckpt_dir: str = "", every: int = 0) -> Config:
    cfg = Config()
    cfg.run.world_size, cfg.run.steps, cfg.run.dtype, cfg.run.seed = world, steps, "float64", 3
    cfg.run.val_every, cfg.run.val_batches, cfg.run.log_every, cfg.run.threads = 0, 1, 1, 1
    cfg.model.factory = factory
    cfg.model.vocab_size, cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = VOCAB, 2, 32, 2, 16
    cfg.data.source, cfg.data.train_bin, cfg.data.batch_size = "bin", shard, batch
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay, cfg.optim.grad_clip = 1e-2, 2, 0.1, 0.5
    cfg.strategy.name = strategy
    cfg.checkpoint.dir, cfg.checkpoint.every = ckpt_dir, every
    return cfg


def _run(cfg: Config, stop_after: int | None = None) -> dict:
    res = train(cfg, write_run_dir=False, log=False, stop_after=stop_after)
    model = res.strategy.unwrapped()
    if cfg.strategy.name in ("gtp", "tp"):  # a plain copy with the full logical weights (collective)
        from lowband.parallel import unsharded_copy

        model = unsharded_copy(model)
    records = res.strategy.env.ledger.records
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "tied": model.transformer.wte.weight is model.lm_head.weight,
            "nparams": sum(p.numel() for p in model.parameters()),
            "losses": [r["loss"] for r in res.rows if "loss" in r],
            "val": res.final_val_loss, "start": res.start_step,
            "wire": [r["wire_bytes"] for r in res.rows if "loss" in r],
            "records": [(r.op, r.tag, r.numel, r.wire_bytes) for r in records]}


def _error(cfg: Config) -> str:
    try:
        train(cfg, write_run_dir=False, log=False)
    except (ConfigError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def assert_matches(out: dict, ref: dict, tol: float = TOL) -> None:
    assert out["tied"], "the trainer must keep wte and lm_head tied"
    assert out["params"].keys() == ref["params"].keys()
    for k, v in ref["params"].items():
        torch.testing.assert_close(out["params"][k], v, rtol=tol, atol=tol, msg=k)
    # OutsideGPT takes its cross-entropy on float32 logits (as nanoGPT does), so a logged loss is a float32
    # mean over 32 (per rank) or 64 (one process) tokens: rounding differs by a few float32 ulps (eps 1.2e-7)
    np.testing.assert_allclose(out["losses"], ref["losses"], rtol=LOSS_TOL)
    np.testing.assert_allclose(out["val"], ref["val"], rtol=LOSS_TOL)


@pytest.fixture(scope="module")
def reference(shard: str) -> dict:
    """``single`` on one process over the global batch of 4 (= 2 ranks x 2 = 4 ranks x 1)."""
    return run_ranks(_run, 1, outside_config(shard, 1, "single", 4))[0]


def test_factory_model_differs_per_rank_before_sync(shard: str) -> None:
    """The factory really seeds per rank (otherwise the sync tests below would prove nothing)."""
    cfg = outside_config(shard, 2, "ddp", 2)
    out = run_ranks(_factory_weight, 2, cfg)
    assert not torch.equal(out[0], out[1])


def _factory_weight(cfg: Config) -> torch.Tensor:
    from tests.external.factories import outside_gpt

    return outside_gpt(cfg)[0].lm_head.weight.detach().clone()


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_trains_outside_gpt_like_single_process(shard: str, reference: dict, world: int) -> None:
    out = run_ranks(_run, world, outside_config(shard, world, "ddp", 4 // world))
    n = reference["nparams"]  # the tied weight counted once
    for r in out:
        assert_matches(r, reference)
        # one bucketed ring all-reduce of every (unique) float64 gradient per step
        assert r["wire"] == [2 * (world - 1) * n * 8 // world] * 6


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_adamw_trains_outside_gpt_like_single_process(shard: str, reference: dict, world: int) -> None:
    out = run_ranks(_run, world, outside_config(shard, world, "sharded-adamw", 4 // world))
    n = reference["nparams"]
    for r in out:
        assert_matches(r, reference)
        recs = r["records"]
        rs = [x for x in recs if x[0] == "reduce_scatter"]
        ag = [x for x in recs if x[0] == "all_gather" and x[1].startswith("param:")]
        norm = [x for x in recs if x[1] == "grad_norm"]
        # per step and bucket one reduce-scatter of the gradient and one all-gather of the parameters; the
        # buckets cover every unique parameter once (the tied one once), each padded to a multiple of N
        units = len(rs) // 6
        assert units >= 1 and len(rs) == len(ag) == 6 * units and all(x[1].startswith("grad:") for x in rs)
        padded = sum(x[2] for x in rs[:units])
        assert [x[2] for x in rs] == [x[2] for x in rs[:units]] * 6
        # the all-gathers of a step carry the same buckets, in forward order (the reduce-scatters': backward)
        assert all(sorted(x[2] for x in ag[i * units:(i + 1) * units]) == sorted(x[2] for x in rs[:units])
                   for i in range(6))
        assert n <= padded < n + world * units
        assert [x[3] for x in rs + ag] == [(world - 1) * x[2] * 8 // world for x in rs + ag]
        assert norm == [("all_reduce", "grad_norm", 1, 2 * (world - 1) * 8 // world)] * 6
        # before the first step: init_sync broadcasts rank 0's weights (the ranks were seeded apart)
        bcast = [x for x in recs if x[0] == "broadcast" and x[1] == "init_sync"]
        assert sum(x[2] for x in bcast) == padded


def test_sharded_muon_takes_the_plan_split_on_outside_gpt(shard: str) -> None:
    """sharded-muon on the tied model: Muon gets the block matrices, AdamW the tied wte/lm_head (Muon must
    not take an embedding) and every 1-D parameter; 2 ranks equal 1 rank of the same strategy."""
    ref = run_ranks(_run_groups, 1, outside_config(shard, 1, "sharded-muon", 4, steps=3))[0]
    out = run_ranks(_run_groups, 2, outside_config(shard, 2, "sharded-muon", 2, steps=3))
    assert ref["muon"] == [f"transformer.h.{i}.{m}.weight" for i in range(2)
                           for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert "transformer.wte.weight" in ref["adamw"] and "lm_head.weight" not in ref["adamw"]  # once, tied
    for r in out:
        assert r["muon"] == ref["muon"] and r["adamw"] == ref["adamw"]
        # Muon's Newton-Schulz runs in float64 here (muon_ns_dtype follows float64 below) on identical
        # averaged gradients; the averages differ from 1 rank's only in summation order
        for k, v in ref["params"].items():
            torch.testing.assert_close(r["params"][k], v, rtol=TOL, atol=TOL, msg=k)


def _run_groups(cfg: Config) -> dict:
    cfg.optim.muon_ns_dtype = "float64"
    res = train(cfg, write_run_dir=False, log=False)
    model = res.strategy.unwrapped()
    names = {id(p): n for n, p in model.named_parameters()}
    groups: dict[str, list[str]] = {"muon": [], "adamw": []}
    for g in res.strategy.optimizer.param_groups:
        groups[g["algorithm"]] += [names[id(p)] for p in g["params"]]
    return {**groups, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize(("strategy", "factory"), [("ddp", FACTORY), ("sharded-adamw", FACTORY),
                                                   ("ddp", RUNNING_LOSS), ("sharded-adamw", RUNNING_LOSS),
                                                   ("diloco", RUNNING_LOSS), ("tp", RUNNING_LOSS)])
def test_stop_and_resume_from_checkpoint_is_bitwise_exact(shard: str, tmp_path: Path, strategy: str,
                                                          factory: str) -> None:
    """Save at step 2 and at the stop (3), resume from latest to 6: bitwise the uninterrupted run.
    The resumed run rebuilds the per-rank-seeded model, so the loaded state must replace all of it. With
    ``RUNNING_LOSS`` the model holds a persistent buffer that differs per rank and scales the loss: each rank
    must get its own back (checkpoints once held none for sharded-adamw and diloco, and rank 0's for ddp; tp
    saves them once, in the trainer's per-rank file)."""
    full = run_ranks(_run, 2, outside_config(shard, 2, strategy, 2, factory=factory))
    cfg = outside_config(shard, 2, strategy, 2, ckpt_dir=str(tmp_path), every=2, factory=factory)
    first = run_ranks(_run, 2, cfg, stop_after=3)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == ["step-2", "step-3"]
    second = run_ranks(_run, 2, cfg)
    for f, a, b in zip(full, first, second):
        assert b["start"] == 3 and a["start"] == 0
        assert b["tied"]
        for k, v in f["params"].items():
            assert torch.equal(b["params"][k], v), k
        assert a["losses"] + b["losses"] == f["losses"]


def test_untied_outside_gpt_with_sparse_wte_equals_single_process(shard: str) -> None:
    """With the head untied, the plan's ``wte`` table travels row-sparse and training equals 1 process."""
    factory = "tests.external.factories:outside_gpt_untied"
    ref = run_ranks(_run_untied, 1, outside_config(shard, 1, "single", 4, factory=factory))[0]
    cfg = outside_config(shard, 2, "sharded-adamw", 2, factory=factory)
    cfg.sparse.tables, cfg.sparse.mode = ["wte"], "sparse"
    out = run_ranks(_run_untied, 2, cfg)
    for r in out:
        for k, v in ref["params"].items():
            torch.testing.assert_close(r["params"][k], v, rtol=TOL, atol=TOL, msg=k)
        # every step the table's rows travelled sparse (row exchange tagged with the plan's name), never dense
        assert r["rows"] == 6 and r["dense"] == 0, r


def _run_untied(cfg: Config) -> dict:
    res = train(cfg, write_run_dir=False, log=False)
    tags = [r.tag for r in res.strategy.env.ledger.records]
    return {"params": {k: v.detach().clone() for k, v in res.strategy.unwrapped().state_dict().items()},
            "rows": sum(1 for t in tags if "wte" in t and t.endswith(":rows")),
            "dense": sum(1 for t in tags if "wte" in t and t.endswith(":dense"))}


def test_sparse_table_tied_to_the_head_is_refused_on_every_rank(shard: str) -> None:
    cfg = outside_config(shard, 2, "sharded-adamw", 2)
    cfg.sparse.tables = ["wte"]
    errs = run_ranks(_error, 2, cfg)
    assert errs[0] == errs[1] and "sparse.tables" in errs[0] and "lm_head.weight" in errs[0], errs


def test_unknown_sparse_table_is_refused_naming_the_plan_tables(shard: str) -> None:
    cfg = outside_config(shard, 2, "sharded-adamw", 2)
    cfg.sparse.tables = ["tok_emb"]  # lowband's GPT name; this model's plan calls it wte
    errs = run_ranks(_error, 2, cfg)
    assert errs[0] == errs[1] and "tok_emb" in errs[0] and "wte" in errs[0], errs


def test_bad_factory_key_is_a_config_error(shard: str) -> None:
    for spec, match in [("tests.external.factories", "package.module:function"),
                        ("tests.external.nope:f", "cannot import module"),
                        ("tests.external.factories:nope", "has no attribute 'nope'")]:
        with pytest.raises(ConfigError, match=match):
            train(outside_config(shard, 1, "single", 2, factory=spec), write_run_dir=False, log=False)


@pytest.mark.parametrize("world", [2, 4])
def test_gtp_trains_outside_gpt_like_single_process(shard: str, reference: dict, world: int) -> None:
    """GTP shards the plan's linears (the tied head stays replicated) and equals one process."""
    out = run_ranks(_run, world, outside_config(shard, world, "gtp", 4 // world))
    for r in out:
        assert_matches(r, reference)


def test_diloco_on_outside_gpt_replicas_of_one_equal_replicas_of_two(shard: str) -> None:
    """DiLoCo, 2 replicas, fragments from the plan (tied wte/lm_head in one fragment): 1 rank per replica
    (world 2) equals 2 DDP ranks per replica (world 4) on the same global batch; after the last sync
    (step 6 = 3 x sync_every, one fragment, no delay) every rank holds the same weights."""
    def config(world: int) -> Config:
        cfg = outside_config(shard, world, "diloco", 4 // world)
        d = cfg.diloco
        d.num_replicas, d.sync_every, d.fragments, d.delay, d.outer_lr, d.outer_momentum = 2, 2, 1, 0, 0.7, 0.9
        return cfg

    two = run_ranks(_run, 2, config(2))
    four = run_ranks(_run, 4, config(4))
    for r in two + four:
        assert r["tied"] and any(x[1] == "diloco:frag0" for x in r["records"])
        for k, v in two[0]["params"].items():
            torch.testing.assert_close(r["params"][k], v, rtol=TOL, atol=TOL, msg=k)
    for k, v in two[0]["params"].items():
        assert torch.equal(two[1]["params"][k], v), k
