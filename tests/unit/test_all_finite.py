"""``lowband.comm.all_finite``: exactly ``bool(torch.isfinite(t).all())``, through a sum where that is finite."""

from __future__ import annotations

import pytest
import torch

from lowband.comm import all_finite, finite_probe

BAD = (float("inf"), -float("inf"), float("nan"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_agrees_with_isfinite_on_every_case(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    big = torch.finfo(dtype).max
    cases = [torch.randn(10_001, generator=g).to(dtype), torch.zeros(7, dtype=dtype), torch.empty(0, dtype=dtype),
             torch.full((64,), big, dtype=dtype),  # every element finite, the sum overflows: still True
             torch.tensor([big, -big, big], dtype=dtype), torch.tensor([-0.0], dtype=dtype),
             torch.randn(3, 5, generator=g).to(dtype)]  # not flat
    for bad in BAD:
        for pos in (0, 5_000, 10_000):
            x = torch.randn(10_001, generator=g).to(dtype)
            x[pos] = bad
            cases.append(x)
        cases.append(torch.tensor([float("inf"), -float("inf")], dtype=dtype))  # the sum is NaN
        cases.append(torch.tensor([big, big, bad], dtype=dtype))  # overflow and a non-finite element
    for x in cases:
        expected = bool(torch.isfinite(x).all())
        assert all_finite(x) == expected, x
        probe = finite_probe(x)  # no host sync: a 0-dim tensor that is finite exactly when x is
        assert probe.dim() == 0 and bool(torch.isfinite(probe)) == expected, x
        assert probe.item() == 0 or not expected  # 0 or NaN: cannot overflow


def test_integer_and_bool_tensors_are_finite() -> None:
    assert all_finite(torch.arange(10)) and all_finite(torch.ones(3, dtype=torch.bool))
    assert all_finite(torch.tensor([2**62], dtype=torch.int64))
    assert float(finite_probe(torch.tensor([2**62], dtype=torch.int64))) == 0.0


def test_the_overflow_case_is_what_the_fallback_is_for() -> None:
    """A sum that overflows to inf while every element is finite: the cheap test alone would say False."""
    x = torch.full((4,), torch.finfo(torch.float32).max)
    assert not torch.isfinite(x.sum()) and all_finite(x)
