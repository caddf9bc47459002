"""REKLS: Realtime Eigen Kullback-Leibler SOAP, single device (the math, no collectives).

REKLS (NVIDIA Emerging-Optimizers, ``soap/rekls.py`` at the #175 merge) is Adam run in the
eigenbasis of two KL-Shampoo Kronecker factors, with the basis refreshed by a full ``eigh`` every
step *after* the current gradient has been folded into the factors. For a 2-D parameter
``W`` (m x n) with gradient ``G`` and ``k`` the 1-based step:

1. ``beta_hat = 1 - (1 - shampoo_beta) / (1 - shampoo_beta**k)`` (so ``beta_hat_1 = 0``).
2. KL factor update with the previous basis ``Q_L, Q_R`` and eigenvalues ``lam_L, lam_R``::

       C_R = Q_R diag(1 / (n max(lam_R, eps))) Q_R^T,   L <- beta_hat L + (1 - beta_hat) G C_R G^T
       C_L = Q_L diag(1 / (m max(lam_L, eps))) Q_L^T,   R <- beta_hat R + (1 - beta_hat) G^T C_L G

   First step (``Q = I``, ``lam = 0``): ``first_step="parity"`` keeps the reference's rule (the
   eigenvalues are clamped to eps, so ``L_1 = G G^T / (n eps)``, ``R_1 = G^T G / (m eps)``);
   ``first_step="plain"`` (default) uses ``L_1 = G G^T / n``, ``R_1 = G^T G / m`` (the KL-Shampoo
   reference seed), because the 1/eps inflation freezes the basis for hundreds of steps at unit
   gradient scale.
3. First moment rotated out with the old basis and in with the new one:
   ``M <- Q_L'^T (Q_L M Q_R^T) Q_R'`` where ``(Q', lam') = eigh(new factor)`` in descending order
   (``eigh`` retried in float64 if it fails). The second moment ``V`` is never rotated and, unlike
   the #175 merge, not permuted either (the #101 eigh path and upstream HEAD do the same; see
   docs/rekls.md).
4. Decoupled weight decay ``W <- (1 - lr wd) W`` (lr 0 changes nothing).
5. Adam in the new basis: ``G~ = Q_L'^T G Q_R'``, ``M <- b1 M + (1-b1) G~``,
   ``V <- b2 V + (1-b2) G~ * G~``, ``U' = (M / (1-b1^k)) / (sqrt(V / (1-b2^k)) + eps)``.
6. ``W <- W - lr Q_L' U' Q_R'^T``.

Eigenvalues used in step 2 are the ones ``eigh`` returned at the previous step (upstream HEAD, #240;
equal to the #175 merge's ``diag(Q^T L Q)`` in exact arithmetic, and immune to its TF32 hazard).

Parameters that are not 2-D, or have a side longer than ``max_precond_dim``, get AdamW with the same
betas, eps, lr and decoupled weight decay (bitwise equal to ``torch.optim.AdamW(foreach=False)``).

State per 2-D parameter (dtype = ``state_dtype``, default: the parameter's dtype, float32 for 16-bit
parameters): ``step`` (int), ``exp_avg`` M and ``exp_avg_sq`` V (m x n, in the rotated basis), ``L``
(m x m), ``R`` (n x n), ``Q_L`` (m x m), ``Q_R`` (n x n), ``lam_L`` (m), ``lam_R`` (n). AdamW
parameters: ``step``, ``exp_avg``, ``exp_avg_sq`` (in the parameter's dtype, as torch's AdamW).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

FIRST_STEP_RULES = ("plain", "parity")


# --------------------------------------------------------------------------------------- math
def shampoo_beta_hat(shampoo_beta: float, k: int) -> float:
    """Bias-corrected factor beta at 1-based step ``k``: ``1 - (1 - b) / (1 - b**k)``."""
    return 1.0 - (1.0 - shampoo_beta) / (1.0 - shampoo_beta ** k)


def kl_factor_update(factor: torch.Tensor, grad: torch.Tensor, q_other: torch.Tensor,
                     lam_other: torch.Tensor, beta_hat: float, eps: float,
                     plain_first: bool) -> torch.Tensor:
    """New KL-Shampoo factor for the side of ``grad``'s dim 0 (returns a new tensor).

    ``factor`` (d x d) is the pre-update factor, ``grad`` (d x e) the gradient oriented so its rows
    index this side (pass ``G`` for L and ``G.T`` for R), ``q_other``/``lam_other`` the other side's
    previous eigenbasis (e x e, columns) and eigenvalues (e). Returns
    ``beta_hat * factor + (1 - beta_hat) * grad C grad^T`` with
    ``C = q diag(1 / (e max(lam, eps))) q^T``, or ``C = I / e`` when ``plain_first``.
    """
    e = grad.shape[1]
    if plain_first:
        stat = (grad @ grad.T).div_(e)
    else:
        a = grad @ q_other
        scale = lam_other.clamp_min(eps).reciprocal_().div_(e)
        stat = (a * scale) @ a.T
    return factor.lerp(stat, 1.0 - beta_hat)


def eigh_descending(factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q, lam)`` of a symmetric matrix, eigenvalues descending; float64 retry if ``eigh`` fails."""
    try:
        lam, q = torch.linalg.eigh(factor)
    except RuntimeError:  # torch.linalg.LinAlgError is a RuntimeError
        lam, q = torch.linalg.eigh(factor.double())
        lam, q = lam.to(factor.dtype), q.to(factor.dtype)
    return q.flip(-1).contiguous(), lam.flip(-1)  # row-major, like every copy of it (same BLAS path)


def rotate_out(x: torch.Tensor, ql: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
    """``Q_L X Q_R^T``: from the eigenbasis back to the parameter's coordinates."""
    return (ql @ x) @ qr.T


def rotate_in(x: torch.Tensor, ql: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
    """``Q_L^T X Q_R``: from the parameter's coordinates into the eigenbasis."""
    return (ql.T @ x) @ qr


def rotate_first_moment(exp_avg: torch.Tensor, ql_old: torch.Tensor, qr_old: torch.Tensor,
                        ql_new: torch.Tensor, qr_new: torch.Tensor) -> torch.Tensor:
    """``Q_L'^T (Q_L M Q_R^T) Q_R'``: M rotated out with the old basis and in with the new one."""
    return rotate_in(rotate_out(exp_avg, ql_old, qr_old), ql_new, qr_new)


def adam_direction(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                   ql: torch.Tensor, qr: torch.Tensor, beta1: float, beta2: float, eps: float,
                   k: int) -> torch.Tensor:
    """Adam in the basis ``(ql, qr)``; updates M, V in place, returns ``Q_L U' Q_R^T`` (m x n)."""
    g_rot = rotate_in(grad, ql, qr)
    exp_avg.lerp_(g_rot, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g_rot, g_rot, value=1.0 - beta2)
    bc1 = 1.0 - beta1 ** k
    bc2 = 1.0 - beta2 ** k
    u = (exp_avg / bc1).div_((exp_avg_sq / bc2).sqrt_().add_(eps))
    return rotate_out(u, ql, qr)


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, state: dict, lr: float, beta1: float,
                beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW step in place, the same arithmetic as ``torch.optim.AdamW(foreach=False)``."""
    if not state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    state["step"] += 1
    k = state["step"]
    grad = grad.to(param.dtype)
    param.mul_(1 - lr * weight_decay)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** k
    bias_correction2 = 1 - beta2 ** k
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


# ---------------------------------------------------------------------------------- hyperparams
@dataclass(frozen=True)
class ReklsHyper:
    """The hyperparameters of one param group."""

    lr: float
    beta1: float
    beta2: float
    shampoo_beta: float
    eps: float
    weight_decay: float
    first_step: str
    max_precond_dim: int
    state_dtype: torch.dtype | None

    @staticmethod
    def from_group(group: dict) -> ReklsHyper:
        b1, b2 = group["betas"]
        return ReklsHyper(lr=group["lr"], beta1=b1, beta2=b2, shampoo_beta=group["shampoo_beta"],
                          eps=group["eps"], weight_decay=group["weight_decay"],
                          first_step=group["first_step"], max_precond_dim=group["max_precond_dim"],
                          state_dtype=group["state_dtype"])

    def dtype_for(self, param: torch.Tensor) -> torch.dtype:
        if self.state_dtype is not None:
            return self.state_dtype
        return param.dtype if param.dtype in (torch.float32, torch.float64) else torch.float32


def check_group(group: dict, where: str) -> None:
    """Validate one param group's hyperparameters; raise TypeError/ValueError naming the field."""
    def num(name: str) -> float:
        v = group[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{where}: {name} must be a number, got {type(v).__name__}")
        return float(v)

    if num("lr") < 0:
        raise ValueError(f"{where}: lr must be >= 0, got {group['lr']}")
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise TypeError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
            raise ValueError(f"{where}: betas[{i}] must be a number in [0, 1), got {b!r}")
    if not 0.0 <= num("shampoo_beta") < 1.0:
        raise ValueError(f"{where}: shampoo_beta must be in [0, 1), got {group['shampoo_beta']}")
    if num("eps") <= 0:
        raise ValueError(f"{where}: eps must be > 0, got {group['eps']}")
    if num("weight_decay") < 0:
        raise ValueError(f"{where}: weight_decay must be >= 0, got {group['weight_decay']}")
    if group["first_step"] not in FIRST_STEP_RULES:
        raise ValueError(f"{where}: first_step must be one of {FIRST_STEP_RULES}, got "
                         f"{group['first_step']!r}")
    mpd = group["max_precond_dim"]
    if isinstance(mpd, bool) or not isinstance(mpd, int) or mpd < 1:
        raise ValueError(f"{where}: max_precond_dim must be an int >= 1, got {mpd!r}")
    sd = group["state_dtype"]
    if sd is not None and sd not in (torch.float32, torch.float64):
        raise ValueError(f"{where}: state_dtype must be None, torch.float32 or torch.float64, got {sd!r}")


def uses_rekls(param: torch.Tensor, shape: tuple[int, ...], h: ReklsHyper) -> bool:
    """True if a parameter of (full) ``shape`` is preconditioned; False means AdamW."""
    return len(shape) == 2 and max(shape) <= h.max_precond_dim and param.is_floating_point()


# ------------------------------------------------------------------------------ per-param step
def init_rekls_state(state: dict, m: int, n: int, dtype: torch.dtype, device: torch.device,
                     exp_shape: tuple[int, int] | None = None) -> None:
    """Zero factors, identity bases, zero eigenvalues and moments (the full, unsharded layout)."""
    state["step"] = 0
    shape = exp_shape or (m, n)
    state["exp_avg"] = torch.zeros(shape, dtype=dtype, device=device)
    state["exp_avg_sq"] = torch.zeros(shape, dtype=dtype, device=device)
    state["L"] = torch.zeros(m, m, dtype=dtype, device=device)
    state["R"] = torch.zeros(n, n, dtype=dtype, device=device)
    state["Q_L"] = torch.eye(m, dtype=dtype, device=device)
    state["Q_R"] = torch.eye(n, dtype=dtype, device=device)
    state["lam_L"] = torch.zeros(m, dtype=dtype, device=device)
    state["lam_R"] = torch.zeros(n, dtype=dtype, device=device)


def new_factors(grad: torch.Tensor, L: torch.Tensor, R: torch.Tensor, ql: torch.Tensor,
                qr: torch.Tensor, lam_l: torch.Tensor, lam_r: torch.Tensor, h: ReklsHyper,
                k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both KL factor updates of step ``k`` (full matrices, previous basis)."""
    bh = shampoo_beta_hat(h.shampoo_beta, k)
    plain = h.first_step == "plain" and k == 1
    L_new = kl_factor_update(L, grad, qr, lam_r, bh, h.eps, plain)
    R_new = kl_factor_update(R, grad.T, ql, lam_l, bh, h.eps, plain)
    return L_new, R_new


def update_direction(state: dict, grad: torch.Tensor, ql_old: torch.Tensor, qr_old: torch.Tensor,
                     ql_new: torch.Tensor, qr_new: torch.Tensor, h: ReklsHyper, k: int) -> torch.Tensor:
    """Rotate M to the new basis, run Adam there, return the full update ``U`` (m x n).

    Mutates ``state["exp_avg"]`` and ``state["exp_avg_sq"]``. At ``k == 1`` M is zero and the
    rotation is skipped (exactly zero either way).
    """
    if k > 1:
        state["exp_avg"] = rotate_first_moment(state["exp_avg"], ql_old, qr_old, ql_new, qr_new)
    return adam_direction(state["exp_avg"], state["exp_avg_sq"], grad, ql_new, qr_new, h.beta1,
                          h.beta2, h.eps, k)


def apply_update_(param: torch.Tensor, update: torch.Tensor, h: ReklsHyper) -> None:
    """Decoupled weight decay then ``param -= lr * update``."""
    if h.weight_decay != 0:
        param.mul_(1 - h.lr * h.weight_decay)
    param.add_(update.to(param.dtype), alpha=-h.lr)


def rekls_step_(param: torch.Tensor, grad: torch.Tensor, state: dict, h: ReklsHyper) -> None:
    """One full REKLS step on a 2-D parameter (single device, all matrices full)."""
    m, n = param.shape
    dtype = h.dtype_for(param)
    if not state:
        init_rekls_state(state, m, n, dtype, param.device)
    k = state["step"] + 1
    g = grad.to(dtype).contiguous()
    L_new, R_new = new_factors(g, state["L"], state["R"], state["Q_L"], state["Q_R"], state["lam_L"],
                               state["lam_R"], h, k)
    ql_new, lam_l = eigh_descending(L_new)
    qr_new, lam_r = eigh_descending(R_new)
    u = update_direction(state, g, state["Q_L"], state["Q_R"], ql_new, qr_new, h, k)
    apply_update_(param, u, h)
    state.update(L=L_new, R=R_new, Q_L=ql_new, Q_R=qr_new, lam_L=lam_l, lam_R=lam_r, step=k)


# ------------------------------------------------------------------------------------ optimizer
class REKLS(torch.optim.Optimizer):
    """REKLS on one device (see the module docstring for the exact step).

    Args:
        params: parameters or param groups.
        lr: learning rate (>= 0).
        betas: inner Adam (beta1, beta2), default (0.9, 0.95).
        shampoo_beta: Kronecker-factor EMA beta (bias-corrected), default 0.95.
        eps: Adam epsilon and the lower clamp of the eigenvalues inverted in the KL update.
        weight_decay: decoupled weight decay (scaled by lr), default 0.01.
        first_step: ``"plain"`` (default: ``L_1 = G G^T / n``) or ``"parity"`` (the reference's
            ``L_1 = G G^T / (n eps)``).
        max_precond_dim: 2-D parameters with a side longer than this use AdamW (default 8192).
        state_dtype: dtype of the optimizer state; ``None`` follows the parameter (float32 for
            16-bit parameters). ``torch.float64`` is allowed (tests).

    Communication: none. State layout: see the module docstring.
    """

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 shampoo_beta: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.01, *,
                 first_step: str = "plain", max_precond_dim: int = 8192,
                 state_dtype: torch.dtype | None = None) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), shampoo_beta=shampoo_beta, eps=eps,
                        weight_decay=weight_decay, first_step=first_step,
                        max_precond_dim=max_precond_dim, state_dtype=state_dtype)
        check_group(defaults, type(self).__name__)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """As torch's, then validated; a refused group is not kept (torch appends before any check)."""
        super().add_param_group(param_group)
        where = f"{type(self).__name__} param group {len(self.param_groups) - 1}"
        try:
            check_group(self.param_groups[-1], where)
            for i, p in enumerate(self.param_groups[-1]["params"]):
                if p.is_complex():
                    raise TypeError(f"{where}: params[{i}] is complex ({p.dtype}); REKLS and its AdamW path take "
                                    "real parameters (torch.view_as_real(p) as a real parameter works)")
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but state tensors keep their saved dtype (torch casts them to the parameter's
        dtype, which would round float32/float64 factors of 16-bit or float32 parameters)."""
        super().load_state_dict(state_dict)
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        by_id = dict(zip(saved_ids, params))
        for pid, saved in state_dict["state"].items():
            p = by_id.get(pid)
            if p is None:
                continue
            st = self.state[p]
            for k, v in saved.items():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and st[k].dtype != v.dtype:
                    st[k] = v.to(device=p.device, copy=True)

    def whole_tensor_params(self) -> list[torch.Tensor]:
        """The parameters it preconditions (2-D, no side longer than their group's ``max_precond_dim``; the rest
        get elementwise AdamW): their Kronecker factors are statistics of the whole matrix (a part of a sharded
        weight is refused at ``step()``, :func:`lowband.sharding.refuse_sharded_whole_tensor_updates`)."""
        return [p for g in self.param_groups for p in g["params"]
                if p.dim() == 2 and max(p.shape) <= g["max_precond_dim"]]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            h = ReklsHyper.from_group(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError("REKLS does not support sparse gradients")
                state = self.state[p]
                if uses_rekls(p, tuple(p.shape), h):
                    rekls_step_(p, p.grad, state, h)
                else:
                    adamw_step_(p, p.grad, state, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay)
        return loss
