"""The final-model export (issue 14, point 4): every strategy writes a plain, unsharded model that a fresh
process loads without lowband's trainer and that gives the trained model's logits.

Each run trains 3 steps on gloo ranks, then compares, in float32, the exported file against the reference
the strategy itself offers on rank 0: ``strategy.unwrapped()`` (ddp, sharded-*), the collective
``lowband.parallel.unsharded_copy`` of it (gtp, tp), and for DiLoCo the average of the replicas' live
models (gathered first when GTP runs inside the replicas) computed here by hand. Equality is bitwise: the
file stores the same bits, and the fresh process runs the same forward (same ops, one thread, same ATen
CPU kernels) on them. The DiLoCo average is bitwise too on 2 replicas: ``(a + b) / 2`` is the same in
either summation order.

Bytes: the export adds no collective for ddp / sharded-* (their weights are full on every rank), one
``unsharded_copy`` worth of ``gtp:state`` / ``tp:state`` gathers for gtp / tp, and for DiLoCo one all-reduce of
every segment's digests (tag ``export:digests``) and the bytes of one fp32 all-reduce of the segments where the
replicas differ (tag ``export``, ``2 (N-1)/N`` of their bytes; each gathered layer's share right after its
gather with ``diloco.inner = gtp``). With 3 replicas, what every replica holds alike is exported bitwise
(``test_diloco_exports_what_every_replica_shares_bitwise``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowband.testing import run_ranks
from lowband.train.config import Config
from lowband.train.trainer import train
from tests.distributed.average_util import check_average

REPO = Path(__file__).resolve().parents[2]
EXPORT_TAGS = ("export", "export:digests", "gtp:state", "tp:state")

# A fresh interpreter that uses only safetensors + lowband.model.GPT (lowband.train must stay unimported).
GPT_LOADER = """
import json, sys, torch, safetensors.torch
from lowband.model import GPT, GPTConfig
torch.set_num_threads(1)
run, out = sys.argv[1], sys.argv[2]
meta = json.load(open(run + "/model.json"))
model = GPT(GPTConfig(**meta["gpt"])).to(getattr(torch, meta["dtype"]))
model.load_state_dict(safetensors.torch.load_file(run + "/model.safetensors"), strict=True)
x = torch.tensor(json.loads(sys.argv[3]))
with torch.no_grad():
    logits = model.eval()(x)
assert not any(m == "lowband.train" or m.startswith("lowband.train.") for m in sys.modules), "trainer imported"
safetensors.torch.save_file({"logits": logits.contiguous()}, out)
"""

# lowband.load_trained in a fresh interpreter (any model, the factory path included).
LOAD_TRAINED = """
import json, sys, torch, safetensors.torch
import lowband
torch.set_num_threads(1)
run, out = sys.argv[1], sys.argv[2]
model = lowband.load_trained(run)
x = torch.tensor(json.loads(sys.argv[3]))
with torch.no_grad():
    y = model(x)
logits = y[0] if isinstance(y, tuple) else y
tied = [[a, b] for a, p in model.named_parameters(remove_duplicate=False)
        for b, q in model.named_parameters(remove_duplicate=False) if a < b and p is q]
safetensors.torch.save_file({"logits": logits.contiguous()}, out, metadata={"tied": json.dumps(tied)})
"""


def fixed_input(vocab: int, seq_len: int) -> list[list[int]]:
    """Two deterministic rows of token ids below ``vocab``."""
    return [[(37 * i + 11 * r) % vocab for i in range(seq_len)] for r in range(2)]


def run_fresh(script: str, run_dir: Path, x: list[list[int]], out: Path) -> tuple[torch.Tensor, dict]:
    """Run ``script`` in a new interpreter; its logits and file metadata."""
    from safetensors import safe_open

    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", script, str(run_dir), str(out), json.dumps(x)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with safe_open(str(out), "pt") as f:
        return f.get_tensor("logits"), f.metadata() or {}


def export_config(shard: str, out_dir: Path, world: int, strategy: str, name: str) -> Config:
    cfg = Config()
    cfg.run.world_size, cfg.run.steps, cfg.run.dtype, cfg.run.threads = world, 3, "float32", 1
    cfg.run.val_every, cfg.run.val_batches, cfg.run.log_every = 0, 1, 1
    cfg.run.out_dir, cfg.run.name = str(out_dir), name
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 2, 32, 4, 16  # tp: heads % 4
    cfg.data.source, cfg.data.train_bin, cfg.data.batch_size = "bin", shard, 2
    cfg.optim.lr, cfg.optim.warmup_steps = 1e-2, 1
    cfg.strategy.name = strategy
    return cfg


def _differing_segments(a: dict, b: dict, names: list[str]) -> tuple[int, int]:
    """(elements in segments where ``a`` and ``b`` differ, segments) over the tensors ``names``, cut as the
    export cuts them (whole rows of at least SEGMENT_MIN_ELEMS elements)."""
    from lowband.diloco.average import segment_length

    elems = segments = 0
    for k in names:
        seg = segment_length(a[k])
        fa, fb = a[k].reshape(-1), b[k].reshape(-1)
        for lo in range(0, fa.numel(), seg):
            segments += 1
            if not torch.equal(fa[lo:lo + seg], fb[lo:lo + seg]):
                elems += fa[lo:lo + seg].numel()
    return elems, segments


def _reference(res) -> tuple[torch.nn.Module, int, int, tuple[int, int] | None]:
    """(the model the export should equal, ledger records of the reference gather, their bytes, and for DiLoCo
    :func:`_differing_segments` of the two replicas' models)."""
    import torch.distributed as dist

    from lowband.parallel import unsharded_copy

    strategy = res.strategy
    ledger = strategy.env.ledger
    start = len(ledger.records)
    model = strategy.unwrapped()
    inner = strategy.cfg.diloco.inner if strategy.name == "diloco" else strategy.name
    if inner in ("gtp", "tp"):
        model = unsharded_copy(model)
    recs = ledger.records[start:]
    if strategy.name == "diloco":  # the average of the 2 replicas' models, by hand: (a + b) / 2
        world = dist.get_world_size()
        per_replica = world // (strategy.cfg.diloco.num_replicas or world)
        assert world // per_replica == 2
        sds: list = [None] * world
        dist.all_gather_object(sds, {k: v.detach().clone() for k, v in model.state_dict().items()})
        a, b = sds[0], sds[per_replica]  # the first rank of each replica (its ranks hold the same model)
        names = [k for k, _ in [*model.named_parameters(), *model.named_buffers()]]  # tied ones once
        differing = _differing_segments(a, b, names)
        model = type(model)(model.config)
        model.load_state_dict({k: (a[k] + b[k]) / 2 for k in a})
        return model, len(recs), sum(r.wire_bytes for r in recs), differing
    return model, len(recs), sum(r.wire_bytes for r in recs), None


def _train_and_export(cfg: Config, x: list[list[int]]) -> dict:
    res = train(cfg, log=False)
    diloco = getattr(res.strategy, "diloco", None)
    live = ({k: v.detach().clone() for k, v in res.strategy.unwrapped().state_dict().items()}
            if diloco is not None and cfg.diloco.inner == "ddp" else None)  # each replica's own model
    ledger = res.strategy.env.ledger
    export_recs = [(r.op, r.tag, r.numel, r.wire_bytes) for r in ledger.step_records() if r.tag in EXPORT_TAGS]
    model, ref_count, ref_bytes, differing = _reference(res)
    with torch.no_grad():
        out = model.eval()(torch.tensor(x))
    return {"logits": out, "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "path": None if res.model_path is None else str(res.model_path), "export_recs": export_recs,
            "ref_count": ref_count, "ref_bytes": ref_bytes, "live": live, "differing": differing,
            "diloco": None if diloco is None else {"committed": diloco.committed, "in_flight": diloco.in_flight},
            "nparams": sum(p.numel() for p in model.parameters())}


def check_export(out: list[dict], run_dir: Path, x: list[list[int]], tmp_path: Path) -> None:
    """Rank 0 wrote the files (and only rank 0 reports a path); the file holds rank 0's reference state
    bitwise; a fresh process gives rank 0's reference logits bitwise."""
    from safetensors.torch import load_file

    assert out[0]["path"] == str(run_dir / "model.safetensors")
    assert all(o["path"] is None for o in out[1:])
    saved = load_file(str(run_dir / "model.safetensors"))
    ref = out[0]["state"]
    assert sorted(saved) == sorted(ref)
    for k, v in ref.items():
        assert saved[k].dtype == v.dtype and torch.equal(saved[k], v), k
    logits, _ = run_fresh(GPT_LOADER, run_dir, x, tmp_path / "logits.safetensors")
    assert logits.dtype == torch.float32 and torch.equal(logits, out[0]["logits"])
    meta = json.loads((run_dir / "model.json").read_text())
    assert meta["builder"] == "gpt" and meta["tokenizer"] == "bytes" and meta["step"] == 3
    assert meta["dtype"] == "float32" and meta["seq_len"] == 16 and meta["vocab_size"] == 320


@pytest.mark.parametrize("strategy", ["ddp", "sharded-muon"])
def test_full_weight_strategies_export_without_collectives(shard: str, tmp_path: Path, strategy: str) -> None:
    world = 2
    cfg = export_config(shard, tmp_path, world, strategy, "r")
    x = fixed_input(320, 16)
    out = run_ranks(_train_and_export, world, cfg, x, timeout=180)
    check_export(out, tmp_path / "r", x, tmp_path)
    assert all(o["export_recs"] == [] for o in out)  # weights are full on every rank: nothing travels


@pytest.mark.parametrize(("strategy", "world"), [("gtp", 2), ("tp", 2), ("tp", 4)])
def test_sharded_strategies_export_the_gathered_model(shard: str, tmp_path: Path, strategy: str, world: int) -> None:
    cfg = export_config(shard, tmp_path, world, strategy, "r")
    x = fixed_input(320, 16)
    out = run_ranks(_train_and_export, world, cfg, x, timeout=240)
    check_export(out, tmp_path / "r", x, tmp_path)
    for o in out:  # the export is exactly one unsharded_copy: same gathers, same bytes
        assert len(o["export_recs"]) == o["ref_count"] > 0
        assert sum(r[3] for r in o["export_recs"]) == o["ref_bytes"] > 0
        assert {r[1] for r in o["export_recs"]} == {f"{strategy}:state"}


@pytest.mark.parametrize(("world", "inner"), [(2, "ddp"), (4, "gtp")])
def test_diloco_exports_the_average_of_the_replicas(shard: str, tmp_path: Path, world: int, inner: str) -> None:
    """2 replicas (of 1 rank with ddp inside, of a 2-rank GTP group with gtp inside), sync_every 4 over 2
    fragments, delay 1: fragment 0 syncs at step 2 and fragment 1's pseudo-gradient is still in flight
    after step 3, so the export must wait for it first."""
    cfg = export_config(shard, tmp_path, world, "diloco", "r")
    cfg.diloco.num_replicas, cfg.diloco.inner = 2, inner
    cfg.diloco.sync_every, cfg.diloco.fragments, cfg.diloco.delay = 4, 2, 1
    x = fixed_input(320, 16)
    out = run_ranks(_train_and_export, world, cfg, x, timeout=240)
    check_export(out, tmp_path / "r", x, tmp_path)
    n = out[0]["nparams"]
    for o in out:  # one all-reduce of the digests (32 bytes per segment, 2 (N-1)/N of them with N = 2), then
        # the bytes of one fp32 all-reduce of the segments where the replicas differ: one bucket with ddp
        # inside; with gtp inside per gathered layer and for the replicated rest, beside exactly one
        # unsharded_copy's gathers
        differ_elems, segments = o["differing"]
        assert 0 < differ_elems < n  # some rows of the embedding were never touched: they stay at home
        digests = [r for r in o["export_recs"] if r[1] == "export:digests"]
        assert {r[0] for r in digests} == {"all_reduce"}
        assert len(digests) == (1 if inner == "ddp" else o["ref_count"] + 1)
        assert sum(r[2] for r in digests) == 4 * segments and sum(r[3] for r in digests) == 32 * segments
        averages = [r for r in o["export_recs"] if r[1] == "export"]
        assert {r[0] for r in averages} == {"all_reduce"} and len(averages) <= len(digests)
        assert sum(r[2] for r in averages) == differ_elems and sum(r[3] for r in averages) == differ_elems * 4
        gathers = [r for r in o["export_recs"] if not r[1].startswith("export")]
        assert len(gathers) == o["ref_count"] and sum(r[3] for r in gathers) == o["ref_bytes"]
        assert (o["ref_count"] > 0) == (inner == "gtp")
        assert o["diloco"] == {"committed": 1, "in_flight": 1}  # fragment 1 was still in flight
    if inner == "ddp":  # the replicas differ, so the average matters
        live0, live1 = out[0]["live"], out[1]["live"]
        assert all(not torch.equal(live0[k], live1[k]) for k in ("lm_head.weight", "blocks.0.attn.qkv.weight"))
    meta = json.loads((tmp_path / "r" / "model.json").read_text())
    assert "average of the 2 replicas" in meta["source"]


def _train_branch_lm(cfg: Config) -> dict:
    res = train(cfg, log=False)
    ledger = res.strategy.env.ledger
    return {"live": {k: v.detach().clone() for k, v in res.strategy.unwrapped().state_dict().items()},
            "recs": [(r.op, r.tag, r.numel, r.wire_bytes) for r in ledger.step_records() if r.tag in EXPORT_TAGS]}


def test_diloco_exports_what_every_replica_shares_bitwise(shard: str, tmp_path: Path) -> None:
    """3 replicas of a model with a frozen embedding and a float buffer (identical on every replica) beside
    trained layers (different on each): the frozen weight and the buffer are exported bitwise (an fp32 sum of 3
    equal values rounds: before the digests, about 15 % of such elements came back one ulp off) and never
    travel; the rest is the replicas' mean within the rounding of a 3-term fp32 sum."""
    from safetensors.torch import load_file

    world = 3
    cfg = export_config(shard, tmp_path, world, "diloco", "b")
    cfg.model.factory = "tests.external.factories:branch_lm"
    cfg.diloco.num_replicas, cfg.diloco.sync_every, cfg.diloco.fragments, cfg.diloco.delay = 3, 2, 1, 0
    out = run_ranks(_train_branch_lm, world, cfg, timeout=240)
    saved = load_file(str(tmp_path / "b" / "model.safetensors"))
    lives = [o["live"] for o in out]
    assert sorted(saved) == sorted(lives[0])
    for k in ("emb.weight", "mix"):  # the replicas share them (they started from replica 0's model)
        assert all(torch.equal(live[k], lives[0][k]) for live in lives), k
        assert torch.equal(saved[k], lives[0][k]), k  # bitwise
    differ_elems = check_average(saved, lives)
    assert differ_elems > 0  # the trained layers differ: the average matters
    for o in out:
        averages = [r for r in o["recs"] if r[1] == "export"]
        assert {r[0] for r in averages} == {"all_reduce"}
        assert sum(r[2] for r in averages) == differ_elems  # only what differs travels, in fp32
        assert all(r[3] == 2 * (world - 1) * r[2] * 4 // world for r in averages)


# ------------------------------------------------------------------------------ factory models, ties
FACTORY = "tests.external.factories:outside_gpt"


def _train_factory(cfg: Config, x: list[list[int]]) -> dict:
    res = train(cfg, log=False)
    model = res.strategy.unwrapped()
    with torch.no_grad():
        logits, _ = model.eval()(torch.tensor(x))
    return {"logits": logits, "path": None if res.model_path is None else str(res.model_path),
            "tied": model.transformer.wte.weight is model.lm_head.weight}


def test_tied_factory_model_round_trips_through_load_trained(shard: str, tmp_path: Path) -> None:
    world = 2
    cfg = export_config(shard, tmp_path, world, "ddp", "tied")
    cfg.model.factory = FACTORY  # OutsideGPT with vocab 320 (the shard's byte tokens) and seq_len 16
    x = fixed_input(320, 16)
    out = run_ranks(_train_factory, world, cfg, x, timeout=180)
    assert out[0]["tied"] and out[0]["path"] == str(tmp_path / "tied" / "model.safetensors")
    meta = json.loads((tmp_path / "tied" / "model.json").read_text())
    assert meta["builder"] == "factory" and meta["factory"] == FACTORY and meta["gpt"] is None
    from safetensors import safe_open

    with safe_open(str(tmp_path / "tied" / "model.safetensors"), "pt") as f:  # the tied tensor is stored once
        names = set(f.keys())
    assert ("lm_head.weight" in names) != ("transformer.wte.weight" in names)
    logits, file_meta = run_fresh(LOAD_TRAINED, tmp_path / "tied", x, tmp_path / "logits.safetensors")
    assert torch.equal(logits, out[0]["logits"])
    assert json.loads(file_meta["tied"]) == [["lm_head.weight", "transformer.wte.weight"]]


# ------------------------------------------------------------------------------ one process
def _train_single(cfg: Config, x: list[list[int]], callable_factory: bool) -> dict:
    from tests.external.outside_gpt import OutsideConfig, seeded_model

    factory = (lambda c: seeded_model(0, 0, OutsideConfig(vocab_size=c.model.vocab_size, block_size=c.model.seq_len))
               ) if callable_factory else None
    res = train(cfg, log=False, model_factory=factory)
    model = res.strategy.unwrapped()
    with torch.no_grad():
        y = model.eval()(torch.tensor(x))
    return {"path": None if res.model_path is None else str(res.model_path), "logits": y[0] if callable_factory else y,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def test_bfloat16_model_loads_bitwise_with_load_trained(shard: str, tmp_path: Path) -> None:
    cfg = export_config(shard, tmp_path, 1, "single", "bf16")
    cfg.run.dtype = "bfloat16"
    x = fixed_input(320, 16)
    out = run_ranks(_train_single, 1, cfg, x, False, timeout=120)[0]
    from lowband import load_trained

    model = load_trained(tmp_path / "bf16")
    assert not model.training
    for k, v in out["state"].items():
        got = model.state_dict()[k]
        assert got.dtype == torch.bfloat16 and torch.equal(got, v), k
    mode = (tmp_path / "bf16" / "model.safetensors").stat().st_mode & 0o777
    assert mode == (tmp_path / "bf16" / "model.json").stat().st_mode & 0o777


def _train_expect_export_error(cfg: Config) -> str:
    from lowband.train.export import ExportError

    try:
        train(cfg, log=False)
    except ExportError as e:
        return str(e)
    return "no error"


def test_a_failed_write_raises_on_every_rank_and_leaves_no_temporary_files(shard: str, tmp_path: Path) -> None:
    cfg = export_config(shard, tmp_path, 2, "ddp", "blocked")
    cfg.run.overwrite = True  # the stale files below are another run's: replacing them is asked for
    (tmp_path / "blocked" / "model.safetensors").mkdir(parents=True)  # rank 0 cannot rename the weights there
    (tmp_path / "blocked" / "model.json").write_text("{}")  # a stale description is removed first
    out = run_ranks(_train_expect_export_error, 2, cfg, timeout=180)
    assert all("writing the final model" in m and "failed on rank 0" in m and "run.export = false" in m for m in out)
    assert "IsADirectoryError" in out[0] and out[0] == out[1] is not None
    assert sorted(p.name for p in (tmp_path / "blocked").iterdir() if "model" in p.name) == ["model.safetensors"]


def _train_twice(cfg: Config) -> str | None:
    """Train ``cfg``, then the same with another seed into the same run directory: the error of the second."""
    from lowband.train.config import ConfigError

    train(cfg, log=False)
    cfg.run.seed += 1
    try:
        train(cfg, log=False)
    except ConfigError as e:
        return str(e)
    return None


def test_train_refuses_another_runs_outputs_on_every_rank(shard: str, tmp_path: Path) -> None:
    """``lowband.train.train`` (the Python API, no CLI preflight) keeps a run directory's outputs as the CLI does:
    a second run with another config raises the same ``ConfigError`` on both ranks and writes nothing."""
    cfg = export_config(shard, tmp_path, 2, "ddp", "twice")
    out = run_ranks(_train_twice, 2, cfg, timeout=180)
    assert out[0] == out[1] is not None and "holds another run's outputs (metrics.jsonl, config.toml, " in out[0], out
    assert "model.safetensors, model.json; its config.toml is another config)" in out[0], out
    assert "seed = 0" in (tmp_path / "twice" / "config.toml").read_text()


def test_export_off_writes_no_model(shard: str, tmp_path: Path) -> None:
    cfg = export_config(shard, tmp_path, 1, "single", "off")
    cfg.run.export = False
    out = run_ranks(_train_single, 1, cfg, fixed_input(320, 16), False, timeout=120)[0]
    assert out["path"] is None
    assert not (tmp_path / "off" / "model.safetensors").exists() and not (tmp_path / "off" / "model.json").exists()
    assert (tmp_path / "off" / "metrics.jsonl").exists()


def test_unimportable_python_factory_is_exported_and_load_trained_says_how_to_load(shard: str,
                                                                                    tmp_path: Path) -> None:
    """A ``model_factory`` lambda has no importable name: the weights are written, model.json says who built
    them, and load_trained explains how to load them into a module built by hand (which works)."""
    from safetensors.torch import load_model

    from lowband.train.trained import TrainedModelError, load_trained
    from tests.external.outside_gpt import OutsideConfig, seeded_model

    cfg = export_config(shard, tmp_path, 1, "single", "lam")
    x = fixed_input(320, 16)
    out = run_ranks(_train_single, 1, cfg, x, True, timeout=120)[0]
    assert out["path"] == str(tmp_path / "lam" / "model.safetensors")
    meta = json.loads((tmp_path / "lam" / "model.json").read_text())
    assert meta["builder"] == "factory" and meta["factory"] is None and "<lambda>" in meta["factory_repr"]
    with pytest.raises(TrainedModelError, match=r"no importable 'module:function' name.*load_model"):
        load_trained(tmp_path / "lam")
    model = seeded_model(5, 0, OutsideConfig(vocab_size=320, block_size=16))
    load_model(model, str(tmp_path / "lam" / "model.safetensors"), strict=True)
    assert model.transformer.wte.weight is model.lm_head.weight
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the rank ran it: the same kernels on the same bits
    try:
        with torch.no_grad():
            assert torch.equal(model.eval()(torch.tensor(x))[0], out["logits"])
    finally:
        torch.set_num_threads(threads)


def test_load_trained_errors_name_the_missing_piece(tmp_path: Path) -> None:
    from lowband.train.trained import TrainedModelError, load_trained

    with pytest.raises(TrainedModelError, match="does not exist"):
        load_trained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrainedModelError, match=r"no model.safetensors.*run.export = true"):
        load_trained(tmp_path / "empty")
    (tmp_path / "empty" / "model.safetensors").write_bytes(b"")
    (tmp_path / "empty" / "model.json").write_text('{"format": "other"}')
    with pytest.raises(TrainedModelError, match=r"not a lowband\.model/1 model description"):
        load_trained(tmp_path / "empty")
