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
