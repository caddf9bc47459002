"""Checkpoint state of a GTP model and its optimizer, GTP-size independent and ready for torch DCP.

:class:`GTPStateLayout` turns a GTP model (any model after :func:`~lowband.parallel.gtp.shard_linears`
/ :func:`~lowband.parallel.gtp.shard_embeddings`) and its elementwise optimizer (torch AdamW, SGD, ...)
into the state a single-process model has: every GTP shard and every optimizer state tensor of the
shard's shape is gathered to the logical, unpadded weight shape, under the parameter's own name.
The result is what ``get_state_dict(model, optimizer, flatten_optimizer_state_dict=True)`` returns
for the unsharded model::

    {"model": {<fqn>: tensor}, "optim": {"state.<fqn>.<key>": tensor | scalar,
                                         "param_groups.<fqn>.<hyper>": value}}

so it is the same on every rank (plain tensors: DCP writes one copy), loads at any GTP degree (each
rank slices its padded rows back out) and into ``single``/``ddp`` models, and theirs into GTP.

Plain ``state_dict()`` of a GTP module raises :class:`~lowband.parallel.gtp.GTPStateError` (it would
label one rank's shard as the whole weight), and so does torch's ``get_state_dict`` on the model:
checkpoints go through this class (``dcp.save(layout.state_dict(), ...)``; to load: ``sd =
layout.state_dict(); dcp.load(sd, ...); layout.load_state_dict(sd)``).

Optimizer state of a GTP parameter must be elementwise: tensors of the shard's shape are gathered,
0-d tensors and numbers (``step``) are kept; any other shape raises ``ValueError`` naming it (a
non-elementwise state cannot be resharded by rows).

Communication: :meth:`GTPStateLayout.state_dict` all-gathers each GTP weight and each of its
shard-shaped state tensors over the GTP group (tag ``"gtp:state"``; transiently every rank holds
them whole); :meth:`GTPStateLayout.load_state_dict` has none. Both must run on every rank.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from lowband.parallel.gtp import GTPWeight, is_gtp_param


def gather_logical(gw: GTPWeight, shard: torch.Tensor, *, tag: str = "gtp:state") -> torch.Tensor:
    """The whole, unpadded ``[out_features, in_features]`` tensor of which ``shard`` is this rank's padded
    row shard of ``gw`` (one all-gather over the weight's GTP group, on its state group with
    :attr:`~lowband.parallel.gtp.GTPOptions.state_timeout`, ``tag``; collective)."""
    out = torch.empty(gw.padded_out, gw.in_features, dtype=shard.dtype, device=shard.device)
    gw.runtime.state_gather(out, shard.detach().reshape(gw.shard_rows, gw.in_features).contiguous(),
                            f"{gw.name!r}", tag=tag)
    return out[: gw.out_features].clone()


def shard_of_logical(gw: GTPWeight, full: torch.Tensor, what: str) -> torch.Tensor:
    """This rank's padded row shard of the logical ``full`` (pad rows zero; no communication).

    Raises:
        ValueError: ``full`` is not ``[out_features, in_features]``; the message starts with ``what``.
    """
    if tuple(full.shape) != (gw.out_features, gw.in_features):
        raise ValueError(f"{what} has shape {tuple(full.shape)}, expected the logical "
                         f"({gw.out_features}, {gw.in_features})")
    shard = torch.zeros(gw.shard_rows, gw.in_features, dtype=full.dtype, device=full.device)
    lo = gw.runtime.rank * gw.shard_rows
    hi = min(lo + gw.shard_rows, gw.out_features)
    if hi > lo:
        shard[: hi - lo].copy_(full[lo:hi])
    return shard


class GTPStateLayout:
    """Logical (gathered) state of a GTP model and its optimizer (see the module docstring).

    Args:
        model: the GTP model (FQNs as ``named_parameters()`` prints them).
        optimizer: its optimizer (elementwise state), or ``None`` for the model alone.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model, self.optimizer = model, optimizer

    def _gtp(self) -> dict[str, GTPWeight]:
        return {n: p.gtp for n, p in self.model.named_parameters() if is_gtp_param(p)}

    @contextlib.contextmanager
    def _local(self) -> Any:
        with contextlib.ExitStack() as stack:
            for rt in {id(gw.runtime): gw.runtime for gw in self._gtp().values()}.values():
                stack.enter_context(rt.local_state())
            yield

    def _raw(self) -> tuple[dict[str, Any], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        with self._local():
            if self.optimizer is None:
                return get_model_state_dict(self.model, options=opts), {}
            return get_state_dict(self.model, self.optimizer, options=opts)

    def _state_keys(self, optim: dict[str, Any], fqn: str) -> list[str]:
        prefix = f"state.{fqn}."
        return [k for k in optim if k.startswith(prefix)]

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optim": ...}`` in logical shapes (collective; see the module docstring)."""
        model_sd, optim_sd = self._raw()
        for fqn, gw in self._gtp().items():
            model_sd[fqn] = gather_logical(gw, model_sd[fqn])
            for key in self._state_keys(optim_sd, fqn):
                v = optim_sd[key]
                if not isinstance(v, torch.Tensor) or v.dim() == 0:
                    continue
                if tuple(v.shape) != (gw.shard_rows, gw.in_features):
                    raise ValueError(f"GTPStateLayout: optimizer state {key} has shape {tuple(v.shape)}, not the "
                                     f"shard's ({gw.shard_rows}, {gw.in_features}); only elementwise optimizer "
                                     "state can be gathered and resharded by rows")
                optim_sd[key] = gather_logical(gw, v)
        return {"model": model_sd, "optim": optim_sd}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Slice every logical GTP tensor back into this rank's padded shard, then load (no collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        model_sd = dict(state["model"])
        optim_sd = dict(state.get("optim", {}))
        for fqn, gw in self._gtp().items():
            model_sd[fqn] = shard_of_logical(gw, model_sd[fqn], f"GTP checkpoint: model.{fqn}")
            for key in self._state_keys(optim_sd, fqn):
                v = optim_sd[key]
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    optim_sd[key] = shard_of_logical(gw, v, f"GTP checkpoint: optim.{key}")
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        with self._local():
            if self.optimizer is None:
                set_model_state_dict(self.model, model_sd, options=opts)
            else:
                set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                               options=opts)

    def param_shapes(self) -> dict[str, tuple[list[int], str]]:
        """Logical shape and dtype of every parameter by FQN (GTP shards reported unpadded and whole)."""
        gtp = self._gtp()
        return {n: ([gtp[n].out_features, gtp[n].in_features] if n in gtp else list(p.shape),
                    str(p.dtype).removeprefix("torch.")) for n, p in self.model.named_parameters()}
