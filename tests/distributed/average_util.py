"""The check shared by the tests of the replicas' average (lowband.diloco.average): segment by segment, what every
replica holds alike comes back bitwise, the rest is the mean within the rounding of an fp32 sum."""

from __future__ import annotations

import torch

from lowband.diloco.average import segment_length


def check_average(averaged: dict[str, torch.Tensor], lives: list[dict[str, torch.Tensor]]) -> int:
    """Assert ``averaged`` (a state dict) against the replicas' own state dicts ``lives``, cut into the average's
    segments; return the elements in segments where the replicas differ. Integer tensors: replica 0's.

    Bound for a differing element of N fp32 values: N - 1 rounded additions in any order (each off by at most u
    times its running sum, at most u sum |x_r|) and the rounded division by N (u |mean|): the mean is off by at
    most (N - 1) u sum |x_r| / N + u sum |x_r| / N = u sum |x_r|; 1 % more for the terms in u^2."""
    n = len(lives)
    u = torch.finfo(torch.float32).eps / 2
    differ_elems = 0
    for k, v in averaged.items():
        if not v.is_floating_point():
            assert torch.equal(v, lives[0][k]), k
            continue
        flats = [live[k].reshape(-1) for live in lives]
        mean = sum(f.double() for f in flats) / n
        bound = 1.01 * u * sum(f.double().abs() for f in flats)
        seg = segment_length(v)
        for lo in range(0, v.numel(), seg):
            part = [f[lo:lo + seg] for f in flats]
            got = v.reshape(-1)[lo:lo + seg]
            if all(torch.equal(p, part[0]) for p in part):
                assert torch.equal(got, part[0]), (k, lo)  # bitwise
            else:
                differ_elems += got.numel()
                assert bool(((got.double() - mean[lo:lo + seg]).abs() <= bound[lo:lo + seg]).all()), (k, lo)
    return differ_elems
