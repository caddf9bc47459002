"""Fixtures shared by the distributed tests."""

from __future__ import annotations

import numpy as np
import pytest

from lowband.data import write_shard


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 20,000-token ``.bin`` shard of seeded random bytes (tokens < 256), for trainer runs."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("data") / "train.bin"
    write_shard(path, rng.integers(0, 256, size=20_000).astype(np.uint16))
    return str(path)
