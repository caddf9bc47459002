"""The diloco bench's bookkeeping: run specs, Pareto marking, merging split sweeps (no training)."""

from __future__ import annotations

import pytest

from lowband.bench.diloco import _diloco_specs, mark_pareto, pareto_markdown
from lowband.bench.diloco_report import merge


def _row(name: str, nbytes: int, loss: float, **kw) -> dict:
    return {"name": name, "wire_bytes_total": nbytes, "val_loss_final": loss, "val_loss": loss, **kw}


def test_specs_from_runs_and_from_the_grid() -> None:
    specs = _diloco_specs({"runs": "sync_every=8,wire=topk-int2,topk_k=16;sync_every=4,wire=fp32,name=ref"})
    assert specs == [("diloco-H8-topk-int2-topk_k16", {"sync_every": 8, "wire": "topk-int2", "topk_k": 16}),
                     ("ref", {"sync_every": 4, "wire": "fp32"})]
    assert _diloco_specs({"runs": "", "sync_every": "4,8", "wires": "int8"}) == [
        ("diloco-H4-int8", {"sync_every": 4, "wire": "int8"}), ("diloco-H8-int8", {"sync_every": 8, "wire": "int8"})]
    with pytest.raises(ValueError, match="unknown key 'H'"):
        _diloco_specs({"runs": "H=4"})
    assert _diloco_specs({"runs": "sync_every=4,wire=topk-int2,ef_decay=0.95"}) == [
        ("diloco-H4-topk-int2-ef_decay0.95", {"sync_every": 4, "wire": "topk-int2", "ef_decay": 0.95})]


def test_pareto_and_merge() -> None:
    ddp = _row("ddp", 1000, 1.0)
    a = {"results": [ddp, _row("a", 10, 1.02, wire="int2", sync_every=8, outer_lr=1.0, outer_momentum=0.0,
                                error_feedback=True)]}
    b = {"results": [dict(ddp), _row("b", 20, 1.05, wire="int4", sync_every=8, outer_lr=1.0, outer_momentum=0.0,
                                      error_feedback=True)]}
    rows = merge([a, b])
    assert [r["name"] for r in rows] == ["ddp", "a", "b"]
    assert [r["pareto"] for r in rows] == [True, True, False]  # b: more bytes and a higher loss than a
    assert rows[1]["wire_ratio_vs_ddp"] == 0.01 and rows[2]["val_loss_ratio_vs_ddp"] == 1.05
    table = pareto_markdown(rows)
    assert "| a | int2 | 8 | 1.0 / 0.0 | on | 10 | 1/100 | 1.0200 | 1.0200 |" in table
    decayed = pareto_markdown([ddp, _row("c", 10, 1.0, wire="int2", sync_every=8, outer_lr=1.0, outer_momentum=0.0,
                                         error_feedback=True, ef_decay=0.95, wire_ratio_vs_ddp=0.01,
                                         val_loss_ratio_vs_ddp=1.0, pareto=True)])
    assert "| c | int2 | 8 | 1.0 / 0.0 | on, decay 0.95 | 10 |" in decayed
    bad = {"results": [_row("ddp", 1000, 1.1)]}
    with pytest.raises(ValueError, match="the ddp reference differs"):
        merge([a, bad])
    one = [_row("x", 5, 2.0), _row("y", 5, 2.0)]
    mark_pareto(one)
    assert all(r["pareto"] for r in one)  # ties do not dominate


def _doc(params: int, world: int, ddp_loss: float, *rows: dict) -> dict:
    cfg = {"model_params": params, "steps": 100, "batch_size_per_rank": 8, "seq_len": 64}
    return {"world_size": world, "config": cfg, "results": [_row("ddp", 1000, ddp_loss), *rows]}


def _dl(name: str, nbytes: int, loss: float, **kw) -> dict:
    settings = dict(wire="topk-int2", sync_every=4, outer_lr=1.0, outer_momentum=0.0, fragments=2, delay=0,
                    alpha=0.0, error_feedback=True, ef_decay=0.95, topk_chunk=4096, topk_k=40, block_size=256)
    return _row(name, nbytes, loss, **{**settings, **kw})


def test_scaling_sweep_groups_seeds_and_configurations() -> None:
    from lowband.bench.diloco_sweep import sweep, sweep_markdown

    docs = [
        _doc(1000, 2, 2.0, _dl("best", 1, 2.02), _dl("dense", 4, 2.0, topk_k=80)),
        _doc(1000, 2, 2.2, _dl("renamed best", 1, 2.178)),  # seed 2: the same configuration under another name
        _doc(1000, 2, 2.0, _dl("best", 1, 2.02)),  # seed 1 again (a split sweep): not a third seed
        _doc(1000, 4, 1.8, _dl("best", 2, 1.89)),
        _doc(5000, 2, 1.5, _dl("best", 1, 1.47)),
    ]
    rows = sweep(docs)
    assert [(r["model_params"], r["replicas"], r["config"]) for r in rows] == [
        (1000, 2, "ddp"), (1000, 2, "topk-int2 40/4096, H4, EF decay 0.95"),
        (1000, 2, "topk-int2 80/4096, H4, EF decay 0.95"),
        (1000, 4, "ddp"), (1000, 4, "topk-int2 40/4096, H4, EF decay 0.95"),
        (5000, 2, "ddp"), (5000, 2, "topk-int2 40/4096, H4, EF decay 0.95")]
    ddp, best, dense = rows[0], rows[1], rows[2]
    assert ddp["seeds"] == 2 and ddp["ddp_val_loss_mean"] == pytest.approx(2.1)
    assert ddp["ddp_spread"] == pytest.approx(0.2 / 2**0.5 / 2.1)  # sample std of (2.0, 2.2) over their mean
    assert best["seeds"] == 2 and best["val_loss_ratio_vs_ddp"] == pytest.approx((2.02 + 2.178) / 4.2)
    assert best["per_seed_ratio"] == pytest.approx([1.01, 0.99])
    assert best["wire_ratio_vs_ddp"] == 0.001
    # a configuration run at one seed only is compared with ddp at that seed, not with ddp's mean
    assert dense["seeds"] == 1 and dense["val_loss_ratio_vs_ddp"] == pytest.approx(1.0)
    assert rows[4]["tokens_per_param"] == pytest.approx(100 * 8 * 4 * 64 / 1000)
    assert rows[3]["ddp_spread"] is None
    table = sweep_markdown(rows)
    assert "| 1,000 | 2 | 102.4 | topk-int2 40/4096, H4, EF decay 0.95 | 1/1,000 | 2 | 2.0990 | 0.9995 " \
           "| 1.010 / 0.990 | 6.7 % (2) |" in table
    with pytest.raises(ValueError, match="at one seed has two results"):
        sweep([docs[0], _doc(1000, 2, 2.0, _dl("best", 1, 2.03))])
    with pytest.raises(ValueError, match="has no ddp row"):
        sweep([{"world_size": 2, "config": {"model_params": 1}, "results": [_dl("best", 1, 2.0)]}])


def test_scaling_sweep_command_writes_its_outputs_and_refuses_in_one_line(tmp_path, capsys) -> None:
    import json

    from lowband.bench.diloco_sweep import main

    files = []
    for i, doc in enumerate([_doc(1000, 2, 2.0, _dl("best", 1, 2.02)), _doc(1000, 2, 2.2, _dl("best", 1, 2.178))]):
        files.append(tmp_path / f"s{i}.json")
        files[-1].write_text(json.dumps(doc))
    assert main([*map(str, files), "--out", str(tmp_path / "out" / "sweep")]) == 0
    rows = json.loads((tmp_path / "out" / "sweep.json").read_text())["rows"]
    assert [r["seeds"] for r in rows] == [2, 2]
    assert "| 1,000 | 2 | 102.4 | topk-int2 40/4096, H4, EF decay 0.95 | 1/1,000 | 2 |" in (
        tmp_path / "out" / "sweep.md").read_text()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"world_size": 2, "config": {"model_params": 1}, "results": []}))
    capsys.readouterr()
    assert main([str(bad), "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.strip() == "diloco_sweep: input 0 has no ddp row"
    assert main([str(tmp_path / "missing.json"), "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.startswith("diloco_sweep: not a readable diloco bench document (FileNotFoundError")


def test_report_refuses_an_unreadable_input_in_one_line(tmp_path, capsys) -> None:
    from lowband.bench.diloco_report import main as report_main

    assert report_main([str(tmp_path / "missing.json"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diloco_report: not a readable diloco bench document (FileNotFoundError")
    assert err.count("\n") == 1
    garbled = tmp_path / "garbled.json"
    garbled.write_text("{not json")
    assert report_main([str(garbled), "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.startswith("diloco_report: not a readable diloco bench document (JSONDecodeError")
    assert not list(tmp_path.glob("x*"))  # nothing written


def test_scaling_sweep_keeps_runs_of_different_lengths_apart() -> None:
    from lowband.bench.diloco_sweep import sweep

    longer = _doc(1000, 2, 1.9, _dl("best", 2, 1.9))
    longer["config"]["steps"] = 200
    rows = sweep([_doc(1000, 2, 2.0, _dl("best", 1, 2.02)), longer])
    assert [(r["tokens_per_param"], r["config"], r["ddp_seeds"]) for r in rows] == [
        (102.4, "ddp", 1), (102.4, "topk-int2 40/4096, H4, EF decay 0.95", 1),
        (204.8, "ddp", 1), (204.8, "topk-int2 40/4096, H4, EF decay 0.95", 1)]
    assert [r["val_loss_ratio_vs_ddp"] for r in rows] == pytest.approx([1.0, 1.01, 1.0, 1.0])
