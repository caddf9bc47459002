"""Muon update math on one device: orthogonalization (Newton-Schulz quintic, Polar Express) and the
momentum / Nesterov / shape-scaled update, plus a single-device :class:`Muon` reference optimizer.

Nothing here communicates; the sharded distributor calls :func:`muon_update_` on the matrices a rank
owns, stacked as a ``[k, rows, cols]`` batch.

Update for a matrix ``W`` (``rows x cols``) with gradient ``G``:

1. ``M = momentum * M + (1 - momentum) * G`` (``M.lerp_(G, 1 - momentum)``),
2. ``U = G.lerp(M, momentum)`` with Nesterov (``U = M`` without),
3. ``O = orthogonalize(U)``: approximately ``U V^T`` of the SVD, computed in ``ns_dtype`` (bf16 by
   default; float64 for exact tests),
4. ``W *= 1 - lr * weight_decay``; ``W -= lr * sqrt(max(1, rows / cols)) * O``.

The shape scale ``sqrt(max(1, rows/cols))`` is Keller Jordan's (modded-nanogpt record #15 onward): a
tall matrix (more output rows than input columns) gets a proportionally larger step so the RMS of
the update per element is comparable across shapes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

NS5_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
POLAR_EXPRESS_COEFFICIENTS: tuple[tuple[float, float, float], ...] = (
    (8.1566, -22.4833, 15.8788),
    (4.0429, -2.8089, 0.5000),
    (3.8917, -2.7725, 0.5061),
    (3.2858, -2.3681, 0.4645),
    (2.3465, -1.7098, 0.4232),
)
NS_METHODS = ("ns5", "polar_express")
NS_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def validate_muon_hparams(lr: float, momentum: float, nesterov: bool, weight_decay: float,
                          ns_method: str, ns_steps: int, ns_dtype: torch.dtype, where: str = "Muon") -> None:
    """Raise ``ValueError`` naming the field if a Muon hyperparameter is out of range."""
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
        raise ValueError(f"{where}: Invalid learning rate lr={lr!r}; expected a finite float >= 0")
    if not (isinstance(momentum, (int, float)) and 0.0 <= momentum < 1.0):
        raise ValueError(f"{where}: Invalid momentum={momentum!r}; expected 0 <= momentum < 1")
    if not isinstance(nesterov, bool):
        raise ValueError(f"{where}: Invalid nesterov={nesterov!r}; expected True or False")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
        raise ValueError(f"{where}: Invalid weight_decay={weight_decay!r}; expected a float >= 0")
    if ns_method not in NS_METHODS:
        raise ValueError(f"{where}: Invalid ns_method={ns_method!r}; allowed: {list(NS_METHODS)}")
    if not (isinstance(ns_steps, int) and not isinstance(ns_steps, bool) and ns_steps >= 1):
        raise ValueError(f"{where}: Invalid ns_steps={ns_steps!r}; expected an int >= 1")
    if ns_method == "polar_express" and ns_steps > len(POLAR_EXPRESS_COEFFICIENTS):
        raise ValueError(f"{where}: Invalid ns_steps={ns_steps!r} for ns_method='polar_express'; its schedule "
                         f"has {len(POLAR_EXPRESS_COEFFICIENTS)} iterations (use 1..5)")
    if ns_dtype not in NS_DTYPES:
        raise ValueError(f"{where}: Invalid ns_dtype={ns_dtype!r}; allowed: {[str(d) for d in NS_DTYPES]}")


def ns_coefficients(method: str, steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) of each iteration: NS5 repeats one triple; Polar Express uses the first ``steps``
    triples of its 5-iteration schedule."""
    if method == "ns5":
        return [NS5_COEFFICIENTS] * steps
    if method == "polar_express":
        if steps > len(POLAR_EXPRESS_COEFFICIENTS):
            raise ValueError(f"orthogonalize: polar_express has {len(POLAR_EXPRESS_COEFFICIENTS)} iterations; "
                             f"got steps={steps}")
        return list(POLAR_EXPRESS_COEFFICIENTS[:steps])
    raise ValueError(f"orthogonalize: Invalid ns_method={method!r}; allowed: {list(NS_METHODS)}")


def orthogonalize(g: torch.Tensor, *, method: str = "ns5", steps: int = 5,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximate the orthogonal polar factor of each matrix in ``g`` (``[..., rows, cols]``).

    The iteration ``A = X X^T; B = b A + c A A; X = a X + B X`` runs on the wide orientation (a tall
    matrix is transposed first and back at the end) in ``dtype``. NS5 normalizes by
    ``||X||_F + 1e-7``; Polar Express by ``1.02 ||X||_F + 1e-6``. Returns a tensor in ``dtype``.
    """
    if g.dim() < 2:
        raise ValueError("orthogonalize: expected a matrix or a batch of matrices, got shape "
                         f"{tuple(g.shape)}")
    coeffs = ns_coefficients(method, steps)
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    shape = x.shape
    x = x.reshape(-1, shape[-2], shape[-1])  # [k, rows, cols]; contiguous (a tall input's copy)
    norm = x.norm(dim=(-2, -1), keepdim=True)
    x = x / (norm + 1e-7) if method == "ns5" else x / (norm * 1.02 + 1e-6)
    fused = dtype in (torch.float32, torch.float64)  # fused multiply-adds, as torch.optim.Muon: 10-30%
    for a, b, c in coeffs:                          # faster on CPU; bf16/fp16 keep the separate roundings
        gram = torch.bmm(x, x.mT)
        if fused:
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
        else:
            poly = b * gram + c * (gram @ gram)
            x = a * x + poly @ x
    x = x.reshape(shape)
    if tall:
        x = x.mT
    return x


def muon_shape_scale(rows: int, cols: int) -> float:
    """``sqrt(max(1, rows / cols))``, the per-shape LR multiplier."""
    return max(1.0, rows / cols) ** 0.5


@torch.no_grad()
def muon_update_(param: torch.Tensor, grad: torch.Tensor, momentum_buf: torch.Tensor, *, lr: float,
                 momentum: float, nesterov: bool, weight_decay: float, ns_method: str = "ns5",
                 ns_steps: int = 5, ns_dtype: torch.dtype = torch.bfloat16) -> None:
    """One Muon step on a matrix or a ``[k, rows, cols]`` batch of same-shape matrices, in place.

    ``param`` and ``momentum_buf`` are updated in place; ``grad`` is not modified. The momentum and
    the final update run in the dtype of ``momentum_buf`` / ``param``; only the orthogonalization
    runs in ``ns_dtype``.
    """
    if param.dim() < 2:
        raise ValueError("muon_update_: Muon handles 2-D matrices; got a tensor of shape "
                         f"{tuple(param.shape)}")
    o = muon_direction_(grad, momentum_buf, momentum=momentum, nesterov=nesterov, ns_method=ns_method,
                        ns_steps=ns_steps, ns_dtype=ns_dtype)
    muon_apply_(param, o, lr=lr, weight_decay=weight_decay, scale=muon_shape_scale(param.size(-2), param.size(-1)))


@torch.no_grad()
def muon_direction_(grad: torch.Tensor, momentum_buf: torch.Tensor, *, momentum: float, nesterov: bool,
                    ns_method: str = "ns5", ns_steps: int = 5,
                    ns_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Steps 1-3 of the update on whole matrices: momentum (in place), Nesterov blend, orthogonalize.

    Returns ``O`` in ``ns_dtype``. Together with :func:`muon_apply_` this is exactly
    :func:`muon_update_`, split so that a distributor can orthogonalize whole matrices on one rank and
    apply the (elementwise) step 4 on row shards elsewhere.
    """
    g = grad.to(momentum_buf.dtype)
    momentum_buf.lerp_(g, 1 - momentum)
    u = g.lerp(momentum_buf, momentum) if nesterov else momentum_buf
    return orthogonalize(u, method=ns_method, steps=ns_steps, dtype=ns_dtype)


@torch.no_grad()
def muon_apply_(param: torch.Tensor, o: torch.Tensor, *, lr: float, weight_decay: float, scale: float) -> None:
    """Step 4, elementwise on any slice: ``param *= 1 - lr * wd``; ``param -= lr * scale * O``.

    ``scale`` is :func:`muon_shape_scale` of the whole (logical) matrix, not of the slice.
    """
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    param.add_(o.to(param.dtype), alpha=-lr * scale)


class Muon(torch.optim.Optimizer):
    """Single-device Muon for 2-D parameters (the reference for the sharded one).

    State per parameter: ``momentum_buffer`` (same shape and dtype as the parameter). Parameters
    without a gradient are skipped, as in ``torch.optim``. Hyperparameters are read from each
    ``param_group`` at step time, so LR schedulers work.

    Args:
        params: iterable of 2-D tensors or of param-group dicts.
        lr: learning rate (the shape scale multiplies it).
        momentum: momentum coefficient in [0, 1).
        nesterov: use the Nesterov blend ``G.lerp(M, momentum)``.
        weight_decay: decoupled weight decay, scaled by ``lr``.
        ns_method: ``"ns5"`` (quintic Newton-Schulz) or ``"polar_express"``.
        ns_steps: iterations of the orthogonalization.
        ns_dtype: dtype the orthogonalization runs in (bf16 default; float64 for exact tests).
    """

    def __init__(self, params: Iterable, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, ns_method: str = "ns5", ns_steps: int = 5,
                 ns_dtype: torch.dtype = torch.bfloat16) -> None:
        validate_muon_hparams(lr, momentum, nesterov, weight_decay, ns_method, ns_steps, ns_dtype)
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        ns_method=ns_method, ns_steps=ns_steps, ns_dtype=ns_dtype)
        super().__init__(params, defaults)
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"Muon: param_groups[{gi}] holds a tensor of shape {tuple(p.shape)}; "
                                     "Muon handles 2-D matrices only (give embeddings, heads and 1-D "
                                     "parameters to AdamW)")

    def whole_tensor_params(self) -> list[torch.Tensor]:
        """Every parameter: each is orthogonalized whole (a part of a sharded weight is refused at ``step()``,
        :func:`lowband.sharding.refuse_sharded_whole_tensor_updates`)."""
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                muon_update_(p, p.grad, state["momentum_buffer"], lr=group["lr"],
                             momentum=group["momentum"], nesterov=group["nesterov"],
                             weight_decay=group["weight_decay"], ns_method=group["ns_method"],
                             ns_steps=group["ns_steps"], ns_dtype=group["ns_dtype"])
        return loss
