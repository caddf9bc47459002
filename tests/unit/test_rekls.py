"""REKLS (single device) against a direct float64 transcription of its update equations."""

from __future__ import annotations

import pytest
import torch

from lowband.optim.rekls import (
    REKLS,
    eigh_descending,
    kl_factor_update,
    shampoo_beta_hat,
)


def _grads(m: int, n: int, steps: int, seed: int = 0, dtype=torch.float64) -> list[torch.Tensor]:
    """Gradients with well-separated singular values (1..2) plus 10% noise."""
    g = torch.Generator().manual_seed(seed)
    q1, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    r = min(m, n)
    base = q1[:, :r] @ torch.diag(torch.linspace(1.0, 2.0, r, dtype=torch.float64)) @ q2[:, :r].T
    return [(base + 0.1 * torch.randn(m, n, generator=g, dtype=torch.float64)).to(dtype)
            for _ in range(steps)]


def _reference(w0: torch.Tensor, grads: list[torch.Tensor], lr: float, b1: float, b2: float, bs: float,
               eps: float, wd: float, first_step: str) -> torch.Tensor:
    """The update equations written out with explicit matrices (float64)."""
    w = w0.clone()
    m, n = w.shape
    eye_m, eye_n = torch.eye(m, dtype=w.dtype), torch.eye(n, dtype=w.dtype)
    L, R = torch.zeros(m, m, dtype=w.dtype), torch.zeros(n, n, dtype=w.dtype)
    ql, qr = eye_m.clone(), eye_n.clone()
    lam_l, lam_r = torch.zeros(m, dtype=w.dtype), torch.zeros(n, dtype=w.dtype)
    M, V = torch.zeros_like(w), torch.zeros_like(w)
    for k, G in enumerate(grads, start=1):
        bh = 1 - (1 - bs) / (1 - bs ** k)
        if first_step == "plain" and k == 1:
            CR, CL = eye_n / n, eye_m / m
        else:
            CR = qr @ torch.diag(1.0 / (n * torch.clamp(lam_r, min=eps))) @ qr.T
            CL = ql @ torch.diag(1.0 / (m * torch.clamp(lam_l, min=eps))) @ ql.T
        L = bh * L + (1 - bh) * (G @ CR @ G.T)
        R = bh * R + (1 - bh) * (G.T @ CL @ G)
        el, vl = torch.linalg.eigh(L)
        er, vr = torch.linalg.eigh(R)
        ql_new, lam_l = vl.flip(1), el.flip(0)
        qr_new, lam_r = vr.flip(1), er.flip(0)
        M = ql_new.T @ (ql @ M @ qr.T) @ qr_new
        ql, qr = ql_new, qr_new
        w = (1 - lr * wd) * w
        Gt = ql.T @ G @ qr
        M = b1 * M + (1 - b1) * Gt
        V = b2 * V + (1 - b2) * Gt * Gt
        U = ql @ ((M / (1 - b1 ** k)) / (torch.sqrt(V / (1 - b2 ** k)) + eps)) @ qr.T
        w = w - lr * U
    return w


# eps=1e-3: at step 1 the rotated gradient is (nearly) diagonal in the new basis, so U' = G~/(|G~|+eps)
# turns rounding noise (1e-16) into noise/eps; with eps=1e-8 that is ~1e-9 relative in any
# implementation (checked separately below at 1e-7). The parity rule on non-square shapes inflates
# the null space of a rank-deficient factor by 1/eps, another noise amplifier, tamed by eps=1e-3.
_CASES = [(fs, shape, 1e-3, 1e-10) for fs in ("plain", "parity") for shape in ((6, 6), (5, 8), (8, 5))]
_CASES += [("plain", shape, 1e-8, 1e-7) for shape in ((6, 6), (5, 8), (8, 5))]
_CASES += [("parity", (6, 6), 1e-8, 1e-7)]


@pytest.mark.parametrize("first_step, shape, eps, tol", _CASES)
def test_rekls_matches_float64_transcription(first_step: str, shape: tuple[int, int], eps: float,
                                             tol: float) -> None:
    m, n = shape
    grads = _grads(m, n, 5)
    w0 = torch.randn(m, n, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    hp = dict(lr=1e-2, b1=0.9, b2=0.95, bs=0.95, eps=eps, wd=0.1)
    p = torch.nn.Parameter(w0.clone())
    opt = REKLS([p], lr=hp["lr"], betas=(hp["b1"], hp["b2"]), shampoo_beta=hp["bs"], eps=hp["eps"],
                weight_decay=hp["wd"], first_step=first_step)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    ref = _reference(w0, grads, **hp, first_step=first_step)
    err = (p.detach() - ref).abs().max() / ref.abs().max()
    assert err < tol, err
    st = opt.state[p]
    assert st["step"] == 5 and st["exp_avg"].dtype == torch.float64
    # basis invariants: orthonormal, eigenvalues descending, factor reproduced
    for q, lam, f in ((st["Q_L"], st["lam_L"], st["L"]), (st["Q_R"], st["lam_R"], st["R"])):
        torch.testing.assert_close(q.T @ q, torch.eye(q.shape[0], dtype=q.dtype), rtol=0, atol=1e-12)
        assert torch.all(lam[:-1] >= lam[1:])
        torch.testing.assert_close(q @ torch.diag(lam) @ q.T, f, rtol=1e-10, atol=1e-10 * f.abs().max())


def test_first_step_factors() -> None:
    m, n = 4, 6
    G = _grads(m, n, 1)[0]
    for rule, scale in (("plain", 1.0), ("parity", 1e-8)):
        p = torch.nn.Parameter(torch.zeros(m, n, dtype=torch.float64))
        opt = REKLS([p], lr=0.1, first_step=rule, weight_decay=0.0)
        p.grad = G.clone()
        opt.step()
        st = opt.state[p]
        torch.testing.assert_close(st["L"], G @ G.T / (n * scale), rtol=1e-13, atol=0)
        torch.testing.assert_close(st["R"], G.T @ G / (m * scale), rtol=1e-13, atol=0)
        # Adam step 1: U' = G~ / (|G~| + eps); the new bases are G's singular vectors, so G~ is
        # diagonal and |U'| = 1 on the diagonal
        u_rot = st["Q_L"].T @ (-p.detach() / 0.1) @ st["Q_R"]
        g_rot = st["Q_L"].T @ G @ st["Q_R"]
        torch.testing.assert_close(u_rot, g_rot / (g_rot.abs() + 1e-8), rtol=0, atol=1e-12)
        torch.testing.assert_close(torch.diagonal(u_rot).abs(), torch.ones(m, dtype=torch.float64))
    assert shampoo_beta_hat(0.95, 1) == 0.0
    assert abs(shampoo_beta_hat(0.95, 2) - 0.95 / 1.95) < 1e-15


def test_kl_factor_update_formula() -> None:
    g = torch.Generator().manual_seed(3)
    G = torch.randn(5, 7, generator=g, dtype=torch.float64)
    A = torch.randn(7, 7, generator=g, dtype=torch.float64)
    K = A @ A.T
    q, lam = eigh_descending(K)
    L = torch.randn(5, 5, generator=g, dtype=torch.float64)
    L = L @ L.T
    got = kl_factor_update(L, G, q, lam, 0.4, 1e-8, plain_first=False)
    # The formula is checked with the eigenvalues it is given (lam), not re-derived as diag(q^T K q):
    # that re-derivation carries eigh's error, |d lam_i| ~ n eps ||K||, i.e. a relative error of
    # n eps cond(K) in 1/lam_i, which is the solver's conditioning, not this formula's arithmetic.
    scale = torch.clamp(lam, min=1e-8) ** -1 / 7
    corr = q @ torch.diag(scale) @ q.T
    want = 0.4 * L + 0.6 * G @ corr @ G.T
    # Both sides evaluate the same sums in different orders: G q diag(s) q^T G^T (inner dims 7, 7, 7)
    # against (G q) diag(s) (G q)^T, then a lerp. Higham's bound for a product of inner dim k is
    # gamma_k |A||B| (gamma_k = k eps / (1 - k eps)); chained over the three products and the lerp, each
    # side is within gamma_{3*7+4} of the magnitude below, elementwise, so their difference is within twice it.
    eps = torch.finfo(torch.float64).eps
    k = 3 * 7 + 4
    gamma = k * eps / (1 - k * eps)
    mag = 0.4 * L.abs() + 0.6 * G.abs() @ (q.abs() @ torch.diag(scale) @ q.abs().T) @ G.abs().T + L.abs()
    err = (got - want).abs()
    assert torch.all(err <= 2 * gamma * mag), float((err / mag).max())


def test_one_dim_and_large_params_use_adamw_bitwise() -> None:
    g = torch.Generator().manual_seed(1)
    shapes = [(7,), (3, 40)]  # 1-D, and 2-D with a side above max_precond_dim=32
    for dtype in (torch.float32, torch.float64):
        ps = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]
        qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        opt = REKLS(ps, lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05, max_precond_dim=32)
        ref = torch.optim.AdamW(qs, lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05, foreach=False)
        for _ in range(4):
            grads = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
            for p, q, gr in zip(ps, qs, grads):
                p.grad, q.grad = gr.clone(), gr.clone()
            opt.step()
            ref.step()
            for p, q in zip(ps, qs):
                assert torch.equal(p, q)


def test_lr_zero_changes_nothing_and_closure() -> None:
    p = torch.nn.Parameter(torch.randn(4, 3))
    w = p.detach().clone()
    opt = REKLS([p], lr=0.0, weight_decay=0.1)

    def closure() -> float:
        p.grad = torch.randn(4, 3)
        return 1.5

    for _ in range(3):
        assert opt.step(closure) == 1.5
    assert torch.equal(p.detach(), w)
    assert opt.state[p]["step"] == 3


def test_float32_state_and_bf16_param() -> None:
    p = torch.nn.Parameter(torch.randn(4, 6).to(torch.bfloat16))
    opt = REKLS([p], lr=1e-2)
    p.grad = torch.randn(4, 6).to(torch.bfloat16)
    opt.step()
    st = opt.state[p]
    assert st["L"].dtype == torch.float32 and p.dtype == torch.bfloat16
    assert torch.isfinite(p.float()).all()
    p64 = torch.nn.Parameter(torch.randn(4, 6))
    opt = REKLS([p64], lr=1e-2, state_dtype=torch.float64)
    p64.grad = torch.randn(4, 6)
    opt.step()
    assert opt.state[p64]["Q_L"].dtype == torch.float64 and p64.dtype == torch.float32


def test_eigh_float64_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.linalg.eigh

    def flaky(x: torch.Tensor):
        if x.dtype == torch.float32:
            raise torch.linalg.LinAlgError("forced failure")
        return real(x)

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    a = torch.randn(5, 5)
    f = a @ a.T
    q, lam = eigh_descending(f)
    assert q.dtype == torch.float32 and lam.dtype == torch.float32
    assert torch.all(lam[:-1] >= lam[1:])
    torch.testing.assert_close(q @ torch.diag(lam) @ q.T, f, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, exc, word", [
    (dict(lr=-1.0), ValueError, "lr"),
    (dict(lr="x"), TypeError, "lr"),
    (dict(lr=0.1, betas=(0.9, 1.0)), ValueError, "betas[1]"),
    (dict(lr=0.1, shampoo_beta=1.0), ValueError, "shampoo_beta"),
    (dict(lr=0.1, eps=0.0), ValueError, "eps"),
    (dict(lr=0.1, weight_decay=-0.1), ValueError, "weight_decay"),
    (dict(lr=0.1, first_step="kl"), ValueError, "first_step"),
    (dict(lr=0.1, max_precond_dim=0), ValueError, "max_precond_dim"),
    (dict(lr=0.1, state_dtype=torch.float16), ValueError, "state_dtype"),
])
def test_bad_hyperparameters(kwargs: dict, exc: type, word: str) -> None:
    with pytest.raises(exc, match=word.replace("[", r"\[").replace("]", r"\]")):
        REKLS([torch.nn.Parameter(torch.zeros(2, 2))], **kwargs)
    with pytest.raises(exc, match="param group 1"):
        opt = REKLS([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.1)
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, 2))], **kwargs})


def test_state_dict_roundtrip_keeps_state_dtype() -> None:
    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(4, 6, generator=g) for _ in range(5)]

    def make() -> tuple[REKLS, torch.nn.Parameter]:
        p = torch.nn.Parameter(torch.randn(4, 6, generator=torch.Generator().manual_seed(9)))
        return REKLS([p], lr=1e-2, state_dtype=torch.float64), p

    a, pa = make()
    for gr in grads:
        pa.grad = gr.clone()
        a.step()
    b, pb = make()
    for gr in grads[:3]:
        pb.grad = gr.clone()
        b.step()
    saved = b.state_dict()
    c, pc = make()
    with torch.no_grad():
        pc.copy_(pb)
    c.load_state_dict(saved)
    assert c.state[pc]["L"].dtype == torch.float64  # torch would have cast it to float32
    for gr in grads[3:]:
        pc.grad = gr.clone()
        c.step()
    assert torch.equal(pa, pc)


def test_a_refused_param_group_is_not_kept() -> None:
    """torch appends a group before REKLS validated it: a caller that caught the error stepped it anyway
    (lr -1: gradient ascent)."""
    from lowband.optim.rekls import REKLS

    p, q = torch.nn.Parameter(torch.ones(3, 3)), torch.nn.Parameter(torch.ones(2))
    opt = REKLS([p], lr=0.1)
    with pytest.raises(ValueError, match="lr must be >= 0"):
        opt.add_param_group({"params": [q], "lr": -1.0})
    assert len(opt.param_groups) == 1
    q.grad = torch.ones(2)
    opt.step()
    assert torch.equal(q.detach(), torch.ones(2))


def test_complex_parameters_are_refused() -> None:
    """Its AdamW path squared complex gradients as complex numbers (torch's AdamW works on view_as_real)."""
    from lowband.optim.rekls import REKLS

    with pytest.raises(TypeError, match=r"params\[0\] is complex"):
        REKLS([torch.nn.Parameter(torch.ones(5, dtype=torch.complex128))], lr=0.1)
