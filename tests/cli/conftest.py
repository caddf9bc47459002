"""Fixtures of the CLI tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.cli_util import TINY_TOML


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    """A temporary working folder holding ``tiny.toml``; runs go to ``<it>/runs/<name>``."""
    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    return tmp_path
