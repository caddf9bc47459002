"""Autoregressive sampling from a causal language model: greedy, temperature and top-k.

:func:`generate` extends a batch of token sequences one token at a time. Each step runs the model on
the last ``context_len`` tokens (the window it was trained on; lowband's GPT refuses longer inputs),
takes the logits of the last position in float32, and picks the next token:

* ``temperature == 0``: greedy, ``argmax`` (the lowest id among equal maxima);
* otherwise: the ``top_k`` largest logits (all of them when ``top_k`` is None), less their maximum,
  divided by the temperature in float64, softmax, one draw per row with ``torch.multinomial`` from
  ``generator`` (so a seeded generator makes the output reproducible on the same device and torch
  build). Subtracting the maximum first keeps every finite temperature > 0 well defined (1e-300 is
  greedy, 1e300 uniform; neither overflows into NaN probabilities). ``top_k = 1`` always draws the
  single kept candidate, which is the greedy token.

Logits holding NaN or inf (a model with non-finite weights, or one that overflows) raise
:class:`NonFiniteLogitsError` instead of decoding garbage (an argmax over NaNs is id 0).

``vocab_limit`` restricts the candidates to ids below it (the byte tokenizer decodes at most 320).
Any forward convention works: the model may return the logits, a tuple whose first element they are
(nanoGPT's ``(logits, loss)``), or an object with ``.logits`` (Hugging Face). No communication.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn


class NonFiniteLogitsError(ValueError):
    """The model's logits hold NaN or inf: there is no distribution to sample from."""


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    """Raise ``ValueError`` naming the argument if a sampling setting is out of range."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None (no limit) or an integer >= 1, got {top_k!r}")


def _logits(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(f"model(idx) must return logits, a tuple starting with them, or an object with .logits; "
                    f"got {type(out).__name__}")


def context_len_of(model: nn.Module) -> int | None:
    """The longest input ``model`` accepts, if it says (``config.seq_len`` / ``block_size`` /
    ``n_positions`` / ``max_position_embeddings``); None if it does not."""
    config = getattr(model, "config", None) or getattr(model, "cfg", None)
    for attr in ("seq_len", "block_size", "n_positions", "max_position_embeddings"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None,
               generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids ``(B, 1)`` from last-position logits ``(B, V)`` (see the module docstring)."""
    logits = logits.float()
    if not bool(torch.isfinite(logits).all()):
        bad = int((~torch.isfinite(logits)).sum())
        raise NonFiniteLogitsError(f"the model's logits hold {bad} NaN/inf value(s) of {logits.numel()}: its weights "
                                   "or its forward are not finite (a diverged run?); nothing to sample from")
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    k = logits.shape[-1] if top_k is None else min(top_k, logits.shape[-1])
    values, ids = torch.topk(logits, k, dim=-1)
    scaled = (values.double() - values.double().amax(dim=-1, keepdim=True)) / float(temperature)
    probs = torch.softmax(scaled, dim=-1)  # max entry exactly 0 before exp: never NaN for a temperature > 0
    choice = torch.multinomial(probs, 1, generator=generator)
    return ids.gather(-1, choice)


@torch.no_grad()
def generate(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None, *,
             context_len: int | None = None, vocab_limit: int | None = None) -> torch.Tensor:
    """``idx`` ``(B, T)`` extended by ``max_new_tokens`` sampled tokens: ``(B, T + max_new_tokens)``.

    Args:
        model: a causal LM (put in eval mode for the call, restored after).
        idx: int64 token ids ``(B, T)``, ``T >= 1``, on the model's device.
        max_new_tokens: tokens to append (>= 0).
        temperature: 0 = greedy; otherwise the softmax temperature (> 0).
        top_k: keep only the ``top_k`` most likely tokens (None = all; clipped to the vocabulary).
        generator: the ``torch.Generator`` draws come from (on the model's device); None = the global RNG.
        context_len: the model's window; None = :func:`context_len_of` (no cropping if it says none).
        vocab_limit: only ids below this are candidates (None = every logit).

    Raises:
        ValueError: a setting is out of range (:func:`check_sampling`), or ``idx`` is not ``(B, T >= 1)``;
            :class:`NonFiniteLogitsError` (a ``ValueError``) when the model's logits are NaN or inf.
    """
    for token in iter_tokens(model, idx, max_new_tokens, temperature, top_k, generator, context_len=context_len,
                             vocab_limit=vocab_limit):
        idx = torch.cat((idx, token), dim=1)
    return idx


@torch.no_grad()
def iter_tokens(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                top_k: int | None = None, generator: torch.Generator | None = None, *,
                context_len: int | None = None, vocab_limit: int | None = None) -> Iterator[torch.Tensor]:
    """The tokens :func:`generate` appends, one ``(B, 1)`` tensor per step as soon as it is drawn (for
    streaming; stop iterating to stop generating). Same arguments and errors as :func:`generate`, plus
    :class:`NonFiniteLogitsError` from the step whose logits are not finite."""
    check_sampling(max_new_tokens, temperature, top_k)
    if idx.dim() != 2 or idx.shape[1] < 1:
        raise ValueError(f"idx must have shape (B, T) with T >= 1, got {tuple(idx.shape)}")
    if vocab_limit is not None and vocab_limit < 1:
        raise ValueError(f"vocab_limit must be None or >= 1, got {vocab_limit}")
    window = context_len if context_len is not None else context_len_of(model)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            cond = idx if window is None else idx[:, -window:]
            logits = _logits(model(cond))[:, -1, :]
            if vocab_limit is not None:
                logits = logits[:, :vocab_limit]
            token = next_token(logits, temperature, top_k, generator).to(idx.dtype)
            idx = torch.cat((idx, token), dim=1)
            yield token
    finally:
        model.train(was_training)
