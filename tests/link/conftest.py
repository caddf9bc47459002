"""Shared set-up of the link-suite tests: they need root (network namespaces, tc qdiscs)."""

from __future__ import annotations

import pytest

from lowband.bench.netns import privilege_problem

_PROBLEM = privilege_problem()

needs_netns = pytest.mark.skipif(_PROBLEM is not None, reason=f"link tests need network namespaces: {_PROBLEM}")
"""Marks a test that creates namespaces; skipped, with the reason, when this process may not."""
