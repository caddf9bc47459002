"""``python -m lowband.bench``: help texts, default contenders as documented, the torch Muon baseline's math."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest
import torch

from lowband.bench import SUITES
from lowband.bench.__main__ import main, suite_parser, suite_summary

DOCS = Path(__file__).resolve().parents[2] / "docs" / "PERFORMANCE.md"
COMMON = ("--world", "--out", "--repeats", "--threads", "--device", "--timeout")


def _suite_options(suite: str) -> list[str]:
    p = argparse.ArgumentParser(conflict_handler="resolve")
    importlib.import_module(SUITES[suite]).add_arguments(p)
    return [s for a in p._actions for s in a.option_strings if s.startswith("--") and s != "--help"]


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_suite_help_lists_common_and_own_options(suite: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([suite, "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: python -m lowband.bench {suite}")
    own = _suite_options(suite)
    assert own, suite
    for opt in (*COMMON, *own):
        assert opt in text, (suite, opt)
    assert "common options" in text and f"{suite} options" in text


def test_top_help_lists_every_suite(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for suite in SUITES:
        line = next((ln for ln in text.splitlines() if ln.strip().startswith(suite + " ")), None)
        assert line is not None, suite
        assert suite_summary(suite) in " ".join(text.split()), suite
    assert main([]) == 2 and main(["nope"]) == 2


def test_suite_option_replaces_common_one() -> None:
    """``link --warmup`` is the link suite's LR warm-up, not the timing warm-up (one parser, resolved)."""
    opts = vars(suite_parser("link").parse_args(["link", "--warmup", "3"]))
    assert opts["warmup"] == 3
    assert vars(suite_parser("dp").parse_args(["dp", "--warmup", "0"]))["warmup"] == 0


def _documented_defaults(section: str) -> list[str]:
    """The backticked list after 'Default contenders' in the docs/PERFORMANCE.md section ``## section:``."""
    text = DOCS.read_text()
    start = text.index(f"## {section}:")
    end = text.find("\n## ", start + 1)
    m = re.search(r"Default contenders:\s*`([^`]+)`", text[start:end if end > 0 else None])
    assert m, f"docs/PERFORMANCE.md section {section} names no default contenders"
    return m.group(1).split(",")


def test_dp_default_contenders_are_the_documented_full_list() -> None:
    from lowband.bench import dp

    documented = _documented_defaults("dp")
    assert list(dp.DEFAULT_CONTENDERS) == documented == [c for c in dp.CONTENDERS if c not in dp.NAMED_ONLY]
    assert set(dp.NAMED_ONLY) <= set(dp.CONTENDERS)
    assert suite_parser("dp").parse_args(["dp"]).contenders.split(",") == documented


def test_gtp_default_contenders_are_the_documented_full_list() -> None:
    from lowband.bench import gtp

    documented = _documented_defaults("gtp")
    assert documented == list(gtp.CONTENDER_NAMES)
    assert list(gtp.default_contenders()) == [c for c in documented if c != "gtp-muon" or gtp.gtp_has_muon()]
    assert suite_parser("gtp").parse_args(["gtp"]).contenders.split(",") == list(gtp.default_contenders())


def test_torch_muon_in_float64_equals_lowband_muon() -> None:
    """With its Newton-Schulz made to run in float64, torch.optim.Muon is lowband's Muon: the only
    difference left is where eps enters the normalization (``clamp(norm, eps)`` vs ``norm + eps``), a
    relative change of 1e-7 / ||U||; with ||U|| ~ 1e4 that is 1e-11, amplified at most a^5 ~ 480 by NS5."""
    from lowband.bench.torch_muon import ns_dtype
    from lowband.optim.muon import Muon

    g = torch.Generator().manual_seed(0)
    for shape in ((24, 16), (16, 24)):
        w0 = torch.randn(*shape, generator=g, dtype=torch.float64)
        grads = [1e3 * torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(3)]
        a, b = w0.clone().requires_grad_(), w0.clone().requires_grad_()
        ta = torch.optim.Muon([a], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="original")
        lb = Muon([b], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_dtype=torch.float64)
        for gr in grads:
            a.grad, b.grad = gr.clone(), gr.clone()
            with ns_dtype(torch.float64):
                ta.step()
            lb.step()
        assert (a - b).abs().max().item() <= 1e-11 * 480 * 0.02 * 1.5 * 3, shape


def test_ns_dtype_restores_torch() -> None:
    import torch.optim._muon as tm

    from lowband.bench.torch_muon import ns_dtype

    original = tm._zeropower_via_newtonschulz
    with ns_dtype(torch.float32):
        assert tm._zeropower_via_newtonschulz is not original
    assert tm._zeropower_via_newtonschulz is original
    with ns_dtype(torch.bfloat16):
        assert tm._zeropower_via_newtonschulz is original


def test_torch_muon_refuses_polar_express() -> None:
    from lowband.bench.torch_muon import torch_muon_optimizers
    from lowband.train.config import Config
    from lowband.train.trainer import build_model

    cfg = Config()
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head = 1, 16, 2
    cfg.optim.muon_ns_method = "polar_express"
    with pytest.raises(ValueError, match="muon_ns_method"):
        torch_muon_optimizers(build_model(cfg, torch.device("cpu")), cfg.optim)
