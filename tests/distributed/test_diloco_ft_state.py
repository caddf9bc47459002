"""The heal state of fault-tolerant DiLoCo (:mod:`lowband.diloco.ft_state`) for every inner strategy, on 2
ranks: a replica that trained differently and loads a peer's ``local_state`` in place then trains exactly
like the peer (bitwise, parameters and optimizer state), so views into the state (GTP-Muon's stacked
momentum, the sharded optimizer's flat buffers) were written, not replaced. A peer with another model is
refused naming the tensor."""

from __future__ import annotations

import pytest
import torch

from lowband.testing.multirank import run_ranks

INNERS = [("ddp", "adamw"), ("sharded-adamw", "adamw"), ("sharded-muon", "adamw"), ("gtp", "adamw"),
          ("gtp", "muon")]


def _cfg(inner: str, gtp_optimizer: str, seed: int, width: int = 32):  # type: ignore[no-untyped-def]
    from lowband.train.config import Config

    cfg = Config()
    cfg.run.seed, cfg.run.world_size = seed, 2
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 1, width, 2, 16
    cfg.data.batch_size = 2
    cfg.strategy.name = inner
    cfg.gtp.optimizer = gtp_optimizer
    return cfg


def _train(strat, steps: range, rank: int) -> None:  # type: ignore[no-untyped-def]
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        tok = torch.randint(0, 300, (2, 17), generator=g)
        with strat.microbatch(last=True):
            strat.model(tok[:, :-1], tok[:, 1:]).backward()
        strat.optimizer_step()


def _flat(state: dict) -> list[tuple[str, object]]:
    out = [(k, v) for k, v in sorted(state["model"].items())]
    opt = state["optimizer"]
    for key in sorted(opt["state"], key=str):
        for name, v in sorted(opt["state"][key].items()):
            out.append((f"opt:{key}.{name}", v))
    return out


def _heal(inner: str, gtp_optimizer: str) -> str:
    from lowband.diloco.ft_state import load_local_state, local_state
    from lowband.train.env import init_distributed
    from lowband.train.strategies import get_strategy_class
    from lowband.train.trainer import build_model

    env = init_distributed("cpu")
    torch.manual_seed(0)
    peer_cfg, mine_cfg = _cfg(inner, gtp_optimizer, 0), _cfg(inner, gtp_optimizer, 1)
    peer = get_strategy_class(inner)(peer_cfg, env)
    peer.setup(build_model(peer_cfg, env.device))
    mine = get_strategy_class(inner)(mine_cfg, env)
    mine.setup(build_model(mine_cfg, env.device))
    _train(peer, range(0, 3), env.rank)
    _train(mine, range(10, 11), env.rank)  # another start, other data, fewer steps: state entries differ
    load_local_state(mine.unwrapped(), mine.optimizer, local_state(peer.unwrapped(), peer.optimizer))
    _train(peer, range(3, 5), env.rank)
    _train(mine, range(3, 5), env.rank)
    a, b = _flat(local_state(peer.unwrapped(), peer.optimizer)), _flat(local_state(mine.unwrapped(), mine.optimizer))
    assert [k for k, _ in a] == [k for k, _ in b]
    for (k, x), (_, y) in zip(a, b, strict=True):
        same = x.equal(y) if isinstance(x, torch.Tensor) else x == y
        assert same, f"{inner}/{gtp_optimizer}: {k} differs after the heal and 2 equal steps"
    # a peer with another model width: refused by name before anything is written
    other_cfg = _cfg(inner, gtp_optimizer, 0, width=64)
    other = get_strategy_class(inner)(other_cfg, env)
    other.setup(build_model(other_cfg, env.device))
    with pytest.raises(ValueError, match=r"heal from a peer: param:\S+ is \(") as info:
        load_local_state(mine.unwrapped(), mine.optimizer, local_state(other.unwrapped(), other.optimizer))
    return str(info.value)


@pytest.mark.parametrize(("inner", "gtp_optimizer"), INNERS)
def test_heal_state_in_place_every_inner(inner: str, gtp_optimizer: str) -> None:
    messages = run_ranks(_heal, 2, inner, gtp_optimizer)
    assert all("another model, dtype or layout" in m for m in messages)
