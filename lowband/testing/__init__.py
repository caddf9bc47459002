"""Helpers for testing distributed code on CPU: run a function on N gloo ranks."""

from lowband.testing.multirank import DistributedTestError, own_pools, run_ranks, shutdown_pools

__all__ = ["DistributedTestError", "own_pools", "run_ranks", "shutdown_pools"]
