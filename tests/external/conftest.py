"""Fixtures for the external-model tests: a small token shard for trainer runs."""

from __future__ import annotations

import numpy as np
import pytest

from lowband.data import write_shard

VOCAB = 96
"""Vocabulary of the external test models (token ids of :func:`shard` are below it)."""


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 20,000-token ``.bin`` shard of seeded random ids below :data:`VOCAB`, for trainer runs."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("data") / "train.bin"
    write_shard(path, rng.integers(0, VOCAB, size=20_000).astype(np.uint16))
    return str(path)
