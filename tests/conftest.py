"""Shared pytest set-up: torch's process-wide state is restored around every test, and pooled gloo ranks
are shut down when the session ends.

A test that calls ``torch.set_default_dtype``, ``torch.manual_seed``, ``torch.set_num_threads``,
``torch.use_deterministic_algorithms`` or ``torch.set_grad_enabled`` in the pytest process (a
single-process reference, say) must not change what a later test computes: the verdict of the suite
must not depend on the order its tests run in (issue 21, point 10).
"""

import random

import numpy as np
import pytest
import torch

from lowband.testing import shutdown_pools


@pytest.fixture(scope="session", autouse=True)
def _shutdown_rank_pools():
    yield
    shutdown_pools()


def torch_global_state() -> dict:
    """Torch's (and Python's / NumPy's) process-wide settings that a test may change."""
    return {
        "default_dtype": torch.get_default_dtype(),
        "num_threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "grad_enabled": torch.is_grad_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "matmul_precision": torch.get_float32_matmul_precision(),
    }


def restore_torch_global_state(state: dict) -> None:
    torch.set_default_dtype(state["default_dtype"])
    if torch.get_num_threads() != state["num_threads"]:
        torch.set_num_threads(state["num_threads"])
    torch.use_deterministic_algorithms(state["deterministic"], warn_only=state["deterministic_warn_only"])
    torch.set_grad_enabled(state["grad_enabled"])
    torch.backends.cudnn.deterministic = state["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = state["cudnn_benchmark"]
    torch.set_float32_matmul_precision(state["matmul_precision"])


@pytest.fixture(autouse=True)
def _restore_torch_global_state():
    """Every test starts from, and leaves behind, the same torch settings and RNG states."""
    state = torch_global_state()
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    py_rng, np_rng = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        restore_torch_global_state(state)
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(py_rng)
        np.random.set_state(np_rng)
