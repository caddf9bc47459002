"""The suite's verdict does not depend on test order (issue 21, point 10): tests/conftest.py restores
torch's process-wide state around every test. The first test changes every setting the way a careless
single-process reference would; the second (run after it in file order, and in any order that puts it
after) sees the defaults again."""

from __future__ import annotations

import torch


def torch_global_state() -> dict:
    return {"default_dtype": torch.get_default_dtype(), "num_threads": torch.get_num_threads(),
            "deterministic": torch.are_deterministic_algorithms_enabled(), "grad_enabled": torch.is_grad_enabled()}


BEFORE = torch_global_state()
FIRST_DRAW = None


def test_a_careless_test_changes_torch_global_state() -> None:
    global FIRST_DRAW
    torch.manual_seed(1234)
    FIRST_DRAW = torch.rand(3)
    torch.manual_seed(1234)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(max(1, BEFORE["num_threads"] + 1))
    torch.use_deterministic_algorithms(True)
    torch.set_grad_enabled(False)
    assert torch.get_default_dtype() == torch.float64


def test_the_next_test_sees_the_settings_of_before() -> None:
    assert torch_global_state() == BEFORE
    assert torch.zeros(1).dtype == torch.float32 and torch.is_grad_enabled()
    if FIRST_DRAW is not None:  # the seed the first test set does not leak: a fresh draw differs
        assert not torch.equal(torch.rand(3), FIRST_DRAW)
