"""The loss of one forward pass, whatever the model's forward convention.

The trainer calls every model through :func:`lm_loss`; three conventions are common and covered:

* lowband's GPT: ``model(idx, targets)`` returns the mean next-token cross-entropy (a 0-d tensor);
* nanoGPT-style models: ``model(idx, targets)`` returns ``(logits, loss)``;
* Hugging Face ``transformers`` causal LMs: ``model(input_ids)`` returns an object with ``.logits``
  (they shift ``labels`` by one themselves, while lowband's loader already hands out ``targets`` =
  ``idx`` shifted by one, so they are called *without* labels and the loss is taken here).

``model.forward`` in the config picks one (:data:`CONVENTIONS`): ``targets`` calls ``model(idx, targets)``
and takes the loss from a tensor, the second element of a tuple/list, or a ``.loss`` attribute;
``logits`` calls ``model(idx)`` and takes :func:`next_token_loss` of a logits tensor, the first element
of a tuple/list, or a ``.logits`` attribute; ``auto`` is ``logits`` for a ``transformers`` model and
``targets`` otherwise. Anything else raises ``TypeError`` naming the convention and what came back.

No communication happens here; a wrapper (DDP, the TP input gather) is called like the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CONVENTIONS = ("auto", "targets", "logits")


def is_transformers_model(model: nn.Module) -> bool:
    """True for a Hugging Face ``transformers`` model (or a wrapper around one), without importing it."""
    inner = getattr(model, "module", model)  # DDP and similar wrappers
    return any(c.__module__.startswith("transformers.") for c in type(inner).__mro__)


def resolve_convention(model: nn.Module, convention: str) -> str:
    """``targets`` or ``logits`` for ``model``; ``ValueError`` for an unknown convention."""
    if convention not in CONVENTIONS:
        raise ValueError(f"model.forward must be one of {', '.join(CONVENTIONS)}; got {convention!r}")
    if convention == "auto":
        return "logits" if is_transformers_model(model) else "targets"
    return convention


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` ``(B, T, V)`` against ``targets`` ``(B, T)``, computed in at least fp32
    (bf16/fp16 logits are upcast; float64 stays float64)."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _pick(out: object, attr: str, index: int) -> object:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple | list):
        return out[index] if len(out) > index else None
    return getattr(out, attr, None)


def lm_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, convention: str) -> torch.Tensor:
    """The scalar training loss of ``model`` on ``(idx, targets)`` under ``convention`` (resolved).

    Args:
        model: the model, or the strategy's wrapper around it.
        idx: input token ids ``(B, T)``.
        targets: next-token ids ``(B, T)`` (``idx`` shifted by one).
        convention: ``targets`` or ``logits`` (see :func:`resolve_convention`).
    """
    from lowband.train.models import ModelContractError, type_phrase

    if convention == "targets":
        out = model(idx, targets)
        loss = _pick(out, "loss", 1)
        what = "the loss (a 0-d tensor), (logits, loss), or an object with .loss"
    elif convention == "logits":
        out = model(idx)
        logits = _pick(out, "logits", 0)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            got = type_phrase(out) if logits is None or logits is out else f"{type_phrase(out)} whose logits " \
                f"are a {type_phrase(logits)}"
            raise ModelContractError(f"model.forward = logits: model(idx) must return logits (B, T, vocab) or an "
                                     f"object with .logits; got {got}")
        return next_token_loss(logits, targets)
    else:
        raise ValueError(f"lm_loss: convention must be targets or logits (resolve 'auto' first); got {convention!r}")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = type_phrase(out) if loss is None or loss is out else f"{type_phrase(out)} whose loss is a " \
            f"{type_phrase(loss)}"
        raise ModelContractError(f"model.forward = targets: model(idx, targets) must return {what}; got {got}")
    return loss
