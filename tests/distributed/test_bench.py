"""The bench harness writes DESIGN.md's JSON shape with exact wire bytes (no timing assertions)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from lowband.bench.__main__ import main
from lowband.model import GPT, GPTConfig

KEYS = {"name", "step_time_s_median", "step_time_s", "wire_bytes_per_step_per_rank",
        "optimizer_state_bytes_per_rank", "peak_memory_bytes", "final_loss", "ratio_vs"}


def test_comm_suite_shape_and_bytes(tmp_path: Path) -> None:
    out = tmp_path / "comm.json"
    assert main(["comm", "--world", "2", "--repeats", "2", "--warmup", "0", "--out", str(out),
                 "--sizes-mib", "0.25", "--ops", "reduce_scatter,all_gather"]) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "comm" and doc["world_size"] == 2 and doc["backend"] == "gloo"
    rows = {r["name"]: r for r in doc["results"]}
    assert set(rows) == {"reduce_scatter 0.25MiB torch", "reduce_scatter 0.25MiB lowband",
                         "all_gather 0.25MiB torch", "all_gather 0.25MiB lowband"}
    for r in rows.values():
        assert KEYS <= set(r) and len(r["step_time_s"]) == 2
    nbytes = 2**18
    assert rows["reduce_scatter 0.25MiB lowband"]["wire_bytes_per_step_per_rank"] == nbytes // 2
    assert rows["reduce_scatter 0.25MiB torch"]["wire_bytes_per_step_per_rank"] == nbytes  # all-reduce inside
    assert rows["all_gather 0.25MiB lowband"]["algorithm"] == "native"  # below the broadcast threshold
    assert "reduce_scatter 0.25MiB torch" in rows["reduce_scatter 0.25MiB lowband"]["ratio_vs"]
    assert out.with_suffix(".md").read_text().startswith("### `comm`")


def test_comm_suite_wire_codec_rows(tmp_path: Path) -> None:
    """``wire:<codec>``: the codec average against torch's fp32 all-reduce, with the codec's exact message bytes."""
    from lowband.comm.codecs import get_wire

    out = tmp_path / "wire.json"
    assert main(["comm", "--world", "2", "--repeats", "2", "--warmup", "0", "--out", str(out), "--sizes-mib", "0.25",
                 "--ops", "wire:topk-rice-int2,wire:int8", "--topk-chunk", "4096", "--topk-k", "40"]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["topk_chunk"] == 4096 and doc["config"]["topk_k"] == 40
    rows = {r["name"]: r for r in doc["results"]}
    numel = 2**18 // 4
    msg = get_wire("topk-rice-int2", topk_chunk=4096, topk_k=40).message_nbytes(numel)
    assert rows["wire:topk-rice-int2 0.25MiB lowband"]["wire_bytes_per_step_per_rank"] == msg  # (N-1) messages
    assert rows["wire:topk-rice-int2 0.25MiB torch"]["wire_bytes_per_step_per_rank"] == 2**18  # fp32 all-reduce
    int8 = rows["wire:int8 0.25MiB lowband"]["wire_bytes_per_step_per_rank"]
    assert 2**16 <= int8 < 2**16 + 2**11  # one byte per element both phases at 2 ranks, plus block scales
    assert "wire:int8 0.25MiB torch" in rows["wire:int8 0.25MiB lowband"]["ratio_vs"]


def test_comm_suite_refuses_unknown_op_and_codec(tmp_path: Path, capsys) -> None:
    """One line and exit 2 before any rank starts; nothing written."""
    for ops, match in (("all_scatter", "unknown op 'all_scatter'"), ("wire:int3", "got 'int3'"),
                       ("wire:topk", "topk_chunk must be a power of two")):
        assert main(["comm", "--world", "2", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path / "x.json"),
                     "--sizes-mib", "0.25", "--ops", ops, "--topk-chunk", "100"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("python -m lowband.bench: error:") and match in err and "\n" not in err
    assert not (tmp_path / "x.json").exists()


def test_dp_suite_ddp(tmp_path: Path) -> None:
    out = tmp_path / "dp.json"
    assert main(["dp", "--world", "2", "--repeats", "2", "--warmup", "1", "--out", str(out), "--n-layer", "1",
                 "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "2",
                 "--contenders", "ddp"]) == 0
    doc = json.loads(out.read_text())
    (row,) = doc["results"]
    n = doc["config"]["params"]
    assert row["name"] == "ddp" and row["wire_bytes_per_step_per_rank"] == n * 4  # all-reduce at N=2
    assert row["optimizer_state_bytes_per_rank"] == 2 * n * 4 + _step_bytes(doc)
    assert row["final_loss"] > 0 and row["steps"] == 3


def _step_bytes(doc: dict) -> int:
    # torch AdamW keeps a 0-d float32 ``step`` tensor per parameter tensor
    m = doc["config"]["model"]
    tensors = 2 + m["n_layer"] * 6 + 1  # tok_emb, lm_head, 6 per block (qkv, proj, fc, proj, 2 norms), final norm
    return tensors * 4


def test_dp_suite_torch_contenders_agree(tmp_path: Path) -> None:
    """ddp, ZeroRedundancyOptimizer, FSDP2 and sharded-adamw train the same model on the same batches:
    same final loss; wire bytes per step as the ring model says for each (N = 2, S = fp32 param bytes)."""
    out = tmp_path / "dp.json"
    assert main(["dp", "--world", "2", "--repeats", "2", "--warmup", "1", "--out", str(out), "--n-layer", "1",
                 "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "2",
                 "--contenders", "ddp,zero,fsdp2,sharded-adamw"]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    s = json.loads(out.read_text())["config"]["params"] * 4
    for name in ("zero", "fsdp2", "sharded-adamw"):
        # float32, differently ordered reductions (reduce-scatter vs all-reduce) over a few steps: 1e-5 is ~30
        # ulps of a loss ~5.7 (eps 6e-8), far above the rounding and far below any real divergence
        assert abs(rows[name]["final_loss"] - rows["ddp"]["final_loss"]) < 1e-5, name
    assert rows["ddp"]["wire_bytes_per_step_per_rank"] == s  # all-reduce: 2(N-1)/N S
    assert rows["zero"]["wire_bytes_per_step_per_rank"] == s + s // 2  # DDP all-reduce + parameter broadcast
    # RS + AG + the "got a gradient" all-reduce (one uint8 per parameter tensor, 8 per param group (hyperparameter
    # digest and complement; the trainer's AdamW groups: matrices with weight decay, the rest without) plus 4 bytes
    # of grad-scaler, inf and late-copy flags: 2(N-1)/N * (F + 16 + 4) = F + 20 bytes at N = 2) + the clip-norm
    # scalar
    names = {f.name for f in dataclasses.fields(GPTConfig)}
    model_cfg = json.loads(out.read_text())["config"]["model"]
    f = len(list(GPT(GPTConfig(**{k: v for k, v in model_cfg.items() if k in names})).parameters()))
    assert rows["sharded-adamw"]["wire_bytes_per_step_per_rank"] == s + f + 8 * 2 + 4 + 4
    assert rows["sharded-adamw"]["optimizer_state_bytes_per_rank"] == s  # two moments over half the params


def test_dp_suite_muon_baselines(tmp_path: Path) -> None:
    """ddp-muon (torch DDP + torch.optim.Muon), fsdp2-muon (torch.optim.Muon on FSDP2's DTensors) and
    lowband's sharded-muon are the same optimizer: same final loss; bytes and state as each one's
    layout says (N = 2, S = fp32 parameter bytes; every dim of this model is even, so no padding)."""
    out = tmp_path / "dp.json"
    assert main(["dp", "--world", "2", "--repeats", "2", "--warmup", "1", "--out", str(out), "--n-layer", "1",
                 "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "2",
                 "--contenders", "ddp,ddp-muon,sharded-muon,fsdp2,fsdp2-muon"]) == 0
    doc = json.loads(out.read_text())
    rows = {r["name"]: r for r in doc["results"]}
    s = doc["config"]["params"] * 4
    d, v = doc["config"]["model"]["n_embd"], doc["config"]["model"]["vocab_size"]
    muon_bytes = 12 * d * d * 4  # qkv 3d x d, proj d x d, fc 4d x d, proj d x 4d
    assert doc["config"]["muon_ns_dtype_resolved"] == "torch.float32"
    for name in ("sharded-muon", "fsdp2-muon"):
        # float32 Newton-Schulz in all three (torch's iteration made to run in fp32): the updates differ by
        # rounding (reduction order, addmm vs matmul+add, eps placement ~1e-7 relative) amplified by at
        # most a^5 = 3.4445^5 ~ 480 through the 5 iterations: ~1e-4 relative on a step of lr 0.02 moves
        # a loss ~5.8 by far less than 1e-4 in 3 steps; a different optimizer moves it by ~1e-3 (vs ddp)
        assert abs(rows[name]["final_loss"] - rows["ddp-muon"]["final_loss"]) < 1e-4, name
    assert abs(rows["ddp-muon"]["final_loss"] - rows["ddp"]["final_loss"]) > 1e-4  # Muon is not AdamW
    assert rows["ddp-muon"]["wire_bytes_per_step_per_rank"] == s  # DDP all-reduce, from the ledger
    # one momentum buffer per Muon matrix + two AdamW moments for the rest, whole on every rank
    assert rows["ddp-muon"]["optimizer_state_bytes_per_rank"] == muon_bytes + 2 * (s - muon_bytes)
    # sharded-muon: whole matrices owned by one rank each (4 shape groups of one matrix: ranks own
    # 2 of the 4) and half of every AdamW moment
    assert rows["sharded-muon"]["optimizer_state_bytes_per_rank"] < rows["ddp-muon"]["optimizer_state_bytes_per_rank"]
    assert rows["sharded-muon"]["optimizer_state_ratio_vs"]["ddp-muon"] == (
        rows["sharded-muon"]["optimizer_state_bytes_per_rank"] / rows["ddp-muon"]["optimizer_state_bytes_per_rank"])
    # FSDP2 on gloo: all-gather (N-1)/N S + reduce-scatter run as an all-reduce 2(N-1)/N S + the norm scalar
    assert doc["config"]["fsdp2_reduce_scatter_counted_as"] == "all_reduce"
    assert rows["fsdp2"]["wire_bytes_per_step_per_rank"] == s // 2 + s + 4
    fm = rows["fsdp2-muon"]
    assert fm["muon_step_collectives"]["all_reduce"] >= 4  # Newton-Schulz on DTensors: a norm per matrix ...
    assert fm["muon_step_collectives"]["all_gather"] > 0  # ... and operands gathered inside the iteration
    assert fm["wire_bytes_per_step_per_rank"] == s // 2 + s + 4 + fm["muon_step_wire_bytes"]
    assert fm["optimizer_state_bytes_per_rank"] == (muon_bytes + 2 * (s - muon_bytes)) // 2  # dim-0 shards
    assert v % 2 == 0 and d % 2 == 0
    assert set(rows["sharded-muon"]["ratio_vs"]) >= {"ddp", "ddp-muon", "fsdp2-muon"}
    assert set(rows["ddp-muon"]["ratio_vs"]) == {"ddp"}
