"""``gtp``: generalized tensor parallelism (every ``nn.Linear`` and plain ``nn.Embedding`` weight
sharded by rows over a GTP group).

Mesh: ``dp x gtp`` with ``gtp = strategy.gtp_size`` (0 = whole world) and ``dp = world / gtp``
(:func:`lowband.parallel.mesh.build_mesh`). Every rank is a data lane (its own slice of each batch).

Communication per microbatch (GTP group, see :mod:`lowband.parallel.gtp`): one all-gather per sharded
weight in forward (prefetched one ahead), one in backward (not for the token embedding, whose wgrad
is a scatter-add), one async reduce-scatter of its wgrad (pre-scaled by 1/gtp), drained at the end
of backward. Per step, after the last microbatch: one coalesced all-reduce (avg) of the replicated
parameters' grads (norms, other embeddings) over the GTP group (tag ``gtp:replicated``), then, if
``dp > 1``, one coalesced all-reduce (avg) of every grad over the DP group (tag ``grad``). Clipping:
one scalar all-reduce over the GTP group (``gtp:norm``).

State per rank: ``1/gtp`` of every sharded weight (tail-padded rows), its grad and its AdamW moments;
the replicated parameters whole. Optimizer: torch AdamW (elementwise, so AdamW on a shard equals
AdamW on the full tensor).

Checkpoints: saved gathered, in logical shapes, with the keys of ``single``/``ddp`` (format
``replicated``), so they reshard to any GTP degree and are interchangeable with those strategies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lowband.parallel.gtp import (
    GTPRuntime,
    is_gtp_param,
    reduce_grads,
    shard_embeddings,
    shard_linears,
    sync_replicated_grads,
)
from lowband.parallel.gtp_quant import BlockSpec
from lowband.parallel.mesh import build_mesh
from lowband.train.optimizers import torch_adamw
from lowband.train.strategies import register_strategy
from lowband.train.strategies.base import Strategy

_WIRE = {"float32": None, "bfloat16": torch.bfloat16}


@register_strategy("gtp")
class GTPStrategy(Strategy):
    @classmethod
    def validate_config(cls, cfg, world_size: int) -> None:
        from lowband.train.config import ConfigError

        super().validate_config(cfg, world_size)
        s = cfg.strategy
        if s.gtp_size < 0 or (s.gtp_size and world_size % s.gtp_size):
            raise ConfigError(f"strategy.gtp_size must be 0 (whole world) or a divisor of run.world_size "
                              f"({world_size}); got {s.gtp_size}")
        if s.gtp_finalize_depth < 0:
            raise ConfigError(f"strategy.gtp_finalize_depth must be >= 0; got {s.gtp_finalize_depth}")
        if s.gtp_fp8_block < 1:
            raise ConfigError(f"strategy.gtp_fp8_block must be >= 1; got {s.gtp_fp8_block}")
        if s.gtp_gather == "fp8":
            m = cfg.model
            for name, width in (("model.n_embd", m.n_embd), ("model.mlp_ratio * model.n_embd",
                                                               m.mlp_ratio * m.n_embd)):
                if width % s.gtp_fp8_block:
                    raise ConfigError(f"strategy.gtp_gather = fp8 needs {name} ({width}) divisible by "
                                      f"strategy.gtp_fp8_block ({s.gtp_fp8_block})")

    def setup(self, model: nn.Module) -> None:
        s = self.cfg.strategy
        gtp = s.gtp_size or self.env.world_size
        self.mesh = build_mesh(gtp=gtp, ledger=self.env.comm.ledger)
        self.runtime = GTPRuntime(self.mesh.gtp, gather_format=s.gtp_gather,
                                  fp8_block=BlockSpec(s.gtp_fp8_block, s.gtp_fp8_block),
                                  finalize_depth=s.gtp_finalize_depth,
                                  grad_wire_dtype=_WIRE[s.grad_wire_dtype])
        shard_embeddings(model, self.runtime)
        shard_linears(model, self.runtime)
        self.model = model
        o = self.cfg.optim
        self.optimizer = torch_adamw(model, o)

    @contextlib.contextmanager
    def microbatch(self, last: bool) -> Iterator[None]:
        yield
        if last:
            self.runtime.finalize_all()  # already drained by the backward callback; cheap no-op
            sync_replicated_grads(self.runtime, self.model)
            if self.mesh.dp.size > 1:
                reduce_grads(self.mesh.dp, self.model.parameters(), "avg", tag="grad",
                             wire_dtype=_WIRE[self.cfg.strategy.grad_wire_dtype])

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> float:
        """Global norm: shard squares summed over the GTP group, replicated params counted once."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        acc = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
        sharded = torch.zeros(1, dtype=acc, device=params[0].device)
        replicated = torch.zeros(1, dtype=acc, device=params[0].device)
        for p in params:
            (sharded if is_gtp_param(p) else replicated).add_(p.grad.to(acc).square().sum())
        self.runtime.comm.all_reduce(sharded, "sum", tag="gtp:norm")
        norm = (sharded + replicated).sqrt()[0]
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_([p.grad for p in params], coef.to(params[0].dtype))
        return float(norm)

    # ------------------------------------------------------------------------------ checkpoints
    def checkpoint_format(self) -> str | None:
        """``"replicated"``: the state is saved gathered, in the logical (unpadded) shapes and under the
        same keys as ``single``/``ddp``, so a GTP checkpoint loads at any GTP degree and into those
        strategies, and theirs into GTP."""
        return "replicated"

    def _gtp_fqns(self) -> dict[str, Any]:
        return {n: p.gtp for n, p in self.model.named_parameters() if is_gtp_param(p)}

    def state_dict(self) -> dict[str, Any]:
        """``get_state_dict`` of the sharded model with every GTP shard (and its AdamW moments) replaced
        by the gathered logical tensor (one all-gather each, tag ``gtp:state``; transiently every rank
        holds the full weights and moments)."""
        sd = super().state_dict()
        rt = self.runtime
        for fqn, gw in self._gtp_fqns().items():
            sd["model"][fqn] = rt.full_weight(gw)
            for k in ("exp_avg", "exp_avg_sq"):
                key = f"state.{fqn}.{k}"
                if key in sd["optim"]:
                    sd["optim"][key] = self._gather_like(gw, sd["optim"][key])
        return sd

    def _gather_like(self, gw: Any, shard: torch.Tensor) -> torch.Tensor:
        out = torch.empty(gw.padded_out, gw.in_features, dtype=shard.dtype, device=shard.device)
        self.runtime.comm.all_gather(out, shard.contiguous(), tag="gtp:state")
        return out[: gw.out_features].clone()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Slice every logical GTP tensor back into this rank's padded shard, then load as usual."""
        model_sd, optim_sd = dict(state["model"]), dict(state["optim"])
        for fqn, gw in self._gtp_fqns().items():
            model_sd[fqn] = self._shard_of(gw, model_sd[fqn])
            for k in ("exp_avg", "exp_avg_sq"):
                key = f"state.{fqn}.{k}"
                if key in optim_sd:
                    optim_sd[key] = self._shard_of(gw, optim_sd[key])
        super().load_state_dict({"model": model_sd, "optim": optim_sd})

    @staticmethod
    def _shard_of(gw: Any, full: torch.Tensor) -> torch.Tensor:
        if tuple(full.shape) != (gw.out_features, gw.in_features):
            raise ValueError(f"GTP checkpoint: {gw.name} has shape {tuple(full.shape)}, expected "
                             f"({gw.out_features}, {gw.in_features})")
        shard = torch.zeros(gw.shard_rows, gw.in_features, dtype=full.dtype, device=full.device)
        lo = gw.runtime.rank * gw.shard_rows
        hi = min(lo + gw.shard_rows, gw.out_features)
        if hi > lo:
            shard[: hi - lo].copy_(full[lo:hi])
        return shard

    def param_shapes(self) -> dict[str, tuple[list[int], str]]:
        shapes = super().param_shapes()
        for fqn, gw in self._gtp_fqns().items():
            shapes[fqn] = ([gw.out_features, gw.in_features], shapes[fqn][1])
        return shapes

    def skip_step(self) -> None:
        self.runtime.finalize_all()
        super().skip_step()

    def log_extras(self) -> dict[str, Any]:
        hw = self.runtime.cache.high_water
        return {"gtp_live_unsharded_mb": max(hw.values(), default=0) / 2**20}

    def persistent_buffer_bytes(self) -> int:
        """Bytes of the pooled unsharded buffers (gathered weights, wgrad scratch, RS outputs)."""
        return sum(b.numel() * b.element_size() for bufs in self.runtime.cache.buffers.values()
                   for b in bufs)
