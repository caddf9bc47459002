"""``data.source = "text"`` on 2 and 4 gloo ranks: rank 0 builds the cache, one ``all_gather_object`` on the
metrics Comm (tag ``corpus``) gives every rank the same tokens or the same error (no rank left waiting)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowband.data import ByteTokenizer
from lowband.testing import run_ranks
from lowband.train.config import Config, ConfigError
from lowband.train.env import init_distributed
from lowband.train.trainer import load_token_arrays


def _text_cfg(path: str, world: int) -> Config:
    cfg = Config()
    cfg.run.world_size = world
    cfg.data.source, cfg.data.path, cfg.data.val_fraction = "text", path, 0.1
    return cfg


def _load(cfg: Config, cache_root: str) -> dict[str, Any]:
    """One rank: load the text tokens; what it got, or the error, and what crossed the wire."""
    old = os.environ.get("LOWBAND_CACHE_DIR")
    os.environ["LOWBAND_CACHE_DIR"] = cache_root
    try:
        env = init_distributed("cpu", 60)
        train_before = len(env.ledger.records)
        out: dict[str, Any] = {"rank": env.rank}
        try:
            train, val = load_token_arrays(cfg, env)
            out.update(train=np.array(train), val=np.array(val))
        except ConfigError as e:
            out["error"] = str(e)
        recs = env.metrics_comm.ledger.records
        out["metrics_ops"] = [(r.op, r.tag) for r in recs]
        out["training_records"] = len(env.ledger.records) - train_before
        return out
    finally:
        if old is None:
            os.environ.pop("LOWBAND_CACHE_DIR", None)
        else:
            os.environ["LOWBAND_CACHE_DIR"] = old


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_gets_the_single_process_tokens(tmp_path: Path, world: int) -> None:
    texts = {"a.txt": "first file: héllo\n" * 7, "b.txt": "second file ✓\n" * 5}
    for name, t in texts.items():
        (tmp_path / name).write_text(t, encoding="utf-8")
    stream = []
    for name in sorted(texts):
        stream += [ByteTokenizer.BOS, *texts[name].encode("utf-8")]
    n_val = round(0.1 * len(stream))
    cache = str(tmp_path / "cache")
    ref = run_ranks(_load, 1, _text_cfg(str(tmp_path / "*.txt"), 1), str(tmp_path / "cache-ref"))[0]
    out = run_ranks(_load, world, _text_cfg(str(tmp_path / "*.txt"), world), cache)
    np.testing.assert_array_equal(ref["train"], np.array(stream[:-n_val], dtype=np.uint16))
    np.testing.assert_array_equal(ref["val"], np.array(stream[-n_val:], dtype=np.uint16))
    assert ref["metrics_ops"] == []  # one rank: no collective at all
    for r in out:
        np.testing.assert_array_equal(r["train"], ref["train"])
        np.testing.assert_array_equal(r["val"], ref["val"])
        # exactly one object all-gather on the metrics Comm; nothing on the training ledger
        assert r["metrics_ops"] == [("all_gather_object", "corpus")]
        assert r["training_records"] == 0
    assert len(list((tmp_path / "cache").iterdir())) == 1  # built once, by rank 0


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_raises_rank0s_error(tmp_path: Path, world: int) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine so far \xc3(")  # 0xc3 starts a 2-byte sequence; '(' is no continuation byte
    out = run_ranks(_load, world, _text_cfg(str(bad), world), str(tmp_path / "cache"), timeout=90)
    expected = (f"data.path: {str(bad)!r} is not UTF-8 text: byte 0xc3 at byte offset 12 (invalid continuation "
                "byte); convert it to UTF-8 (e.g. iconv -t UTF-8)")
    assert [r["error"] for r in out] == [expected] * world
    assert all(r["metrics_ops"] == [("all_gather_object", "corpus")] for r in out)
