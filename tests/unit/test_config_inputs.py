"""Inputs that misdirect or read badly (issue 21, points 6 and 7): each is refused with one line naming
the field or file, classified as an input error (exit 2); a full disk at export is a failed run (exit 1)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lowband.train import errors, preflight
from lowband.train.__main__ import main
from lowband.train.config import Config, ConfigError, load_config
from lowband.train.models import ModelContractError, call_factory, load_factory
from tests.cli.cli_util import TINY_TOML, cli_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("overrides", "match"), [
    (["--run.name="], "run.name is empty"),
    (["--run.name=  "], "run.name is empty"),
    (["--run.name=../x"], r"run.name = '../x' is not a folder name"),
    (["--run.name=/tmp/abs"], r"run.name = '/tmp/abs' is not a folder name"),
    (["--run.name=a/b"], r"run.name = 'a/b' is not a folder name"),
    (["--run.name=.."], r"run.name = '..' is not a folder name"),
    (["--run.name=."], r"run.name = '.' is not a folder name"),
    (["--data.path=mine.txt"], r"data.path = 'mine.txt' is read only when data.source = text, but data.source = "
                               r"builtin"),
    (["--data.source=bin", "--data.train_bin=x*.bin", "--data.path=mine.txt"], r"data.source = bin"),
])
def test_misdirecting_values_are_refused(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_plain_names_and_text_paths_still_load() -> None:
    cfg = load_config(None, ["--run.name=run-1.b_c", "--data.source=text", "--data.path=a/b.txt"])
    assert cfg.run.name == "run-1.b_c"


def test_a_non_utf8_config_file_is_named_exit_2(tmp_path: Path, capsys) -> None:
    p = tmp_path / "latin1.toml"
    p.write_bytes('[run]\nname = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.toml' is not UTF-8 text: byte 0xe9 at offset 17"):
        load_config(p)
    assert main(["--config", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lowband.train: error: config file") and "unexpected" not in err


def test_cache_dir_of_the_wrong_kind_is_an_input_error(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "afile").write_text("x")
    for bad in (tmp_path / "afile", tmp_path / "afile" / "below"):
        monkeypatch.setenv("LOWBAND_CACHE_DIR", str(bad))
        with pytest.raises(ConfigError, match="LOWBAND_CACHE_DIR"):
            preflight.check_cache_dir()
    monkeypatch.setenv("LOWBAND_CACHE_DIR", str(tmp_path / "fresh"))
    preflight.check_cache_dir()
    assert (tmp_path / "fresh").is_dir()


def test_lock_paths_of_the_wrong_kind_are_input_errors(tmp_path: Path) -> None:
    cfg = Config()
    cfg.run.out_dir, cfg.run.name = str(tmp_path), "r"
    (tmp_path / "r").write_text("a file where the run directory goes")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        preflight.check_lock_paths(cfg)
    (tmp_path / "r").unlink()
    (tmp_path / "r" / ".lowband.lock").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"\.lowband\.lock' is a directory, not a lowband lock file"):
        preflight.check_lock_paths(cfg)
    (tmp_path / "r" / ".lowband.lock").rmdir()
    preflight.check_lock_paths(cfg)


def test_cli_cache_dir_a_file_is_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    (tmp_path / "cache").write_text("x")
    proc = subprocess.run([sys.executable, "-m", "lowband.train", "--config", "tiny.toml"], cwd=tmp_path,
                          env=cli_env({"LOWBAND_CACHE_DIR": str(tmp_path / "cache")}), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "lowband.train: error: LOWBAND_CACHE_DIR: 'cache' exists and is not a directory; choose a directory path"
        .replace("'cache'", repr(str(tmp_path / "cache")))]


# ------------------------------------------------------------------------------ the user's factory
def _factory_module(tmp_path: Path, monkeypatch, name: str, source: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)
    return f"{name}:make"


def _input_line(exc: BaseException) -> str:
    outcome = errors.classify(exc)
    assert outcome.code == errors.EXIT_INPUT and outcome.kind == "input", outcome
    return outcome.message


def test_a_factory_module_with_a_syntax_error_names_file_and_line(tmp_path: Path, monkeypatch) -> None:
    spec = _factory_module(tmp_path, monkeypatch, "fac_syntax", "def make(cfg):\n    return (\n\nx = 1 +\n")
    with pytest.raises(ConfigError) as info:
        load_factory(spec)
    line = _input_line(info.value)
    assert line.startswith("model.factory = 'fac_syntax:make': importing 'fac_syntax' failed: SyntaxError")
    assert f"{tmp_path / 'fac_syntax.py'}:" in line


def test_a_factory_module_failing_at_import_names_file_and_line(tmp_path: Path, monkeypatch) -> None:
    spec = _factory_module(tmp_path, monkeypatch, "fac_import",
                           "import math\nLIMIT = 1 / 0\n\ndef make(cfg):\n    pass\n")
    with pytest.raises(ConfigError) as info:
        load_factory(spec)
    line = _input_line(info.value)
    assert "importing 'fac_import' failed: ZeroDivisionError: division by zero" in line
    assert line.endswith(f"({tmp_path / 'fac_import.py'}:2)")


def test_a_factory_raising_when_called_names_file_and_line(tmp_path: Path, monkeypatch) -> None:
    spec = _factory_module(tmp_path, monkeypatch, "fac_call", """\
        import torch

        def make(cfg):
            width = cfg.model.n_embd
            return torch.nn.Linear(width, undefined_name)
        """)
    cfg = Config()
    cfg.model.factory = spec
    with pytest.raises(ConfigError) as info:
        call_factory(load_factory(spec), cfg, torch.device("cpu"))
    line = _input_line(info.value)
    assert line == (f"model.factory = 'fac_call:make': calling it failed: NameError: name 'undefined_name' is not "
                    f"defined ({tmp_path / 'fac_call.py'}:5)")


@pytest.mark.parametrize(("body", "got"), [
    ("return {'model': torch.nn.Linear(2, 2)}", "got dict"),
    ("return torch.nn.Linear(2, 2), None", "got tuple (Linear, NoneType)"),
    ("return torch.zeros(2, 3)", "got Tensor of shape (2, 3)"),
])
def test_a_factory_returning_the_wrong_type_names_it(tmp_path: Path, monkeypatch, body: str, got: str) -> None:
    spec = _factory_module(tmp_path, monkeypatch, f"fac_type{abs(hash(body))}",
                           f"import torch\n\ndef make(cfg):\n    {body}\n")
    cfg = Config()
    cfg.model.factory = spec
    with pytest.raises(ModelContractError) as info:
        call_factory(load_factory(spec), cfg, torch.device("cpu"))
    assert isinstance(info.value, TypeError)
    line = _input_line(info.value)
    assert line.startswith(f"model.factory = '{spec}' must return an nn.Module or (nn.Module, ModelPlan)")
    assert line.endswith(got)


def test_a_forward_returning_the_wrong_type_is_an_input_error_naming_it() -> None:
    from lowband.train.forward import lm_loss

    class Dict(torch.nn.Module):
        def forward(self, idx, targets=None):
            return {"out": idx}

    class Pair(torch.nn.Module):
        def forward(self, idx, targets=None):
            return torch.zeros(*idx.shape, 4), None

    idx = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ModelContractError) as info:
        lm_loss(Dict(), idx, idx, "logits")
    assert _input_line(info.value).endswith("got dict")
    with pytest.raises(ModelContractError) as info:
        lm_loss(Pair(), idx, idx, "targets")
    assert _input_line(info.value).endswith("got tuple (Tensor, NoneType)")


def test_export_on_a_full_disk_is_a_failed_run_in_one_line(tmp_path: Path) -> None:
    """ENOSPC while writing model.safetensors (simulated: safetensors' save_file is replaced by one that
    raises it): exit 1, kind failed, one line saying so; no model file, no temporary file left."""
    (tmp_path / "tiny.toml").write_text(TINY_TOML.replace('name = "ddp"', 'name = "single"'))
    script = textwrap.dedent("""\
        import errno, sys
        import safetensors.torch as st

        def full(tensors, filename, metadata=None):
            open(filename, "wb").write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device", filename)

        st.save_file = full
        from lowband.train.__main__ import main
        sys.exit(main(["--config", "tiny.toml", "--run.steps=1", "--checkpoint.every=0"]))
        """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert len(lines) == 1 and "unexpected" not in lines[0], proc.stderr
    assert "writing the final model" in lines[0] and "no space left on device" in lines[0]
    assert not list((tmp_path / "runs" / "t").glob("model.*")), list((tmp_path / "runs" / "t").iterdir())
