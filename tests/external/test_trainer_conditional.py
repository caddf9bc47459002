"""The trainer on a model with frozen, conditionally unused and routed parameters (issue 20, items 3 and 5).

The model is :class:`tests.external.factories.ConditionalLM` (a bare ``nn.Module`` from a factory, no
plan, seeded ``run.seed + rank``): a frozen embedding, a branch run only on even steps (no rank uses it
on odd steps), two experts a sequence is routed to by its first token (a rank may leave one without a
gradient while another uses it) and buffers (one drawn per rank, one counting forwards). Every run is
compared with the ``single`` strategy on one process over the same global batch (rank 0's weights and
buffers), in float64: PyTorch's semantics (DDP with ``find_unused_parameters=True`` + torch AdamW) give
exactly that reference: a parameter unused on some ranks is averaged with their zeros, one unused on all
keeps ``.grad = None`` and AdamW skips it, a frozen one is never touched.

Tolerances: float64; the distributed runs differ from the reference only in summation order (a ring
average of 2 or 4 partial gradients, then 6 AdamW steps), a few hundred ulps of the O(1) weights; 1e-10
is ~5e5 ulps and far below the lr * O(1) = 1e-2 an extra AdamW step on an unused parameter makes.
"""

from __future__ import annotations

import pytest
import torch

from lowband.testing import run_ranks
from lowband.train.config import Config
from lowband.train.errors import classify
from lowband.train.trainer import train
from tests.external.conftest import VOCAB

FACTORY = "tests.external.factories:conditional_lm"
BRANCH = "tests.external.factories:branch_lm"
TOL = 1e-10  # float64, see the module docstring
STEPS = 6


def conditional_config(shard: str, world: int, strategy: str, batch: int, *, factory: str = FACTORY,
                       unused: bool = True) -> Config:
    cfg = Config()
    cfg.run.world_size, cfg.run.steps, cfg.run.dtype, cfg.run.seed = world, STEPS, "float64", 5
    cfg.run.val_every, cfg.run.val_batches, cfg.run.log_every, cfg.run.threads = 0, 1, 1, 1
    cfg.model.factory, cfg.model.vocab_size, cfg.model.n_embd, cfg.model.seq_len = factory, VOCAB, 16, 8
    cfg.data.source, cfg.data.train_bin, cfg.data.batch_size = "bin", shard, batch
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay, cfg.optim.grad_clip = 1e-2, 2, 0.1, 0.0
    cfg.strategy.name, cfg.strategy.find_unused_parameters = strategy, unused
    return cfg


def _run(cfg: Config) -> dict:
    res = train(cfg, write_run_dir=False, log=False)
    model = res.strategy.unwrapped()
    if cfg.strategy.name == "gtp" or (cfg.strategy.name == "diloco" and cfg.diloco.inner == "gtp"):
        from lowband.parallel import unsharded_copy

        model = unsharded_copy(model)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
            "frozen": sorted(n for n, p in model.named_parameters() if not p.requires_grad)}


def _initial(cfg: Config) -> dict:
    from tests.external.factories import conditional_lm

    model = conditional_lm(cfg)
    return {"params": {n: p.detach().clone().double() for n, p in model.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in model.named_buffers()}}


def _error(cfg: Config) -> tuple[str, int, str]:
    """(one-line message, exit code, kind) as the CLI would report this rank's end."""
    try:
        train(cfg, write_run_dir=False, log=False)
    except Exception as e:  # classified as the CLI does
        o = classify(e)
        return o.message, o.code, o.kind
    return "no error", 0, "ok"


def _assert_matches(out: dict, ref: dict) -> None:
    assert out["params"].keys() == ref["params"].keys() and out["frozen"] == ["emb.weight"]
    for k, v in ref["params"].items():
        torch.testing.assert_close(out["params"][k], v, rtol=TOL, atol=TOL, msg=k)
    for k, v in ref["buffers"].items():
        assert torch.equal(out["buffers"][k], v), k


@pytest.fixture(scope="module")
def reference(shard: str) -> dict:
    """``single`` on one process over the global batch of 4 (= 2 ranks x 2 = 4 ranks x 1)."""
    return run_ranks(_run, 1, conditional_config(shard, 1, "single", 4))[0]


def test_the_model_exercises_every_case(shard: str, reference: dict) -> None:
    """Ranks start apart (weights and the ``mix`` buffer); the frozen embedding ends as it started; the
    branch (odd steps unused) and both experts trained; the forward counter counted every forward."""
    cfg = conditional_config(shard, 2, "ddp", 2)
    init = run_ranks(_initial, 2, cfg)
    assert not torch.equal(init[0]["params"]["emb.weight"], init[1]["params"]["emb.weight"])
    assert not torch.equal(init[0]["buffers"]["mix"], init[1]["buffers"]["mix"])
    assert torch.equal(reference["params"]["emb.weight"], init[0]["params"]["emb.weight"])
    for name in ("branch.weight", "expert_a.weight", "expert_b.weight"):
        assert not torch.equal(reference["params"][name], init[0]["params"][name]), name
    assert int(reference["buffers"]["calls"]) == STEPS + 1  # and the final validation batch


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_with_find_unused_parameters_equals_single_process(shard: str, reference: dict, world: int) -> None:
    out = run_ranks(_run, world, conditional_config(shard, world, "ddp", 4 // world))
    for r in out:
        _assert_matches(r, reference)


def test_ddp_without_the_key_stops_with_one_line_naming_it(shard: str) -> None:
    """Step 2 leaves the branch without a gradient on every rank: each rank stops before its optimizer
    step with a config error (exit 2) naming strategy.find_unused_parameters, not torch's RuntimeError."""
    out = run_ranks(_error, 2, conditional_config(shard, 2, "ddp", 2, factory=BRANCH, unused=False))
    for msg, code, kind in out:
        assert (code, kind) == (2, "input") and "\n" not in msg, msg
        assert msg.startswith("strategy ddp: a trainable parameter got no gradient in this step") and \
            "set strategy.find_unused_parameters = true" in msg, msg


def test_ddp_without_the_key_rank_divergent_routing_leads_with_the_line(shard: str) -> None:
    """An expert unused on one rank only: that rank stops with the line, the other ends as a peer failure
    (its bucket all-reduce has no partner) instead of hanging; the launcher's summary leads with the line."""
    from lowband.train.errors import Outcome, summarize

    out = run_ranks(_error, 2, conditional_config(shard, 2, "ddp", 2, unused=False))
    kinds = sorted(kind for _, _, kind in out)
    assert "input" in kinds and set(kinds) <= {"input", "peer"}, out
    code, lines = summarize([Outcome(c, k, m, r, 2) for r, (m, c, k) in enumerate(out)], 2)
    assert code == 2 and "set strategy.find_unused_parameters = true" in lines[0], lines


def test_diloco_ddp_inner_with_find_unused_parameters(shard: str) -> None:
    """DiLoCo, 2 replicas, inner DDP with the key: 1 rank per replica (no DDP) equals 2 DDP ranks per
    replica on the same global batch; after the last sync (step 6, one fragment, H = 3, no delay) every
    rank holds the same weights; the frozen embedding is rank 0's (init_sync) and never changed; the
    ``mix`` buffer is rank 0's on every rank (init_sync covers buffers)."""
    def config(world: int, unused: bool = True) -> Config:
        cfg = conditional_config(shard, world, "diloco", 4 // world, unused=unused)
        d = cfg.diloco
        d.num_replicas, d.sync_every, d.fragments, d.delay, d.outer_lr, d.outer_momentum = 2, 3, 1, 0, 0.7, 0.9
        return cfg

    init = run_ranks(_initial, 1, config(2))[0]
    two = run_ranks(_run, 2, config(2))
    four = run_ranks(_run, 4, config(4))
    for r in two + four:
        assert r["frozen"] == ["emb.weight"]
        assert torch.equal(r["params"]["emb.weight"], init["params"]["emb.weight"])
        assert torch.equal(r["buffers"]["mix"], init["buffers"]["mix"])
        assert int(r["buffers"]["calls"]) == STEPS + 1
        for k, v in two[0]["params"].items():
            torch.testing.assert_close(r["params"][k], v, rtol=TOL, atol=TOL, msg=k)
    cfg = config(4, unused=False)
    cfg.model.factory = BRANCH  # unused on every rank alike: every rank reports the line
    for msg, code, _ in run_ranks(_error, 4, cfg):
        assert code == 2 and msg.startswith("diloco.inner = ddp: a trainable parameter got no gradient"), msg


@pytest.mark.parametrize("world", [2, 4])
def test_plan_free_gtp_on_a_bare_factory_model(shard: str, world: int) -> None:
    """A factory returning a bare ``nn.Module`` (no plan): GTP shards every ``nn.Linear`` (and the
    embedding) and trains like one process."""
    factory = "tests.external.factories:plain_lm"
    ref = run_ranks(_run, 1, conditional_config(shard, 1, "single", 4, factory=factory))[0]
    out = run_ranks(_run_sharded, world, conditional_config(shard, world, "gtp", 4 // world, factory=factory))
    for r in out:
        assert r["sharded"] == ["branch", "emb", "expert_a", "expert_b", "head", "proj"]
        for k, v in ref["params"].items():
            torch.testing.assert_close(r["params"][k], v, rtol=TOL, atol=TOL, msg=k)


def _run_sharded(cfg: Config) -> dict:
    res = train(cfg, write_run_dir=False, log=False)
    from lowband.parallel import unsharded_copy
    from lowband.parallel.gtp import is_gtp_param

    model = res.strategy.unwrapped()
    sharded = sorted({n.rsplit(".", 1)[0] for n, p in model.named_parameters() if is_gtp_param(p)})
    return {"sharded": sharded,
            "params": {n: p.detach().clone() for n, p in unsharded_copy(model).named_parameters()}}


def test_tp_on_a_bare_factory_model_shows_how_to_write_a_plan(shard: str) -> None:
    cfg = conditional_config(shard, 2, "tp", 2, factory="tests.external.factories:plain_lm")
    for msg, code, _ in run_ranks(_error, 2, cfg):
        assert code == 2, msg
        assert "strategy 'tp' needs the model plan's parallel_linears" in msg and \
            "ModelPlan(parallel_linears=(ParallelLinear('proj', 'column'), ParallelLinear('branch', 'row'), " \
            "...))" in msg and "strategy gtp needs no plan" in msg, msg
