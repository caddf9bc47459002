"""Checkpoint state of a GTP model trained with :class:`lowband.optim.gtp_muon.GTPMuon`, GTP-size independent.

Layout (plain tensors in logical shapes, the same on every rank, so DCP writes one copy and the state
loads at any GTP degree)::

    {"model": {<fqn>: tensor},                      # as GTPStateLayout: shards gathered, unpadded
     "optim": {"state.<fqn>.momentum_buffer": [rows, cols],           # Muon (GTP or replicated)
               "state.<fqn>.exp_avg" / ".exp_avg_sq": logical shape,  # AdamW
               "state.<fqn>.step": 0-d float32,                       # AdamW
               "param_groups.<g>.<hyper>": number}}                   # lr, initial_lr, ... per group index

Communication (:meth:`GTPMuonStateLayout.state_dict`, every rank): the model's all-gathers of
:class:`~lowband.parallel.gtp_state.GTPStateLayout` (tag ``gtp:state``), one all-gather per AdamW
moment of a GTP shard, and one broadcast per GTP Muon matrix from its owner over the GTP group (tag
``gtp:state``): transiently every rank holds every whole momentum. :meth:`load_state_dict` has none:
each rank slices its AdamW shard rows and copies the momentum of the matrices it owns (ownership may
differ from the saving run's, e.g. 2 -> 4 GTP ranks).

The keys differ from the ``replicated`` format of ``single``/``ddp``/``gtp`` with AdamW (a Muon
momentum has no place there), hence the strategy's format tag ``gtp-muon-v1``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowband.optim.gtp_muon import GTPMuon
from lowband.parallel.gtp_state import GTPStateLayout, gather_logical, shard_of_logical

_MOMENTS = ("exp_avg", "exp_avg_sq")


class GTPMuonStateLayout:
    """Logical state of a GTP model and its :class:`GTPMuon` (see the module docstring)."""

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

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optim": ...}`` in logical shapes (collective on the GTP group, every rank)."""
        opt = self.optimizer
        model_sd = self._model_layout.state_dict()["model"]
        optim: dict[str, Any] = {}
        for fqn, g, p in self._params():
            st = opt.state[p]
            gw = getattr(p, "gtp", None)
            if g["algorithm"] == "adamw":
                optim[f"state.{fqn}.step"] = st["step"].clone()
                for k in _MOMENTS:
                    optim[f"state.{fqn}.{k}"] = (gather_logical(gw, st[k]) if gw is not None
                                                 else st[k].detach().clone())
            elif opt.is_gtp_muon(p):
                owner = opt.owner(p)
                assert owner is not None
                buf = (st["momentum_buffer"].clone() if owner == opt.comm.rank
                       else torch.empty(gw.out_features, gw.in_features, dtype=p.dtype, device=p.device))
                opt.comm.broadcast(buf, src=owner, tag="gtp:state")
                optim[f"state.{fqn}.momentum_buffer"] = buf
            else:
                optim[f"state.{fqn}.momentum_buffer"] = st["momentum_buffer"].detach().clone()
        for gi, g in enumerate(opt.param_groups):
            for k, v in g.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    optim[f"param_groups.{gi}.{k}"] = v
        return {"model": model_sd, "optim": optim}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a logical state (from :meth:`state_dict` at any GTP degree); no collective.

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
            gw = getattr(p, "gtp", None)
            logical = (gw.out_features, gw.in_features) if gw is not None else tuple(p.shape)
            if g["algorithm"] == "adamw":
                st["step"].copy_(get(f"state.{fqn}.step"))
                for k in _MOMENTS:
                    key = f"state.{fqn}.{k}"
                    v = expect(key, get(key), logical)
                    st[k].copy_(shard_of_logical(gw, v, f"GTP checkpoint: optim.{key}") if gw is not None else v)
            else:
                key = f"state.{fqn}.momentum_buffer"
                v = expect(key, get(key), logical)
                if "momentum_buffer" in st:  # the owner (GTP) or every rank (replicated)
                    st["momentum_buffer"].copy_(v)
        for gi, g in enumerate(opt.param_groups):
            for k, v in g.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    g[k] = get(f"param_groups.{gi}.{k}")
        self._model_layout.load_state_dict({"model": state["model"]})

    def param_shapes(self) -> dict[str, tuple[list[int], str]]:
        return self._model_layout.param_shapes()
