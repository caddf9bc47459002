"""Shared pytest set-up: pooled gloo ranks are shut down when the session ends."""

import pytest

from lowband.testing import shutdown_pools


@pytest.fixture(scope="session", autouse=True)
def _shutdown_rank_pools():
    yield
    shutdown_pools()
