"""The math of the DiLoCo outer step, kept apart from its distribution (no collective here).

For one fragment with global copy ``G`` (the last agreed weights) and local weights ``L``:

* pseudo-gradient ``g = G - L`` (so an outer SGD step with lr 1 moves ``G`` onto ``L``);
* outer step: ``G.grad = mean over replicas of g``; ``outer_optimizer.step()`` updates ``G``;
* merge: ``L = G_new + alpha (L - G_new)``, computed as torchft does: copy ``G_new`` into the weights,
  then ``lerp_`` toward the saved local weights with weight ``alpha`` (0 = pure global).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def default_outer_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """SGD, lr 0.7, momentum 0.9, Nesterov: the DiLoCo papers' and torchft's default (:func:`outer_sgd`'s)."""
    return outer_sgd()(params)


def check_outer_sgd(lr: float, momentum: float, *, names: Mapping[str, str] | None = None) -> None:
    """Raise ``ValueError`` unless the outer SGD's ``lr > 0`` and ``momentum >= 0``.

    Args:
        names: how the message calls ``lr`` and ``momentum`` (default ``"diloco outer lr"``,
            ``"diloco outer momentum"``); the trainer passes ``diloco.outer_lr`` / ``diloco.outer_momentum``.
    """
    nm = {"lr": "diloco outer lr", "momentum": "diloco outer momentum", **(names or {})}
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0:
        raise ValueError(f"{nm['lr']} must be > 0; got {lr!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, int | float) or not momentum >= 0:
        raise ValueError(f"{nm['momentum']} must be >= 0; got {momentum!r}")


def outer_sgd(lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True) -> OuterOptimizerFactory:
    """A factory ``params -> torch.optim.SGD`` for :class:`~lowband.diloco.StreamingDiLoCo`'s
    ``outer_optimizer``, its settings checked now (:func:`check_outer_sgd`); Nesterov only with momentum > 0
    (torch refuses Nesterov without momentum). Its defaults are :func:`default_outer_optimizer`."""
    check_outer_sgd(lr, momentum)

    def make(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)

    return make


def check_alpha(alpha: float, *, name: str = "diloco alpha") -> None:
    """Raise ``ValueError`` unless the merge weight ``alpha`` (:func:`merge_`) is a number in ``[0, 1]``;
    the message calls it ``name`` (the trainer: ``diloco.alpha``)."""
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"{name} must be in [0, 1]; got {alpha!r}")


def check_ef_decay(beta: float, *, name: str = "diloco ef_decay") -> None:
    """Raise ``ValueError`` unless the error-feedback decay ``beta`` is a number in ``(0, 1]``; the message
    calls it ``name`` (the trainer: ``diloco.ef_decay``)."""
    if isinstance(beta, bool) or not isinstance(beta, int | float) or not 0.0 < float(beta) <= 1.0:
        raise ValueError(f"{name} must be in (0, 1] (1 = plain error feedback); got {beta!r}")


@torch.no_grad()
def pseudo_gradient_into(flat: torch.Tensor, global_params: Sequence[torch.Tensor],
                         local_params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Write ``G - L`` for every parameter, concatenated in order, into the 1-D ``flat``.

    The difference is taken in ``flat``'s dtype on ``flat``'s device.
    """
    off = 0
    for g, p in zip(global_params, local_params, strict=True):
        k = p.numel()
        dst = flat[off:off + k].view(p.shape)
        dst.copy_(g)
        dst.sub_(p.detach().to(flat.dtype))
        off += k
    if off != flat.numel():
        raise ValueError(f"pseudo_gradient_into: flat has {flat.numel()} elements, parameters {off}")
    return flat


@torch.no_grad()
def outer_step(optimizer: torch.optim.Optimizer, global_params: Sequence[torch.Tensor],
               averaged: torch.Tensor) -> None:
    """Set each global copy's ``.grad`` from the 1-D ``averaged`` pseudo-gradient and step."""
    off = 0
    for g in global_params:
        k = g.numel()
        g.grad = averaged[off:off + k].view(g.shape).to(device=g.device, dtype=g.dtype).clone()
        off += k
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def merge_(local_params: Sequence[torch.Tensor], global_params: Sequence[torch.Tensor],
           alpha: float) -> None:
    """In place: ``L = G + alpha (L - G)`` (``copy_(G)`` then ``lerp_(L_saved, alpha)``)."""
    for p, g in zip(local_params, global_params, strict=True):
        if alpha == 0.0:
            p.copy_(g)
        else:
            saved = p.detach().clone()
            p.copy_(g)
            p.lerp_(saved, alpha)
