"""Every benchmark suite's default invocation runs (issue 21, point 9): ``python -m lowband.bench SUITE``
with no contender list, its sizes turned down by ``--quick``, on 2 CPU ranks (through the command's
``main``, in this process).

Not run here: ``link`` and ``goodput`` (they build network namespaces and tc qdiscs: root only; tests/link
covers them, including the link suite's one-line refusal without privileges), whose default invocations are
documented with ``sudo``; ``goodput``'s runs last minutes by design (a fault must outlast a group's restart).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowband.bench import SUITES
from lowband.bench.__main__ import apply_quick, main, suite_parser

ROOT = Path(__file__).resolve().parents[2]
NOT_RUN = {"link": "needs root and network namespaces (tests/link)",
           "goodput": "needs root and network namespaces; minutes per run (tests/link/test_goodput_units.py)"}


def test_every_suite_has_quick_settings_for_existing_options() -> None:
    import importlib

    for suite in SUITES:
        mod = importlib.import_module(SUITES[suite])
        quick = getattr(mod, "QUICK", None)
        assert quick, f"{suite} has no QUICK settings"
        opts = vars(suite_parser(suite).parse_args([suite]))
        assert set(quick) <= set(opts), (suite, set(quick) - set(opts))


def test_quick_keeps_explicit_options_and_the_default_contenders() -> None:
    parser = suite_parser("dp")
    plain = vars(parser.parse_args(["dp"]))
    quick = apply_quick("dp", vars(parser.parse_args(["dp", "--quick", "--n-layer", "3"])), parser)
    assert quick["n_layer"] == 3 and quick["n_embd"] == 32 and quick["repeats"] == 1 and quick["warmup"] == 0
    assert quick["contenders"] == plain["contenders"]
    link = suite_parser("link")
    assert apply_quick("link", vars(link.parse_args(["link", "--quick"])), link)["warmup"] == 1  # its LR warm-up


def test_diloco_default_config_validates_for_every_contender() -> None:
    """The diloco suite's default config is the bench model (ddp, no sparse tables): both ddp and diloco
    validate with it; the demo config (sharded-muon + a sparse bigram table) runs too."""
    import copy

    from lowband.bench import diloco
    from lowband.train.config import load_config, validate

    for path in (diloco.DEFAULT_CONFIG, "configs/demo.toml"):
        base = load_config(diloco.resolve_config(path))
        if base.diloco.inner not in ("sharded-adamw", "sharded-muon"):
            base.sparse.tables = []
        for name in ("ddp", "diloco"):
            c = copy.deepcopy(base)
            c.strategy.name = name
            validate(c, world_size=2)
    assert diloco.resolve_config(diloco.DEFAULT_CONFIG) == ROOT / "configs" / "diloco-bench.toml" or \
        diloco.resolve_config(diloco.DEFAULT_CONFIG).resolve() == (ROOT / "configs" / "diloco-bench.toml")
    with pytest.raises(ValueError, match="no such file"):
        diloco.resolve_config("nope/missing.toml")


@pytest.mark.parametrize("suite", sorted(s for s in SUITES if s not in NOT_RUN))
def test_default_invocation_runs(suite: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # ``python -m lowband.bench SUITE ...`` is ``main(argv)``; called in this process it runs on the test
    # session's pooled ranks instead of importing torch and spawning 2 ranks once more per suite
    monkeypatch.chdir(tmp_path)
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / f"{suite}.json"
    assert main([suite, "--world", "2", "--quick", "--out", str(out), "--timeout", "240"]) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == suite and doc["world_size"] == 2 and doc["results"]
    names = [r["name"] for r in doc["results"]]
    default = vars(suite_parser(suite).parse_args([suite])).get("contenders")
    if default and default != "all":
        assert names[: len(default.split(","))] == default.split(",") or set(default.split(",")) <= set(names), names


def test_a_run_past_its_timeout_ends_with_one_line_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "long.json"
    assert main(["diloco", "--world", "2", "--quick", "--steps", "1000000", "--out", str(out), "--timeout", "3"]) == 1
    assert not out.exists()
    err = capsys.readouterr().err.strip()
    assert err == ("python -m lowband.bench: diloco did not finish within --timeout 3 s on 2 ranks (nothing written); "
                   "longer runs need a larger --timeout")
