"""Column/row-parallel linear layers equal the dense layers, forward and backward, on 1, 2, 4 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowband.comm import Comm, CommLedger
from lowband.parallel import ColumnParallelLinear, RowParallelLinear
from lowband.parallel.tensor import CHECK_ELEMS
from lowband.sharding import placement_of
from lowband.testing import run_ranks


def _mlp_matches_dense(dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    rank, n = dist.get_rank(), dist.get_world_size()
    ledger = CommLedger()
    comm = Comm(name="tp", ledger=ledger)
    torch.manual_seed(5)  # same dense layers and input on every rank
    fc1 = nn.Linear(6, 8, dtype=dtype)
    fc2 = nn.Linear(8, 6, dtype=dtype)
    x = torch.randn(3, 5, 6, dtype=dtype)
    col = ColumnParallelLinear.from_dense(fc1, comm)
    row = RowParallelLinear.from_dense(fc2, comm)
    cw, cb, rw = (placement_of(p) for p in (col.weight, col.bias, row.weight))
    assert (cw.split("tp").dim, cb.split("tp").dim, rw.split("tp").dim) == (0, 0, 1)
    assert placement_of(row.bias) is None  # replicated
    assert [s.rank for s in (cw.split("tp"), rw.split("tp"))] == [rank, rank]
    # the TP layers share one private Comm derived from comm (Comm.private)
    tp = cw.split("tp").group
    assert tp is rw.split("tp").group
    assert (tp.parent or tp) is comm and tp.name == comm.name
    assert col.weight.shape == (8 // n, 6) and row.weight.shape == (6, 8 // n)
    assert cw.shape == (8, 6) and rw.shape == (6, 8) and cb.shape == (8,)
    assert cw.local_shape() == tuple(col.weight.shape) and rw.local_shape() == tuple(row.weight.shape)

    xd = x.clone().requires_grad_(True)
    yd = fc2(torch.tanh(fc1(xd)))
    (yd * torch.arange(6, dtype=dtype)).sum().backward()

    xt = x.clone().requires_grad_(True)
    ledger.reset()
    yt = row(torch.tanh(col(xt)))
    assert ledger.count("all_reduce", tag="tp:row_y") == (1 if n > 1 else 0)
    (yt * torch.arange(6, dtype=dtype)).sum().backward()
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(yt, yd, **tol)
    torch.testing.assert_close(xt.grad, xd.grad, **tol)
    torch.testing.assert_close(col.weight.grad, fc1.weight.grad.chunk(n, 0)[rank], **tol)
    torch.testing.assert_close(col.bias.grad, fc1.bias.grad.chunk(n, 0)[rank], **tol)
    torch.testing.assert_close(row.weight.grad, fc2.weight.grad.chunk(n, 1)[rank], **tol)
    torch.testing.assert_close(row.bias.grad, fc2.bias.grad, **tol)
    if n > 1:
        esize = x.element_size()
        assert ledger.count() == 3
        assert ledger.count("all_reduce", tag="tp:col_dx") == 1
        # end of backward: one inf/NaN flag per TP slice (col weight and bias, row weight; lowband.parallel.tp_grads)
        assert [r.numel for r in ledger.select(op="all_reduce", tag="tp:nonfinite")] == [3]
        # the activation plus the layer signature and the input digest (CHECK_ELEMS, the TP agreement checks)
        numel = 3 * 5 * 6 + CHECK_ELEMS
        assert ledger.wire_bytes("all_reduce", tag="tp:row_y") == 2 * (n - 1) * numel * esize // n
        assert ledger.wire_bytes("all_reduce", tag="tp:col_dx") == 2 * (n - 1) * numel * esize // n
    else:
        assert ledger.count() == 0

    # gather_output / replicated input variants
    col_g = ColumnParallelLinear.from_dense(fc1, comm, gather_output=True)
    row_s = RowParallelLinear.from_dense(fc2, comm, input_is_parallel=False)
    xg = x.clone().requires_grad_(True)
    ledger.reset()
    yg = row_s(torch.tanh(col_g(xg)))
    (yg * torch.arange(6, dtype=dtype)).sum().backward()
    torch.testing.assert_close(yg, yd, **tol)
    torch.testing.assert_close(xg.grad, xd.grad, **tol)
    torch.testing.assert_close(col_g.weight.grad, fc1.weight.grad.chunk(n, 0)[rank], **tol)
    torch.testing.assert_close(row_s.weight.grad, fc2.weight.grad.chunk(n, 1)[rank], **tol)
    if n > 1:
        # fwd: gather_y + row_y; bwd: row_dx (all-gather) + col_dx
        assert ledger.count("all_gather") == 2 and ledger.count("all_reduce") == 3
        # the flags cover every TP slice on this TP group: the first two layers' three and these three
        assert [r.numel for r in ledger.select(op="all_reduce", tag="tp:nonfinite")] == [6]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_tp_mlp_matches_dense(world: int, dtype_name: str) -> None:
    run_ranks(_mlp_matches_dense, world, dtype_name)


def _bad_layers() -> str:
    comm = Comm(name="tp")
    try:
        ColumnParallelLinear(4, 5, comm)
    except ValueError as e:
        msg = str(e)
    else:
        raise AssertionError("no error")
    try:
        RowParallelLinear(4, 5, None)
    except ValueError as e:
        msg2 = str(e)
    else:
        raise AssertionError("no error")
    return msg + " | " + msg2


def test_bad_layer_inputs() -> None:
    msgs = run_ranks(_bad_layers, 2)
    assert msgs[0] == msgs[1]
    assert "out_features=5 is not divisible by the TP group size 2" in msgs[0]
    assert "tp_comm is required" in msgs[0]
    with pytest.raises(TypeError, match=r"tp_comm must be a lowband\.comm\.Comm"):
        ColumnParallelLinear(4, 4, "tp")


def test_single_process_init_matches_nn_linear() -> None:
    torch.manual_seed(3)
    ref = nn.Linear(5, 4)
    torch.manual_seed(3)
    col = ColumnParallelLinear(5, 4)
    assert torch.equal(col.weight, ref.weight) and torch.equal(col.bias, ref.bias)
