"""AdamW update math on one device: a functional kernel shared by every distributor.

The kernel never communicates. It reproduces ``torch.optim.AdamW``'s single-tensor path
(``foreach=False``, ``capturable=False``, no amsgrad) operation for operation, so a flat shard updated
by it equals the same elements of a full tensor updated by torch:

1. ``param *= 1 - lr * weight_decay`` (decoupled weight decay; scaled by ``lr`` so ``lr = 0`` is a
   no-op on the parameter),
2. ``exp_avg.lerp_(grad, 1 - beta1)``; ``exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad**2``,
3. ``param -= lr / (1 - beta1**t) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2**t) + eps)``.

Because every operation is elementwise, the kernel can run on any slice of a parameter (or on a flat
concatenation of several) and give the same numbers as on the whole tensor.
"""

from __future__ import annotations

import math

import torch


def validate_adamw_hparams(lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                           where: str = "AdamW") -> None:
    """Raise ``ValueError`` naming the field if an AdamW hyperparameter is out of range."""
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
        raise ValueError(f"{where}: Invalid learning rate lr={lr!r}; expected a finite float >= 0")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"{where}: Invalid betas={betas!r}; expected a pair (beta1, beta2)")
    for i, b in enumerate(betas):
        if not (isinstance(b, (int, float)) and 0.0 <= b < 1.0):
            raise ValueError(f"{where}: Invalid beta parameter at index {i}: {b!r}; expected 0 <= beta < 1")
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"{where}: Invalid epsilon value eps={eps!r}; expected a float >= 0")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
        raise ValueError(f"{where}: Invalid weight_decay={weight_decay!r}; expected a float >= 0")


@torch.no_grad()
def adamw_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                  exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
                  eps: float, weight_decay: float) -> None:
    """Apply one AdamW step in place to ``param``, ``exp_avg`` and ``exp_avg_sq``.

    Args:
        param: parameter values (any shape; updated in place).
        grad: gradient, same shape (not modified).
        exp_avg: first moment, same shape and dtype as ``param`` (updated in place).
        exp_avg_sq: second moment, same shape and dtype as ``param`` (updated in place).
        step: the step number *after* incrementing (1 for the first step).
        lr, beta1, beta2, eps, weight_decay: as in ``torch.optim.AdamW``.
    """
    if step < 1:
        raise ValueError(f"adamw_update_: step must be >= 1 (got {step})")
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    t = float(step)
    bias_correction1 = 1 - beta1**t
    bias_correction2 = 1 - beta2**t
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
