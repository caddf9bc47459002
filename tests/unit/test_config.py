"""Config loading, overrides and every kind of bad input (one line naming the field, exit code 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lowband.train.__main__ import main
from lowband.train.config import ConfigError, load_config, to_toml

ROOT = Path(__file__).resolve().parents[2]


def test_demo_config_loads_and_round_trips(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs" / "demo.toml", ["--model.n_layer=2", "--optim.lr=0.01",
                                                       "--run.name=x"])
    assert cfg.model.n_layer == 2 and cfg.optim.lr == 0.01 and cfg.run.name == "x"
    assert cfg.run.world_size == 2
    p = tmp_path / "c.toml"
    p.write_text(to_toml(cfg))
    assert load_config(p) == cfg


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path: Path) -> None:
    """Every file in configs/ loads and validates at its own world size (a fault-tolerant one with the
    Lighthouse address its launch line gives)."""
    from lowband.train.config import validate

    overrides = ["--ft.lighthouse=http://127.0.0.1:29510"] if "[ft]" in path.read_text() else []
    cfg = load_config(path, overrides)
    validate(cfg, world_size=cfg.run.world_size)


@pytest.mark.parametrize("overrides, match", [
    (["--model.n_layers=2"], r"unknown config key 'model.n_layers'"),
    (["--modle.n_layer=2"], r"unknown config section 'modle'"),
    (["--model.n_layer=two"], r"model.n_layer: expected an integer"),
    (["--model.n_layer=0"], r"model.n_layer must be positive"),
    (["--optim.lr=-1"], r"optim.lr must be positive"),
    (["--run.dtype=float16"], r"run.dtype must be one of float32, float64, bfloat16"),
    (["--model.n_embd=130"], r"model.n_embd \(130\) must be divisible by model.n_head"),
    (["--data.batch_size=6", "--data.grad_accum=4"], r"data.batch_size \(6\) must be divisible"),
    (["--strategy.name=nope"], r"strategy.name must be one of"),
    (["--strategy.name=single"], r"'single' needs between 1 and 1 ranks; run.world_size is 2"),
    (["model.n_layer=2"], r"bad override"),
    (["--strategy.name=ddp", "--strategy.grad_wire_dtype=fp8"],
     r"'fp8' \(block-scaled fp8 gradients\) is implemented for sharded-adamw, sharded-muon and gtp \(and "
     r"diloco.inner = sharded-\*\) only; strategy.name is 'ddp'"),
    (["--strategy.name=diloco", "--diloco.inner=ddp", "--strategy.grad_wire_dtype=fp8"],
     r"strategy.name is 'diloco': use float32 or bfloat16"),
    (["--strategy.name=tp", "--strategy.grad_wire_dtype=fp8"], r"strategy.name is 'tp': use float32 or bfloat16"),
])
def test_bad_overrides(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(ROOT / "configs" / "demo.toml", overrides)


@pytest.mark.parametrize("name", ["sharded-adamw", "sharded-muon", "gtp"])
def test_fp8_gradients_are_accepted_by_the_sharded_strategies(name: str) -> None:
    cfg = load_config(ROOT / "configs" / "demo.toml", [f"--strategy.name={name}", "--strategy.grad_wire_dtype=fp8"])
    assert cfg.strategy.grad_wire_dtype == "fp8"


def test_fp8_gradients_are_accepted_by_gtp_with_data_parallel_groups() -> None:
    """gtp.size below the world: the data-parallel all-reduce across GTP groups is block-scaled too."""
    cfg = load_config(ROOT / "configs" / "demo.toml", ["--strategy.name=gtp", "--gtp.size=1",
                                                       "--strategy.grad_wire_dtype=fp8"])
    assert (cfg.gtp.size, cfg.strategy.grad_wire_dtype) == (1, "fp8")


def test_fp8_gradients_are_accepted_by_diloco_with_a_sharded_inner() -> None:
    cfg = load_config(ROOT / "configs" / "demo.toml", ["--strategy.name=diloco", "--diloco.inner=sharded-adamw",
                                                       "--diloco.num_replicas=1", "--strategy.grad_wire_dtype=fp8"])
    assert cfg.diloco.inner == "sharded-adamw" and cfg.strategy.grad_wire_dtype == "fp8"


def test_bad_toml_types(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text('[model]\nn_layer = "4"\n')
    with pytest.raises(ConfigError, match=r"model.n_layer: expected an integer, got '4'"):
        load_config(p)
    p.write_text("[model]\nn_layer = true\n")
    with pytest.raises(ConfigError, match=r"model\.n_layer: expected an integer"):
        load_config(p)
    p.write_text("n_layer = 3\n")
    with pytest.raises(ConfigError, match="must be a \\[section\\]"):
        load_config(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")


def test_cli_exit_code_2_in_process(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["--config", str(ROOT / "configs" / "demo.toml"), "--model.n_head=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.n_head must be positive" in err[0]
    assert main(["--config", str(ROOT / "configs" / "demo.toml"), "--data.source=bin",
                 f"--data.train_bin={tmp_path}/none-*.bin"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none-*.bin" in err[0]
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x00" * 2000)
    assert main(["--config", str(ROOT / "configs" / "demo.toml"), "--data.source=bin",
                 f"--data.train_bin={bad}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.bin" in err[0] and "magic" in err[0]


def test_cli_exit_code_2_subprocess() -> None:
    proc = subprocess.run([sys.executable, "-m", "lowband.train", "--config", str(ROOT / "configs" / "demo.toml"),
                           "--run.world_size=0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "lowband.train: error: run.world_size must be positive, got 0"
