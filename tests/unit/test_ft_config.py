"""The trainer's ``[ft]`` section: local checks with one line naming the key (exit 2 before any process group),
the data split between replica groups, and the settings groups must share."""

from __future__ import annotations

import pytest

from lowband.train.config import ConfigError, load_config, validate

GOOD = ["--strategy.name=diloco", "--diloco.num_replicas=1", "--ft.enabled=true", "--ft.groups=3", "--ft.group=2",
        "--ft.lighthouse=http://10.0.0.1:29510"]


def _validate(*overrides: str) -> None:
    cfg = load_config(None, [*GOOD, *overrides])
    validate(cfg, world_size=cfg.run.world_size)


def test_a_complete_section_validates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    _validate()
    _validate("--ft.min_replicas=3")
    with pytest.raises(ConfigError, match=r"^ft.lighthouse is empty and TORCHFT_LIGHTHOUSE is not set"):
        _validate("--ft.lighthouse=")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lighthouse:29510")  # the URL may come from the environment
    _validate("--ft.lighthouse=")


@pytest.mark.parametrize(("override", "message"), [
    ("--strategy.name=ddp", r"^ft.enabled = true needs strategy.name = diloco"),
    ("--diloco.num_replicas=0", r"^ft.enabled = true: each launch is one replica group, so diloco.num_replicas"),
    ("--ft.group=3", r"^ft.group must be in \[0, ft.groups = 3\)"),
    ("--ft.group=-1", r"^ft.group must be in \[0, ft.groups = 3\)"),
    ("--ft.min_replicas=4", r"^ft.min_replicas \(4\) must be <= ft.groups \(3\)"),
    ("--ft.min_replicas=0", r"^ft.min_replicas must be positive"),
    ("--ft.lighthouse=10.0.0.1:29510", r"^ft.lighthouse must be a URL http://HOST:PORT"),
    ("--ft.lighthouse=http://10.0.0.1", r"^ft.lighthouse must be a URL http://HOST:PORT"),
    ("--ft.quorum_timeout_s=0", r"^ft.quorum_timeout_s must be positive"),
])
def test_a_bad_value_is_one_line_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _validate(override)


def test_groups_read_disjoint_parts_of_the_data() -> None:
    from lowband.train.strategies import get_strategy_class

    cls = get_strategy_class("diloco")
    cfg = load_config(None, [*GOOD, "--run.world_size=2"])
    parts = {(g, r): None for g in range(3) for r in range(2)}
    for g, r in parts:
        cfg.ft.group = g
        parts[(g, r)] = cls.data_partition(cfg, r, 2)
    assert sorted(parts.values()) == [(i, 6) for i in range(6)]
    cfg.ft.enabled = False
    assert cls.data_partition(cfg, 1, 2) == (1, 2)


def test_the_settings_groups_must_share_name_their_keys() -> None:
    from lowband.train.strategies.diloco import ft_agreed_settings

    cfg = load_config(None, [*GOOD, "--diloco.inner=gtp", "--optim.lr=0.002"])
    settings = ft_agreed_settings(cfg, 4)
    assert settings["optim.lr"] == 0.002 and settings["ranks per replica group (run.world_size)"] == 4
    assert settings["gtp.optimizer"] == cfg.gtp.optimizer and "model.n_embd" in settings
    assert "sharded.bucket_mb" not in settings  # only the inner strategy's own section
    assert "diloco.sync_every" not in settings  # groups may sync at different periods (they meet at the quorum)
