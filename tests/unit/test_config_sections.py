"""Per-strategy config sections, moved keys, the model factory key and the loss adapter (issue 11)."""

from __future__ import annotations

import pytest
import torch

from lowband.train.config import MOVED_KEYS, Config, ConfigError, load_config
from lowband.train.forward import lm_loss, resolve_convention


@pytest.mark.parametrize("old, new", sorted(MOVED_KEYS["strategy"].items()))
def test_every_moved_key_fails_naming_its_new_key(tmp_path, old: str, new: str) -> None:
    with pytest.raises(ConfigError, match=rf"^config key 'strategy\.{old}' moved to '{new}'"):
        load_config(None, [f"--strategy.{old}=1"])
    p = tmp_path / "c.toml"
    p.write_text(f"[strategy]\n{old} = 1\n")
    with pytest.raises(ConfigError, match=rf"'strategy\.{old}' moved to '{new}'"):
        load_config(p)
    with pytest.raises(AttributeError, match=rf"moved to '{new}'"):
        getattr(Config().strategy, old)
    with pytest.raises(AttributeError, match=rf"moved to '{new}'"):
        setattr(Config().strategy, old, 1)


def test_new_sections_load_validate_and_round_trip(tmp_path) -> None:
    cfg = load_config(None, ["--strategy.name=gtp", "--gtp.size=1", "--gtp.gather=bf16", "--tp.optimizer=adamw",
                             "--sparse.tables=bigram,tok_emb", "--sparse.mode=dense",
                             "--sharded.param_wire_dtype=bfloat16", "--model.factory=pkg.mod:fn",
                             "--model.forward=logits"])
    assert (cfg.gtp.size, cfg.gtp.gather, cfg.tp.optimizer) == (1, "bf16", "adamw")
    assert (cfg.sparse.tables, cfg.sparse.mode, cfg.sharded.param_wire_dtype) == (["bigram", "tok_emb"], "dense",
                                                                                  "bfloat16")
    assert (cfg.model.factory, cfg.model.forward) == ("pkg.mod:fn", "logits")
    for bad, match in [("--gtp.gather=int4", r"gtp\.gather must be one of native, bf16, fp8"),
                       ("--tp.optimizer=sgd", r"tp\.optimizer must be one of rekls, adamw"),
                       ("--sparse.mode=some", r"sparse\.mode must be one of"),
                       ("--gtp.size=-1", r"gtp\.size must be >= 0"),
                       ("--gtp.fp8_block=0", r"gtp\.fp8_block must be positive"),
                       ("--model.forward=hf", r"model\.forward must be one of auto, targets, logits")]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, [bad])


@pytest.mark.parametrize("spelling, tables", [("", []), ("[]", []), (" [ ] ", []), ("bigram", ["bigram"]),
                                              ("[bigram, tok_emb]", ["bigram", "tok_emb"]),
                                              ('["bigram","tok_emb"]', ["bigram", "tok_emb"]),
                                              ("bigram,,tok_emb,", ["bigram", "tok_emb"])])
def test_cli_lists_take_commas_or_tomls_brackets(spelling: str, tables: list[str]) -> None:
    cfg = load_config(None, ["--strategy.name=sharded-adamw", "--model.bigram_rows=64", f"--sparse.tables={spelling}"])
    assert cfg.sparse.tables == tables


def test_sparse_table_names_of_lowbands_gpt_are_checked_early_a_factory_models_at_setup() -> None:
    with pytest.raises(ConfigError, match=r"sparse\.tables: 'wte' is not allowed; allowed: bigram, tok_emb"):
        load_config(None, ["--strategy.name=sharded-adamw", "--sparse.tables=wte"])
    cfg = load_config(None, ["--strategy.name=sharded-adamw", "--sparse.tables=wte", "--model.factory=a.b:c"])
    assert cfg.sparse.tables == ["wte"]  # the factory model's plan decides (tests/external)


class _LossModel(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.w = torch.nn.Parameter(torch.ones(5, 7, dtype=torch.float64))

    def forward(self, idx, targets=None):
        logits = self.w[idx]
        if self.kind == "logits":
            return logits
        if targets is None:  # the Hugging Face way: no labels, no loss
            return type("Out", (), {"loss": None, "logits": logits})()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1))
        if self.kind == "loss":
            return loss
        if self.kind == "tuple":
            return logits, loss
        return type("Out", (), {"loss": loss, "logits": logits})()


@pytest.mark.parametrize("kind, convention", [("loss", "targets"), ("tuple", "targets"), ("object", "targets"),
                                              ("logits", "logits"), ("object", "logits")])
def test_lm_loss_takes_the_loss_from_every_convention(kind: str, convention: str) -> None:
    idx = torch.tensor([[0, 1, 2], [3, 4, 0]])
    tgt = torch.tensor([[1, 2, 3], [4, 0, 6]])
    ref = torch.nn.functional.cross_entropy(torch.ones(6, 7, dtype=torch.float64), tgt.reshape(-1))
    got = lm_loss(_LossModel(kind), idx, tgt, convention)
    assert got.dtype == torch.float64 and torch.equal(got, ref)  # same op on the same values: bitwise


def test_lm_loss_refuses_a_mismatched_convention_by_name() -> None:
    idx = tgt = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(TypeError, match=r"model\.forward = targets: model\(idx, targets\) must return"):
        lm_loss(_LossModel("logits"), idx, tgt, "targets")
    assert resolve_convention(_LossModel("loss"), "auto") == "targets"
    with pytest.raises(ValueError, match=r"model\.forward must be one of"):
        resolve_convention(_LossModel("loss"), "hf")
