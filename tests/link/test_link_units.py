"""Pure pieces of the link suite (no namespaces): time-to-target interpolation, result rows, the
issue's target checks, the Markdown report and the contender registry."""

from __future__ import annotations

import pytest

from lowband.bench.link import bandwidth_rows, check_options, contender_list, horizon_text, link_markdown, target_checks
from lowband.bench.link_contenders import CONTENDERS, LinkSpec, LinkTopo, register_contender, resolve
from lowband.bench.link_rank import crossing_time, flattened, link_config


def test_crossing_time_interpolates_between_evaluations() -> None:
    curve = [[0.0, 0, 5.0], [2.0, 4, 4.0], [4.0, 8, 3.0]]
    assert crossing_time(curve, 3.5) == pytest.approx(3.0)  # halfway from 4.0 to 3.0 in loss
    assert crossing_time(curve, 3.0) == 4.0
    assert crossing_time(curve, 4.0) == 2.0
    assert crossing_time(curve, 5.5) == 0.0
    assert crossing_time(curve, 2.9) is None


def test_flat_criterion_compares_the_means_of_two_windows() -> None:
    def curve(vals: list[float]) -> list[list[float]]:
        return [[0.0, 0, 6.0]] + [[float(i), 4 * (i + 1), v] for i, v in enumerate(vals)]

    falling = [5.0 - 0.1 * i for i in range(8)]  # windows of 4: means 4.85 and 4.45, 8 % apart
    assert not flattened(curve(falling), 4, 0.005)
    assert flattened(curve(falling), 4, 0.1)
    noisy_flat = [3.0, 3.02, 2.99, 3.01, 3.0, 3.01, 2.99, 3.0]  # means 3.005 and 3.0: 0.17 % apart
    assert flattened(curve(noisy_flat), 4, 0.005) and not flattened(curve(noisy_flat), 4, 0.001)
    assert not flattened(curve(noisy_flat[:7]), 4, 0.5)  # fewer than two windows: never flat
    assert flattened(curve([3.0, 3.0, 3.1, 3.2]), 2, 0.005)  # rising: flat (no more improvement)


def test_horizon_options_and_header() -> None:
    base = {"world": 2, "nodes": 0, "global_batch": 16, "steps": 400, "eval_every": 4, "val_batches": 2,
            "compute_steps": 6, "max_steps_factor": 3, "setup_steps": 2, "time_cap": 2.0, "time_limit": 900.0,
            "target": None}
    assert check_options({**base, "horizon": "flat", "flat_window": 10, "flat_tol": 0.005}) == (2, 2)
    with pytest.raises(ValueError, match="--flat-window must be >= 1"):
        check_options({**base, "horizon": "flat", "flat_window": 0, "flat_tol": 0.005})
    with pytest.raises(ValueError, match="--target and --horizon flat exclude each other"):
        check_options({**base, "horizon": "flat", "flat_window": 10, "flat_tol": 0.005, "target": 3.0})
    cfg = {"steps": 400, "horizon": "flat", "flat_window": 10, "flat_tol": 0.005}
    text = horizon_text(cfg, [{"contender": "ddp", "steps": 212}, {"contender": "diloco-int8", "steps": 40}])
    assert text.startswith("ddp until flat") and "it ran 212 steps" in text and "at most 400 steps" in text
    assert horizon_text({"steps": 40}, []) == "ddp 40 steps"


def _raw(name: str, ttt: float | None, steps: int = 8) -> dict:
    return {"name": name, "note": "", "steps": steps, "clock_s": 4.0, "step_times_s": [0.5] * steps,
            "curve": [[0.0, 0, 5.0], [4.0, steps, 3.0]], "final_val_loss": 3.0, "time_to_target_s": ttt,
            "ledger_wire_bytes_per_rank": [1000, 1000], "iface_tx_bytes_per_rank": [1080, 1060],
            "iface_rx_bytes_per_rank": [1060, 1080], "uplink_tx_bytes_per_node": [],
            "ledger_source": "lowband ledger", "optimizer_state_bytes": 8, "resident_bytes": 16}


def _out(rows: list[dict]) -> dict:
    return {"compute_only_step_s": 0.02, "target_val_loss": 3.0, "baseline_clock_s": 4.0, "rows": rows,
            "load_avg_before": [1.0, 1.0, 1.0], "load_avg_after": [1.0, 1.0, 1.0]}


def test_rows_and_target_checks() -> None:
    out = _out([_raw("ddp", 4.0), _raw("zero", 5.0), _raw("fsdp2", None), _raw("sharded-adamw", 4.4),
                _raw("diloco-int8", 0.3), {"name": "gtp", "error": "ConfigError: nope", "note": ""}])
    rows = bandwidth_rows(out, "10mbit", [0.5, 1.0])
    by = {r["contender"]: r for r in rows}
    assert by["ddp"]["ddp_comm_share"] == pytest.approx(1 - 0.02 / 0.5)  # 96 %
    assert by["diloco-int8"]["ratio_vs"] == {"ddp@10mbit": pytest.approx(0.075)}
    assert by["fsdp2"]["ratio_vs"] == {} and not by["fsdp2"]["reached_target"]
    assert by["ddp"]["wire_bytes_per_step_per_rank"] == 125 and by["ddp"]["iface_over_ledger"] == pytest.approx(1.07)
    assert by["ddp"]["val_loss_at_budget"] == {"2.000": 5.0, "4.000": 3.0}
    assert by["gtp"]["error"] == "ConfigError: nope"
    checks = target_checks(rows, "10mbit")
    assert checks[0].startswith("10mbit: ddp communicates 96% of its step (>= 95%)") and checks[0].endswith("met")
    assert "diloco-int8" in checks[0]
    assert checks[1] == "10mbit: sharded-adamw 4.40 s vs zero 5.00 s (x0.880): met"
    assert checks[2] == "10mbit: sharded-adamw 4.40 s; fsdp2 did not reach the target: met"
    slow = bandwidth_rows(_out([_raw("ddp", 4.0), _raw("diloco-int8", 0.5), _raw("zero", 4.0),
                                _raw("sharded-adamw", 4.4)]), "10mbit", [1.0])
    lines = target_checks(slow, "10mbit")
    assert lines[0].endswith("MISSED") and "0.125 x ddp's" in lines[0]
    assert lines[1].endswith("MISSED")
    doc = {"world_size": 2, "torch": "x", "results": rows,
           "config": {"topology": "flat", "params": 10, "model": {"seq_len": 64}, "global_batch": 16, "steps": 8,
                      "eval_every": 4, "bandwidths": ["10mbit"]}}
    md = link_markdown(doc)
    assert "| diloco-int8 | 8 |" in md and "| gtp | error: ConfigError: nope |" in md and "MISSED" not in md


def test_registry_config_and_extension() -> None:
    cfg = link_config({"steps": 8, "n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 32, "vocab_size": 320,
                       "bigram_rows": 64, "global_batch": 8, "lr": 1e-3, "warmup": 1, "diloco_sync_every": 4,
                       "diloco_fragments": 2}, 4)
    assert cfg.data.batch_size == 2 and cfg.optim.schedule == "constant"
    flat, nodes = LinkTopo(4, 4), LinkTopo(4, 2)
    assert CONTENDERS["diloco-int8"].config(cfg, nodes).diloco.num_replicas == 2
    assert CONTENDERS["diloco-int8"].config(cfg, flat).diloco.num_replicas == 4
    assert CONTENDERS["gtp"].config(cfg, nodes).gtp.size == 2 and CONTENDERS["gtp"].config(cfg, flat).gtp.size == 0
    assert CONTENDERS["sharded-adamw-sparse"].config(cfg, flat).sparse.tables == ["bigram"]
    fp8 = CONTENDERS["sharded-adamw-fp8"].config(cfg, flat)
    assert fp8.strategy.grad_wire_dtype == "fp8" and fp8.sharded.param_wire_dtype == "bfloat16"
    assert "sharded-adamw-fp8" not in contender_list("all")  # run only when named
    assert contender_list("sharded-adamw-fp8") == ["ddp", "sharded-adamw-fp8"]
    ef = CONTENDERS["sharded-adamw-fp8-ef"].config(cfg, flat)
    assert ef.sharded.grad_error_feedback and ef.strategy.grad_wire_dtype == "fp8"
    assert not fp8.sharded.grad_error_feedback and "sharded-adamw-fp8-ef" not in contender_list("all")
    assert CONTENDERS["sharded-adamw-p2p"].config(cfg, flat).sharded.exchange == "p2p"
    assert CONTENDERS["sharded-adamw"].config(cfg, flat).sharded.exchange == "ring"
    assert "sharded-adamw-p2p" not in contender_list("all")
    assert cfg.sparse.tables == []  # the base config is not touched
    from lowband.comm import codecs

    for wire in getattr(codecs, "WIRE_CODECS", codecs.CODECS):
        assert (f"diloco-{wire}" in CONTENDERS) == (wire != "fp64")
    assert "diloco-topk-int2" in contender_list("all") and "diloco-topk-rice-int2" not in contender_list("all")
    d1 = CONTENDERS["diloco-topk-rice-int2-ef95-d1"].config(cfg, flat).diloco
    assert (d1.wire, d1.ef_decay, d1.delay, d1.num_replicas) == ("topk-rice-int2", 0.95, 1, flat.nodes)
    assert CONTENDERS["diloco-topk-rice-int2-ef95"].config(cfg, flat).diloco.delay == 0
    assert resolve("strategy:ddp").strategy == "ddp"
    with pytest.raises(ValueError, match="unknown contender 'nope'"):
        resolve("nope")
    with pytest.raises(ValueError, match="no such config key"):
        LinkSpec("ddp", {"strategy.nope": 1}).config(cfg, flat)
    register_contender("ddp-bf16-test", LinkSpec("ddp", {"strategy.grad_wire_dtype": "bfloat16"}))
    try:
        assert contender_list("sharded-adamw,ddp-bf16-test") == ["ddp", "sharded-adamw", "ddp-bf16-test"]
    finally:
        del CONTENDERS["ddp-bf16-test"]


def test_contender_variants_change_config_keys() -> None:
    """``NAME/section.key=value/...``: the registered contender's overrides, then the listed keys (typed), named
    only; a malformed item, an unknown key or an unknown base contender is refused by name."""
    cfg = link_config({"steps": 8, "n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 32, "vocab_size": 320,
                       "bigram_rows": 64, "global_batch": 8, "lr": 1e-3, "warmup": 1, "diloco_sync_every": 4,
                       "diloco_fragments": 2}, 2)
    flat = LinkTopo(2, 2)
    name = "diloco-rice40of4096-ef95-d1/diloco.topk_k=16/diloco.outer_lr=1.5/diloco.outer_nesterov=false"
    spec = resolve(name)
    d = spec.config(cfg, flat).diloco
    assert (d.wire, d.topk_chunk, d.topk_k, d.ef_decay, d.delay) == ("topk-rice-int2", 4096, 16, 0.95, 1)
    assert d.outer_lr == 1.5 and d.outer_nesterov is False and isinstance(d.topk_k, int)
    assert not spec.in_all and spec.note.endswith("diloco.topk_k = 16, diloco.outer_lr = 1.5, "
                                                  "diloco.outer_nesterov = False")
    assert CONTENDERS["diloco-rice40of4096-ef95-d1"].config(cfg, flat).diloco.topk_k == 40  # base untouched
    assert resolve("strategy:diloco/diloco.wire=int8").config(cfg, flat).diloco.wire == "int8"
    assert contender_list(f"{name},sharded-adamw") == ["ddp", name, "sharded-adamw"]
    # typed as the trainer's CLI overrides: a float field gets a float, a list field a list
    typed = resolve("diloco-topk-int2/diloco.outer_lr=2/sparse.tables=bigram").config(cfg, flat)
    assert isinstance(typed.diloco.outer_lr, float) and typed.diloco.outer_lr == 2.0
    assert typed.sparse.tables == ["bigram"]
    for bad, match in ((f"ddp{'/'}x", "'x' is not section.key=value"),
                       ("ddp/diloco.nope=1", "unknown config key 'diloco.nope'"),
                       ("ddp/diloco.topk_k=abc", "diloco.topk_k: expected an integer"),
                       ("nope/diloco.topk_k=3", "unknown contender 'nope'"), ("ddp/diloco.topk_k=", "section.key")):
        with pytest.raises(ValueError, match=match):
            resolve(bad)
