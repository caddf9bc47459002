"""DistributedLoader on 1, 2 and 4 gloo ranks: each rank's slice, gathered through the harness return
values, is disjoint from the others and the slices concatenate to the single-process batch. Also: two
ranks rewriting the same shard at once (as ranks building the corpus cache do) never expose a partial file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lowband.data import DistributedLoader, read_shard, write_shard
from lowband.testing import run_ranks

SEQ_LEN, BATCH, SEED, STEPS = 6, 2, 11, 7


def _tokens() -> np.ndarray:
    return np.random.default_rng(3).integers(0, 320, 19 * SEQ_LEN + 1).astype(np.uint16)  # 19 windows


def _rank_batches(resume_at: int) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    loader = DistributedLoader(_tokens(), BATCH, SEQ_LEN, rank=rank, world_size=n, seed=SEED)
    xs, ys, wins = [], [], []
    for step in range(STEPS):
        x, y = next(loader)
        xs.append(x)
        ys.append(y)
        wins.append(loader.windows(step))
    resumed = DistributedLoader(_tokens(), BATCH, SEQ_LEN, rank=rank, world_size=n, seed=SEED,
                                start_step=resume_at)
    tail = [next(resumed)[0] for _ in range(resume_at, STEPS)]
    return {"rank": rank, "x": torch.stack(xs), "y": torch.stack(ys), "windows": np.stack(wins),
            "tail": tail, "state": loader.state_dict()}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_loader_ranks_disjoint_and_match_single_process(world_size):
    out = run_ranks(_rank_batches, world_size, 3, timeout=60)
    assert [o["rank"] for o in out] == list(range(world_size))
    single = DistributedLoader(_tokens(), BATCH * world_size, SEQ_LEN, rank=0, world_size=1, seed=SEED)
    for step in range(STEPS):
        wins = np.concatenate([o["windows"][step] for o in out])
        assert len(set(wins.tolist())) == wins.size == BATCH * world_size  # disjoint across ranks
        x1, y1 = single.batch(step)
        assert torch.equal(torch.cat([o["x"][step] for o in out]), x1)
        assert torch.equal(torch.cat([o["y"][step] for o in out]), y1)
    for o in out:
        assert o["state"]["step"] == STEPS and o["state"]["global_batch"] == BATCH * world_size
        for i, x in enumerate(o["tail"]):
            assert torch.equal(x, o["x"][3 + i])
    if world_size > 1:  # ranks really read different data
        assert not torch.equal(out[0]["x"], out[1]["x"])


def _race_shards(path: str) -> int:
    """Both ranks rewrite the same shard (identical content) while also reading it back: with the
    temp-file + rename write, every read sees a complete, valid shard (the corpus cache relies on it)."""
    tokens = np.arange(200_000, dtype=np.int64) % 320
    dist.barrier()
    reads = 0
    for _ in range(20):
        write_shard(path, tokens)
        got = read_shard(path)
        assert got.size == tokens.size and np.array_equal(got, tokens)
        reads += 1
    return reads


def test_concurrent_shard_writes_are_atomic(tmp_path):
    path = tmp_path / "train.bin"
    write_shard(path, np.arange(200_000, dtype=np.int64) % 320)
    assert run_ranks(_race_shards, 2, str(path), timeout=60) == [20, 20]
    assert [p.name for p in tmp_path.iterdir()] == ["train.bin"]  # no temp files left behind
