"""A ShardedOptimizer nobody references any more is freed, with the process groups it made.

Its per-parameter post-accumulate-grad hooks live where Python's cyclic collector cannot see them; when they
held the optimizer strongly, an optimizer dropped by its user stayed alive for the life of the process, and
so did its private process groups with gloo's threads (a pooled test rank reached ~700 threads and the
machine a load average in the hundreds).
"""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist

from lowband.optim import ShardedOptimizer
from lowband.testing import run_ranks
from lowband.testing.multirank import gloo_threads


def _step_and_drop() -> tuple[bool, bool]:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = ShardedOptimizer(model.parameters(), lr=0.1, module=model)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.wait_for_params()
    opt_ref, comm_ref = weakref.ref(opt), weakref.ref(opt.comm)
    del opt
    gc.collect()
    # the model keeps its parameters (and their now inert hooks); a later backward does nothing sharded
    model(torch.randn(2, 8)).sum().backward()
    return opt_ref() is None, comm_ref() is None


def test_a_dropped_sharded_optimizer_is_collected() -> None:
    assert _step_and_drop() == (True, True)


def _gloo_threads_after_a_dropped_optimizer() -> int:
    _step_and_drop()
    gc.collect()
    assert dist.is_initialized()
    count = gloo_threads()
    assert count is not None, "needs /proc/self/task (Linux)"
    return count


def test_process_groups_of_dropped_optimizers_do_not_accumulate() -> None:
    """Four calls on the same pooled ranks: from the second on, the gloo threads alive at the end of a call never
    grow (before the fix they grew by the dropped optimizers' private groups: 9, 18, 24, ... per rank on a fresh
    pool). A pool that earlier tests used starts higher and may shrink as its leftovers are freed."""
    counts = [run_ranks(_gloo_threads_after_a_dropped_optimizer, 2)[0] for _ in range(4)]
    assert counts[1] >= counts[2] >= counts[3], counts


def _private_comm_threads() -> int:
    from lowband.comm import Comm

    Comm().private("sharded").all_reduce(torch.ones(2), "sum")  # a Comm <-> private Comm cycle, left behind
    count = gloo_threads()
    assert count is not None, "needs /proc/self/task (Linux)"
    return count


def test_pooled_ranks_free_groups_left_in_cycles() -> None:
    """Groups left in collectable cycles are freed by the pool once a rank holds more than GLOO_THREAD_LIMIT
    gloo threads: over 30 calls (3 threads per group, two groups per call) the count stays bounded."""
    from lowband.testing.multirank import GLOO_THREAD_LIMIT

    counts = [run_ranks(_private_comm_threads, 2)[0] for _ in range(30)]
    assert max(counts) <= GLOO_THREAD_LIMIT + 6, counts
