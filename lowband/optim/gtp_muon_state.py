"""Checkpoint state of a GTP model trained with :class:`lowband.optim.gtp_muon.GTPMuon`, GTP-size independent.

Layout (logical shapes under keys that never depend on the GTP degree, so the state loads at any GTP
degree)::

    {"model": {<fqn>: tensor},                      # as GTPStateLayout: GTP weights by real rows, unpadded
     "optim": {"state.<fqn>.momentum_buffer": [rows, cols],           # Muon (GTP or replicated)
               "state.<fqn>.exp_avg" / ".exp_avg_sq": logical shape,  # AdamW
               "state.<fqn>.step": 0-d float32,                       # AdamW
               "param_groups.<g>.<hyper>": number}}                   # lr, initial_lr, ... per group index

:meth:`GTPMuonStateLayout.state_dict` (what checkpoints save) holds only what this rank owns, as
:class:`lowband.dcp_chunks.LocalChunks` of the logical shape (views of the live state, chunks of at most
16 MiB): a GTP weight and its AdamW moments by this rank's real rows (as
:class:`~lowband.parallel.gtp_state.GTPStateLayout`), a GTP Muon matrix's momentum whole on its owner
rank and nothing elsewhere; replicated parameters' state and scalars are plain tensors (the same on
every rank; DCP writes them once). ``dcp.load`` into a fresh :meth:`~GTPMuonStateLayout.state_dict`
reads only the chunks overlapping what this rank owns now (ownership may differ from the saving run's,
e.g. 2 -> 4 GTP ranks). :meth:`~GTPMuonStateLayout.logical_state_dict` is the gathered form (every
tensor whole, the same on every rank; for inspection and tests);
:meth:`~GTPMuonStateLayout.load_state_dict` takes either, and files of the earlier gathered format.

Communication: :meth:`~GTPMuonStateLayout.state_dict` and :meth:`~GTPMuonStateLayout.load_state_dict`
issue none (DCP's planning collectives only). :meth:`~GTPMuonStateLayout.logical_state_dict` (every
rank): the model's all-gathers of :class:`~lowband.parallel.gtp_state.GTPStateLayout` (tag
``gtp:state``), one all-gather per AdamW moment of a GTP shard, and one broadcast per GTP Muon matrix
from its owner over the GTP group (tag ``gtp:state``): transiently every rank holds every whole
momentum.

The keys differ from the ``replicated`` format of ``single``/``ddp``/``gtp`` with AdamW (a Muon
momentum has no place there), hence the strategy's format tag ``gtp-muon-v1``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowband.dcp_chunks import LocalChunks, box_chunks
from lowband.optim.gtp_muon import GTPMuon
from lowband.parallel.gtp_state import GTPStateLayout, gather_logical
from lowband.sharding import from_state, placement_of, to_state

_MOMENTS = ("exp_avg", "exp_avg_sq")


class GTPMuonStateLayout:
    """State of a GTP model and its :class:`GTPMuon` in logical shapes: rank-local (:meth:`state_dict`) or
    gathered (:meth:`logical_state_dict`); see the module docstring."""

    def __init__(self, model: nn.Module, optimizer: GTPMuon) -> None:
        self.model, self.optimizer = model, optimizer
        self._model_layout = GTPStateLayout(model, None)
        self._names = {id(p): n for n, p in model.named_parameters()}
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in self._names:
                    raise ValueError("GTPMuonStateLayout: the optimizer holds a parameter that is not in the "
                                     f"model (shape {tuple(p.shape)})")

    def _params(self) -> list[tuple[str, dict, torch.Tensor]]:
        return [(self._names[id(p)], g, p) for g in self.optimizer.param_groups for p in g["params"]]

    def _state(self, logical: bool) -> dict[str, Any]:
        opt = self.optimizer
        model_sd = (self._model_layout.logical_state_dict() if logical else self._model_layout.state_dict())["model"]
        optim: dict[str, Any] = {}
        for fqn, g, p in self._params():
            st = opt.state[p]
            gw = getattr(p, "gtp", None)
            pl = placement_of(p)
            if g["algorithm"] == "adamw":
                optim[f"state.{fqn}.step"] = st["step"].clone()
                for k in _MOMENTS:
                    if gw is None:
                        optim[f"state.{fqn}.{k}"] = st[k].detach().clone()
                    elif logical:
                        optim[f"state.{fqn}.{k}"] = gather_logical(gw, st[k])
                    else:
                        optim[f"state.{fqn}.{k}"] = to_state(pl, st[k], what=f"optim.state.{fqn}.{k}")
            elif opt.is_gtp_muon(p):
                owner = opt.owner(p)
                assert owner is not None
                mine = owner == opt.comm.rank
                if logical:
                    buf = (st["momentum_buffer"].clone() if mine
                           else torch.empty(pl.shape, dtype=p.dtype, device=p.device))
                    opt.comm.broadcast(buf, src=owner, tag="gtp:state")
                    optim[f"state.{fqn}.momentum_buffer"] = buf
                else:
                    optim[f"state.{fqn}.momentum_buffer"] = box_chunks(
                        pl.shape, [((0, 0), st["momentum_buffer"])] if mine else [],
                        dtype=p.dtype, device=p.device)
            else:
                optim[f"state.{fqn}.momentum_buffer"] = st["momentum_buffer"].detach().clone()
        for gi, g in enumerate(opt.param_groups):
            for k, v in g.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    optim[f"param_groups.{gi}.{k}"] = v
        return {"model": model_sd, "optim": optim}

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optim": ...}`` in logical shapes, each rank's own part as ``LocalChunks``
        (no communication; see the module docstring)."""
        return self._state(False)

    def logical_state_dict(self) -> dict[str, Any]:
        """The keys of :meth:`state_dict`, every tensor whole and the same on every rank (collective on the
        GTP group, tag ``gtp:state``, every rank; see the module docstring)."""
        return self._state(True)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state of :meth:`state_dict` filled by ``dcp.load`` or of :meth:`logical_state_dict`
        (saved at any GTP degree); no collective.

        Raises:
            ValueError: a key is missing or a tensor has the wrong logical shape (named).
        """
        opt = self.optimizer
        optim = state.get("optim", {})

        def get(key: str) -> Any:
            if key not in optim:
                raise ValueError(f"GTP Muon checkpoint: optimizer state {key!r} is missing (was it saved by "
                                 "strategy gtp with gtp.optimizer = 'muon' on the same model?)")
            return optim[key]

        def expect(key: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
            if tuple(t.shape) != shape:
                raise ValueError(f"GTP Muon checkpoint: {key} has shape {tuple(t.shape)}, expected {shape}")
            return t

        for fqn, g, p in self._params():
            st = opt.state[p]
            pl = placement_of(p)
            logical = pl.shape if pl is not None else tuple(p.shape)
            if g["algorithm"] == "adamw":
                st["step"].copy_(get(f"state.{fqn}.step"))
                for k in _MOMENTS:
                    key = f"state.{fqn}.{k}"
                    v = expect(key, get(key), logical)
                    st[k].copy_(from_state(pl, v, what=f"GTP checkpoint: optim.{key}") if pl is not None else v)
            else:
                key = f"state.{fqn}.momentum_buffer"
                v = expect(key, get(key), logical)
                if "momentum_buffer" in st:  # the owner (GTP) or every rank (replicated)
                    if isinstance(v, LocalChunks):  # a template of state_dict(): the owner holds it whole
                        if sum(t.numel() for _o, t in v.pieces) != st["momentum_buffer"].numel():
                            raise ValueError(f"GTP Muon checkpoint: {key} does not hold this rank's whole matrix "
                                             "(pass the template state_dict() returned, filled by dcp.load)")
                        v = v.to_full()
                    st["momentum_buffer"].copy_(v)
        for gi, g in enumerate(opt.param_groups):
            for k, v in g.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    g[k] = get(f"param_groups.{gi}.{k}")
        self._model_layout.load_state_dict({"model": state["model"]})

    def param_shapes(self) -> dict[str, tuple[list[int], str]]:
        return self._model_layout.param_shapes()
