"""Single-device optimizer math: AdamW kernel vs torch.optim.AdamW, orthogonalization, Muon, and the
bucket planner."""

from __future__ import annotations

import pytest
import torch

from lowband.optim import Muon, adamw_update_, muon_update_, orthogonalize
from lowband.optim.buckets import ParamSpec, matrix_cost, order_units, plan_adamw_buckets, plan_muon_units
from lowband.optim.muon import POLAR_EXPRESS_COEFFICIENTS, muon_shape_scale, ns_coefficients


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_kernel_equals_torch_adamw(dtype: torch.dtype, weight_decay: float) -> None:
    g = torch.Generator().manual_seed(0)
    p_ref = torch.nn.Parameter(torch.randn(7, 5, generator=g, dtype=dtype))
    opt = torch.optim.AdamW([p_ref], lr=3e-2, betas=(0.8, 0.95), eps=1e-8, weight_decay=weight_decay, foreach=False)
    p = p_ref.detach().clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    # the kernel on two flat slices separately (as two shards) == torch on the whole tensor
    flat_p, flat_m, flat_v = p.view(-1), m.view(-1), v.view(-1)
    for step in range(1, 7):
        grad = torch.randn(7, 5, generator=g, dtype=dtype)
        p_ref.grad = grad.clone()
        opt.step()
        for lo, hi in ((0, 13), (13, 35)):
            adamw_update_(flat_p[lo:hi], grad.view(-1)[lo:hi], flat_m[lo:hi], flat_v[lo:hi], step=step, lr=3e-2,
                          beta1=0.8, beta2=0.95, eps=1e-8, weight_decay=weight_decay)
    assert torch.equal(p, p_ref.detach())
    assert torch.equal(m, opt.state[p_ref]["exp_avg"])
    assert torch.equal(v, opt.state[p_ref]["exp_avg_sq"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [7, 16, 64])
def test_adamw_kernel_in_blocks_is_bitwise_torch_adamw(dtype: torch.dtype, block: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache-blocked path (a tensor larger than BLOCK_ELEMENTS, blocks ending at unaligned offsets and a short
    last block) gives torch's single-tensor AdamW bit for bit; a non-contiguous tensor takes the one-pass path."""
    from lowband.optim import adamw as adamw_mod

    monkeypatch.setattr(adamw_mod, "BLOCK_ELEMENTS", block)
    g = torch.Generator().manual_seed(3)
    p_ref = torch.nn.Parameter(torch.randn(13, 11, generator=g).to(dtype))
    opt = torch.optim.AdamW([p_ref], lr=3e-2, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    p = p_ref.detach().clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    pt = p_ref.detach().clone().t()  # non-contiguous: one pass over the view
    mt, vt = torch.zeros_like(p).t(), torch.zeros_like(p).t()
    assert not pt.is_contiguous() and not mt.is_contiguous()
    for step in range(1, 6):
        grad = torch.randn(13, 11, generator=g).to(dtype)
        p_ref.grad = grad.clone()
        opt.step()
        hp = dict(step=step, lr=3e-2, beta1=0.8, beta2=0.95, eps=1e-8, weight_decay=0.1)
        adamw_update_(p, grad, m, v, **hp)
        adamw_update_(pt, grad.t(), mt, vt, **hp)
    for ours in ((p, m, v), (pt.t(), mt.t(), vt.t())):
        assert torch.equal(ours[0], p_ref.detach())
        assert torch.equal(ours[1], opt.state[p_ref]["exp_avg"])
        assert torch.equal(ours[2], opt.state[p_ref]["exp_avg_sq"])


def test_adamw_kernel_blocks_keep_shape_checks() -> None:
    """A gradient of another shape with the same element count is refused as in one pass (never re-viewed)."""
    p = torch.zeros(600, 300)
    with pytest.raises(RuntimeError):
        adamw_update_(p, torch.ones(300, 600), torch.zeros_like(p), torch.zeros_like(p), step=1, lr=1e-3,
                      beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)


def test_adamw_kernel_rejects_step_zero() -> None:
    z = torch.zeros(3)
    with pytest.raises(ValueError, match="step"):
        adamw_update_(z, z, z.clone(), z.clone(), step=0, lr=1.0, beta1=0.9, beta2=0.9, eps=1e-8, weight_decay=0)


def _singular_values(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(x.double())


@pytest.mark.parametrize("shape", [(16, 8), (8, 16), (12, 12)])
def test_ns5_bf16_singular_values_in_band(shape: tuple[int, int]) -> None:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    o = orthogonalize(g, method="ns5", steps=5, dtype=torch.bfloat16)
    assert o.dtype == torch.bfloat16 and o.shape == g.shape
    s = _singular_values(o)
    assert s.min() > 0.5 and s.max() < 1.3, s  # NS5 is deliberately not fully converged


def test_polar_express_float64_close_to_polar_factor() -> None:
    g = torch.randn(10, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    o = orthogonalize(g, method="polar_express", steps=5, dtype=torch.float64)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    s = _singular_values(o)
    assert s.min() > 0.8 and s.max() < 1.2, s
    # closer to the exact polar factor U V^T than NS5 with the same number of iterations
    ns5 = orthogonalize(g, method="ns5", steps=5, dtype=torch.float64)
    assert (o - u @ vh).norm() < 0.7 * (ns5 - u @ vh).norm()
    assert ns_coefficients("polar_express", 5) == list(POLAR_EXPRESS_COEFFICIENTS)
    with pytest.raises(ValueError, match="polar_express"):
        ns_coefficients("polar_express", 6)
    with pytest.raises(ValueError, match="ns_steps"):
        Muon([torch.nn.Parameter(torch.zeros(3, 3))], ns_method="polar_express", ns_steps=6)


def test_orthogonalize_transpose_and_batch_consistency() -> None:
    g = torch.randn(3, 9, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    batched = orthogonalize(g, dtype=torch.float64)
    for i in range(3):
        single = orthogonalize(g[i], dtype=torch.float64)
        torch.testing.assert_close(batched[i], single, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(orthogonalize(g[i].T, dtype=torch.float64), single.T, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="matrix"):
        orthogonalize(torch.zeros(4))
    with pytest.raises(ValueError, match="ns_method"):
        orthogonalize(torch.zeros(2, 2), method="svd")


def test_muon_update_math_by_hand() -> None:
    """One step with momentum 0.5, Nesterov, weight decay, tall matrix: compare with the formula."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(6, 3, generator=g, dtype=torch.float64)
    grad = torch.randn(6, 3, generator=g, dtype=torch.float64)
    buf = torch.randn(6, 3, generator=g, dtype=torch.float64)
    w0, buf0 = w.clone(), buf.clone()
    muon_update_(w, grad, buf, lr=0.1, momentum=0.5, nesterov=True, weight_decay=0.2, ns_dtype=torch.float64)
    m = 0.5 * buf0 + 0.5 * grad
    u = 0.5 * grad + 0.5 * m
    expect = w0 * (1 - 0.1 * 0.2) - 0.1 * (6 / 3) ** 0.5 * orthogonalize(u, dtype=torch.float64)
    torch.testing.assert_close(buf, m, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(w, expect, rtol=1e-13, atol=1e-13)
    assert muon_shape_scale(3, 6) == 1.0 and muon_shape_scale(8, 2) == 2.0


def test_muon_optimizer_validation_and_lr0() -> None:
    with pytest.raises(ValueError, match="2-D"):
        Muon([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="ns_method"):
        Muon([torch.nn.Parameter(torch.zeros(3, 3))], ns_method="qr")
    with pytest.raises(ValueError, match="momentum"):
        Muon([torch.nn.Parameter(torch.zeros(3, 3))], momentum=1.0)
    p = torch.nn.Parameter(torch.randn(4, 3))
    before = p.detach().clone()
    opt = Muon([p], lr=0.0, weight_decay=0.5)
    p.grad = torch.zeros_like(p)
    opt.step(closure=None)
    assert torch.equal(p.detach(), before)


def _spec(i: int, shape: tuple, group: int = 0, dtype: torch.dtype = torch.float32) -> ParamSpec:
    return ParamSpec(i, group, shape, dtype, torch.device("cpu"))


def test_plan_adamw_buckets_cap_padding_order() -> None:
    specs = [_spec(0, (10,)), _spec(1, (3, 3)), _spec(2, (5,)), _spec(3, (100,)), _spec(4, (7,), group=1)]
    units = order_units(plan_adamw_buckets(specs, world_size=4, cap_bytes=64))
    # backward order: highest index first; one bucket per group; param 3 (400 B) alone over the cap;
    # params 2 + 1 (56 B) share one; adding param 0 would exceed 64 B
    assert [[m.index for m in u.members] for u in units] == [[4], [3], [2, 1], [0]]
    assert [u.numel for u in units] == [8, 100, 16, 12]
    assert all(u.numel % 4 == 0 and u.shard_numel * 4 == u.numel for u in units)
    assert [m.offset for m in units[2].members] == [0, 5]
    with pytest.raises(ValueError, match="positive"):
        plan_adamw_buckets(specs, 4, 0)


def test_plan_muon_units_padding_and_balance() -> None:
    # 3 matrices 8x8 and 1 matrix 4x8, N = 2: the 8x8 group pads one slot, the 4x8 group pads one slot
    specs = [_spec(0, (8, 8)), _spec(1, (8, 8)), _spec(2, (8, 8)), _spec(3, (4, 8))]
    units = plan_muon_units(specs, world_size=2, cap_bytes=1 << 20)
    small, big = units  # shape groups in backward order: index 3 first
    assert big.numel == 4 * 64 and big.slots_per_rank == 2
    assert small.numel == 2 * 32 and small.slots_per_rank == 1
    # 4x8: equal loads, the pad goes to the higher rank -> the matrix to rank 0; 8x8: rank 0 now has
    # the larger load, so it takes the pad and rank 1 gets two matrices
    assert small.real_per_rank == [1, 0] and big.real_per_rank == [1, 2]
    assert [m.offset // 64 for m in big.members] == [0, 2, 3]  # rank 0 slot 0; rank 1 slots 2, 3
    loads = [matrix_cost(4, 8) + matrix_cost(8, 8), 2 * matrix_cost(8, 8)]
    assert abs(loads[0] - loads[1]) <= matrix_cost(8, 8)
    # a cap below 2 matrices splits the 3 matrices into units of 2 (a multiple of N)
    split = plan_muon_units(specs[:3], world_size=2, cap_bytes=300)
    assert [len(u.members) for u in split] == [2, 1] and all(u.numel == 2 * 64 for u in split)
    with pytest.raises(ValueError, match="2-D"):
        plan_muon_units([_spec(0, (2, 2, 2))], 2, 100)
