"""Checkpoint state of a GTP model and its optimizer, GTP-size independent and ready for torch DCP.

:class:`GTPStateLayout` turns a GTP model (any model after :func:`~lowband.parallel.gtp.shard_linears`
/ :func:`~lowband.parallel.gtp.shard_embeddings`) and its elementwise optimizer (torch AdamW, SGD, ...)
into the keys and **logical** shapes a single-process model has: every GTP weight and every optimizer
state tensor of the shard's shape is described as the logical, unpadded ``[out_features,
in_features]`` tensor, under the parameter's own name. The keys are what ``get_state_dict(model,
optimizer, flatten_optimizer_state_dict=True)`` returns for the unsharded model::

    {"model": {<fqn>: tensor}, "optim": {"state.<fqn>.<key>": tensor | scalar,
                                         "param_groups.<fqn>.<hyper>": value}}

:meth:`GTPStateLayout.state_dict` (what checkpoints save) gives each GTP tensor as a
:class:`lowband.dcp_chunks.LocalChunks` of the logical shape holding this rank's **real rows only**:
``shard[:real_rows]`` at row offset ``rank * shard_rows``, ``real_rows = clamp(out_features - rank *
shard_rows, 0, shard_rows)`` (a view into the live shard, cut into chunks of at most 16 MiB on a row
grid fixed in the weight's coordinates; a rank whose rows are all padding holds no piece, and padding
rows are never written). Data-parallel copies of a shard write the same chunks (DCP writes them once).
Non-GTP parameters, their state and scalars are the plain tensors torch's ``get_state_dict`` gives.
So ``dcp.save`` writes what each rank owns, and ``dcp.load`` into a fresh :meth:`state_dict` reads only
the saved chunks overlapping this rank's real rows, at any GTP degree; the file is the same as that of
``single``/``ddp`` (one logical tensor per key), so each loads the other's.

:meth:`GTPStateLayout.logical_state_dict` is the gathered form: the same keys with every GTP tensor
all-gathered to the whole logical tensor (the same on every rank); for inspection and tests (DiLoCo's
checkpoint uses the rank-local form). :meth:`GTPStateLayout.load_state_dict` takes either (and files of the earlier
gathered format, which are plain logical tensors under the same keys): it copies this rank's real rows
into its padded shard, padding rows zero.

Plain ``state_dict()`` of a GTP module raises :class:`~lowband.parallel.gtp.GTPStateError` (it would
label one rank's shard as the whole weight), and so does torch's ``get_state_dict`` on the model:
checkpoints go through this class (``dcp.save(layout.state_dict(), ...)``; to load: ``sd =
layout.state_dict(); dcp.load(sd, ...); layout.load_state_dict(sd)``).

Optimizer state of a GTP parameter must be elementwise: tensors of the shard's shape are saved by rows,
0-d tensors and numbers (``step``) are kept; any other shape raises ``ValueError`` naming it (a
non-elementwise state cannot be resharded by rows).

Communication: :meth:`GTPStateLayout.state_dict` and :meth:`GTPStateLayout.load_state_dict` issue none
(DCP's own planning collectives only: metadata, no tensor data); :meth:`GTPStateLayout.logical_state_dict`
all-gathers each GTP weight and each of its shard-shaped state tensors over the GTP group (tag
``"gtp:state"``; transiently every rank holds them whole) and must run on every rank.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from lowband.dcp_chunks import LocalChunks
from lowband.parallel.gtp import GTPWeight, is_gtp_param
from lowband.sharding import Placement, from_state, placement_of, to_state


def gather_logical(gw: GTPWeight, shard: torch.Tensor, *, tag: str = "gtp:state") -> torch.Tensor:
    """The whole, unpadded ``[out_features, in_features]`` tensor of which ``shard`` is this rank's padded
    row shard of ``gw`` (one all-gather over the weight's GTP group, on its state group with
    :attr:`~lowband.parallel.gtp.GTPOptions.state_timeout`, ``tag``; collective)."""
    out = torch.empty(gw.padded_out, gw.in_features, dtype=shard.dtype, device=shard.device)
    gw.runtime.state_gather(out, shard.detach().reshape(gw.shard_rows, gw.in_features).contiguous(),
                            f"{gw.name!r}", tag=tag)
    return out[: gw.out_features].clone()


def _placement(gw: GTPWeight) -> Placement:
    pl = placement_of(gw.param)
    assert pl is not None, f"GTP weight {gw.name!r} has no placement"
    return pl


def local_rows(gw: GTPWeight, shard: torch.Tensor) -> LocalChunks:
    """``shard`` (this rank's padded row shard of ``gw``, or a tensor of its shape) as the
    :class:`~lowband.dcp_chunks.LocalChunks` of the logical shape holding its real rows, views of ``shard``
    (:func:`lowband.sharding.to_state` of the weight's placement; no communication)."""
    return to_state(_placement(gw), shard, what=f"GTP weight {gw.name!r}")


def shard_of_saved(gw: GTPWeight, saved: torch.Tensor, what: str) -> torch.Tensor:
    """This rank's padded row shard (pad rows zero) of ``saved``: a :class:`~lowband.dcp_chunks.LocalChunks`
    holding exactly its real rows, or a whole logical tensor (:func:`lowband.sharding.from_state` of the
    weight's placement; no communication). ``ValueError`` starting with ``what`` otherwise."""
    return from_state(_placement(gw), saved, what=what)


class GTPStateLayout:
    """State of a GTP model and its optimizer in logical shapes: rank-local rows (:meth:`state_dict`) or
    gathered (:meth:`logical_state_dict`); see the module docstring.

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

    def _check_state(self, gw: GTPWeight, key: str, v: torch.Tensor) -> None:
        if tuple(v.shape) != (gw.shard_rows, gw.in_features):
            raise ValueError(f"GTPStateLayout: optimizer state {key} has shape {tuple(v.shape)}, not the "
                             f"shard's ({gw.shard_rows}, {gw.in_features}); only elementwise optimizer "
                             "state can be saved and resharded by rows")

    def _convert(self, fn: Any, *, copy_scalars: bool = False) -> dict[str, Any]:
        model_sd, optim_sd = self._raw()
        for fqn, gw in self._gtp().items():
            model_sd[fqn] = fn(gw, model_sd[fqn])
            for key in self._state_keys(optim_sd, fqn):
                v = optim_sd[key]
                if not isinstance(v, torch.Tensor):
                    continue
                if v.dim() == 0:
                    if copy_scalars:  # the live one carries this rank's GTP stamp (gtp._check_optimizer_state)
                        optim_sd[key] = v.clone()
                    continue
                self._check_state(gw, key, v)
                optim_sd[key] = fn(gw, v)
        return {"model": model_sd, "optim": optim_sd}

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optim": ...}`` with every GTP tensor this rank's real rows as
        :class:`~lowband.dcp_chunks.LocalChunks` of the logical shape, views into the live shards and
        optimizer state (no communication; see the module docstring)."""
        return self._convert(local_rows)

    def logical_state_dict(self) -> dict[str, Any]:
        """The keys of :meth:`state_dict` with every GTP tensor all-gathered to the whole logical tensor, a
        copy (collective: one all-gather per GTP tensor over its GTP group, tag ``"gtp:state"``; every rank
        holds them whole, and nothing in it is this rank's: any rank of the group may save it for all). For
        inspection and tests; :meth:`load_state_dict` takes it."""
        return self._convert(gather_logical, copy_scalars=True)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy this rank's real rows of every GTP tensor (from the ``LocalChunks`` of :meth:`state_dict`
        filled by ``dcp.load``, or from a whole logical tensor: :meth:`logical_state_dict`, files of the
        earlier gathered format) into its padded shard, pad rows zero, then load (no collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        model_sd = dict(state["model"])
        optim_sd = dict(state.get("optim", {}))
        for fqn, gw in self._gtp().items():
            model_sd[fqn] = shard_of_saved(gw, model_sd[fqn], f"GTP checkpoint: model.{fqn}")
            for key in self._state_keys(optim_sd, fqn):
                v = optim_sd[key]
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    optim_sd[key] = shard_of_saved(gw, v, f"GTP checkpoint: optim.{key}")
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
        return {n: (list(_placement(gtp[n]).shape) if n in gtp else list(p.shape),
                    str(p.dtype).removeprefix("torch.")) for n, p in self.model.named_parameters()}
