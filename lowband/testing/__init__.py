"""Helpers for testing distributed code on CPU: run a function on N gloo ranks."""

from lowband.testing.multirank import DistributedTestError, DistributedTimeout, own_pools, run_ranks, shutdown_pools

__all__ = ["DistributedTestError", "DistributedTimeout", "own_pools", "run_ranks", "shutdown_pools"]
