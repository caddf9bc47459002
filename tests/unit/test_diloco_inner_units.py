"""Single-process pieces of DiLoCo with inner strategies: bucket breaks, paused hooks, the inner refusals."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from lowband.diloco import StreamingDiLoCo
from lowband.diloco.streaming import _bucket_bounds


def test_bucket_bounds_cut_at_breaks_then_cap() -> None:
    assert _bucket_bounds(10, None) == [(0, 10)]
    assert _bucket_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert _bucket_bounds(10, None, [3]) == [(0, 3), (3, 10)]
    assert _bucket_bounds(10, 4, [3]) == [(0, 3), (3, 7), (7, 10)]
    assert _bucket_bounds(10, None, [0, 10, 12]) == [(0, 10)]  # breaks at the ends (or past them) cut nothing
    assert _bucket_bounds(10, 100, [6, 2, 6]) == [(0, 2), (2, 6), (6, 10)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def test_paused_steps_are_not_diloco_steps() -> None:
    """Inner steps inside ``paused()`` leave the local step, the schedule and the global copies alone."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = StreamingDiLoCo(model, opt, sync_every=2, fragments=1, delay=0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with dl.paused():
        opt.step()
        opt.step()
    assert dl.local_step == 0 and dl.committed == 0
    opt.step()
    assert dl.local_step == 1 and dl.committed == 0
    opt.step()  # the second counted step syncs the fragment
    assert dl.local_step == 0 and dl.committed == 1
    dl.close()


def test_bucket_breaks_need_one_list_per_fragment() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"diloco bucket_breaks: got 1 lists, expected one per fragment \(2\)"):
        StreamingDiLoCo(model, opt, sync_every=2, fragments=[model[0], model[1]], bucket_breaks=[[1]])


def test_inner_must_be_known() -> None:
    from lowband.train.config import Config, ConfigError, validate

    cfg = Config()
    cfg.strategy.name, cfg.run.world_size = "diloco", 2
    cfg.diloco.inner = "fsdp"
    with pytest.raises(ConfigError, match=re.escape("diloco.inner must be one of ddp, sharded-adamw, sharded-muon, "
                                                    "gtp; got 'fsdp'")):
        validate(cfg, world_size=2)


class _Proj(nn.Module):
    """A projection that is not an ``nn.Linear`` (like ``transformers``' ``Conv1D``)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def test_gtp_inner_refuses_a_model_without_linears_before_any_collective() -> None:
    """GTP needs no plan (it shards every ``nn.Linear``), but a model with no ``nn.Linear`` is refused in
    ``setup`` before any collective (the mesh, the inner strategy), naming key and modules."""
    from lowband.plan import ModelPlan
    from lowband.train.config import Config, ConfigError
    from lowband.train.env import init_distributed
    from lowband.train.strategies import get_strategy_class

    cfg = Config()
    cfg.strategy.name, cfg.run.world_size, cfg.diloco.inner = "diloco", 1, "gtp"
    strategy = get_strategy_class("diloco")(cfg, init_distributed("cpu", 30.0))
    strategy.plan = ModelPlan()
    with pytest.raises(ConfigError, match=re.escape("diloco.inner = gtp shards nn.Linear layers (and nn.Embedding "
                                                    "tables); Sequential has no nn.Linear to shard (a tied one "
                                                    "stays replicated) (its 2-D weights sit in _Proj modules)")):
        strategy.setup(nn.Sequential(_Proj(), nn.Tanh()))
    assert not hasattr(strategy, "mesh")


def test_inner_choices_are_the_strategies_that_declare_themselves_diloco_inners() -> None:
    """``diloco.inner``'s choices (config, the diloco strategy's list) are exactly the registered strategies
    whose class sets ``diloco_inner``; the format tags and the agreed sections come from the inner's hooks."""
    from lowband.train.config import CHOICES, Config
    from lowband.train.env import init_distributed
    from lowband.train.strategies import available, get_strategy_class
    from lowband.train.strategies.diloco import INNER, ft_agreed_settings, inner_gtp_size

    assert set(INNER) == {n for n in available() if get_strategy_class(n).diloco_inner}
    assert tuple(CHOICES["diloco.inner"]) == INNER
    env = init_distributed("cpu", 30.0)
    tags = {}
    for name in INNER:
        cfg = Config()
        cfg.strategy.name, cfg.diloco.inner, cfg.gtp.optimizer = "diloco", name, "muon"
        inner = get_strategy_class(name)(cfg, env)
        tags[name] = inner.inner_format()
        agreed = {k.split(".")[0] for k in ft_agreed_settings(cfg, 4)}
        assert ("sharded" in agreed, "gtp" in agreed) == (name.startswith("sharded-"), name == "gtp"), name
        cfg.gtp.size = 0
        cfg.diloco.num_replicas = 2
        assert inner_gtp_size(cfg, 8) == (4 if name == "gtp" else 1)
    assert tags == {"ddp": None, "sharded-adamw": "sharded-adamw", "sharded-muon": "sharded-muon", "gtp": "gtp-muon"}
