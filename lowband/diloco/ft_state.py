"""What a healing replica group copies from a live peer: this rank's model and inner-optimizer state.

Fault-tolerant DiLoCo (:mod:`lowband.diloco.ft`) heals a restarted or lagging replica group from a peer
at a quorum: torchft's ``Manager`` fetches the peer's registered state (group rank ``r`` from group rank
``r``, so both groups must have the same layout, which the settings check enforces) and calls the load
functions. This module is the model-and-inner-optimizer part, for any inner strategy:

* :func:`local_state` returns **copies** (``clone``) of this rank's tensors: every parameter (each shared
  tensor once, by its first name) and buffer of ``model`` as this rank holds it (a GTP row shard, a whole
  weight under DDP or the sharded optimizer), and the optimizer's own rank-local state: a
  ``ShardedOptimizer``'s :meth:`~lowband.optim.ShardedOptimizer.shard_state_dict`, else every entry of
  ``optimizer.state`` keyed by the parameter's position in ``param_groups`` plus each group's
  hyperparameters. Copies, because torchft's HTTP transport serves CPU tensors by reference until the
  next ``should_commit()``: the peer keeps training in between (the ``delay`` inner steps of Streaming
  DiLoCo), and a healing group reading live tensors could get a mix of two steps.
* :func:`load_local_state` writes such a state **in place** (``copy_``): parameters, buffers and optimizer
  tensors keep their identity, so views into them (GTP-Muon's stacked momentum, a sharded optimizer's
  flat buffers, the optimizer's references to the parameters) stay valid. An optimizer entry the peer has
  and this rank has not (a parameter that got no gradient here yet) is created as a copy; one this rank
  has and the peer has not is removed, so the state equals the peer's. Raises ``ValueError`` naming the
  first entry whose name, shape or dtype differs (a peer with another model or layout).

No communication.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {f"param:{n}": p for n, p in model.named_parameters()}
    out.update({f"buffer:{n}": b for n, b in model.named_buffers()})
    return out


def _param_keys(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """``id(parameter) -> position`` over the optimizer's groups, in order."""
    return {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}


def _clone(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A copy of this rank's model and optimizer state (see the module docstring). No communication."""
    with torch.no_grad():
        tensors = {k: t.detach().clone() for k, t in _model_tensors(model).items()}
    shard_fn = getattr(optimizer, "shard_state_dict", None)
    if callable(shard_fn):
        sd = shard_fn()
        opt: dict[str, Any] = {"kind": "shard", "state": {k: {n: _clone(v) for n, v in st.items()}
                                                          for k, st in sd["state"].items()},
                               "rest": {k: copy.deepcopy(v) for k, v in sd.items() if k != "state"}}
    else:
        keys = _param_keys(optimizer)
        state = {}
        for p, st in optimizer.state.items():
            key = keys.get(id(p)) if isinstance(p, torch.Tensor) else p
            if key is None:
                raise ValueError(f"local_state: {type(optimizer).__name__} holds state for a tensor that is in none "
                                 "of its param_groups")
            state[key] = {n: _clone(v) for n, v in st.items()}
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        opt = {"kind": "torch", "state": state, "param_groups": groups}
    return {"model": tensors, "optimizer": opt}


def _copy_into(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"heal from a peer: {what} is {tuple(src.shape)} {src.dtype} on the peer but "
                         f"{tuple(dst.shape)} {dst.dtype} here (another model, dtype or layout)")
    dst.copy_(src)


@torch.no_grad()
def load_local_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Write a peer's :func:`local_state` into this rank's model and optimizer, in place."""
    mine = _model_tensors(model)
    theirs = state["model"]
    if set(mine) != set(theirs):
        diff = sorted(set(mine) ^ set(theirs))
        raise ValueError(f"heal from a peer: the models differ in {diff[0]!r} (present on one side only)")
    for k, t in mine.items():
        _copy_into(t.data, theirs[k], k)
    opt = state["optimizer"]
    if opt["kind"] == "shard":
        if not callable(getattr(optimizer, "load_shard_state_dict", None)):
            raise ValueError(f"heal from a peer: the peer's inner optimizer is sharded, this one is "
                             f"{type(optimizer).__name__}")
        optimizer.load_shard_state_dict({"state": opt["state"], **opt["rest"]})  # type: ignore[attr-defined]
        return
    if callable(getattr(optimizer, "shard_state_dict", None)):
        raise ValueError(f"heal from a peer: this inner optimizer is sharded ({type(optimizer).__name__}), the "
                         "peer's is not")
    if len(opt["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"heal from a peer: {len(opt['param_groups'])} optimizer parameter groups on the peer, "
                         f"{len(optimizer.param_groups)} here")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    keys = _param_keys(optimizer)
    by_key: dict[Any, Any] = {keys[id(p)] if isinstance(p, torch.Tensor) else p: p for p in list(optimizer.state)}
    for key in list(by_key):
        if key not in opt["state"]:  # never stepped on the peer
            del optimizer.state[by_key[key]]
    for key, st in opt["state"].items():
        if isinstance(key, int) and key >= len(params) and key not in by_key:
            raise ValueError(f"heal from a peer: optimizer state entry {key} has no parameter here")
        holder = by_key.get(key, params[key] if isinstance(key, int) and key < len(params) else key)
        cur = optimizer.state.get(holder)
        if cur is None or set(cur) != set(st):
            optimizer.state[holder] = {n: _clone(v) for n, v in st.items()}
            continue
        for n, v in st.items():
            if isinstance(v, torch.Tensor) and isinstance(cur[n], torch.Tensor):
                _copy_into(cur[n], v, f"optimizer state {key}.{n}")
            else:
                cur[n] = _clone(v)
    for g, saved in zip(optimizer.param_groups, opt["param_groups"], strict=True):
        g.update({k: copy.deepcopy(v) for k, v in saved.items()})
