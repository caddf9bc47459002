"""Checkpoint state of a TP model and its optimizer (TP-REKLS or AdamW on Megatron slices), TP-size independent.

Public API: :class:`TPStateLayout` (``state_dict()`` / ``load_state_dict()`` / ``fit_template()`` /
``param_shapes()``), whose ``state_dict()`` is what ``torch.distributed.checkpoint`` (``dcp.save`` /
``dcp.load``) takes: it works with DCP and reshards across TP and DP sizes. Plain ``module.state_dict()``
of a multi-rank TP layer raises :class:`~lowband.parallel.tensor.TPStateError` instead of writing a slice under the
dense name (and so does torch's ``get_state_dict`` on such a model).

What :meth:`TPStateLayout.state_dict` returns (keys never depend on the rank, the TP size or the DP size; every
tensor is in *canonical* coordinates, those of the dense single-device model)::

    model.<fqn>                       parameter (FQN of the model, no wrapper prefix)
    model.<buffer fqn>                persistent module buffer (BatchNorm running stats, ...; replicated)
    optim.state.<fqn>.<key>           optimizer state of that parameter
    optim.param_groups.<g>.<hyper>    hyperparameters of param group g (lr, betas, ...; replicated)

Layouts (``T`` = TP size, ``E`` = ``n_embd``; mesh ``dp x tp``, TP innermost as in
:func:`lowband.parallel.mesh.build_mesh`; ``DTensor`` placements ``[Replicate(), Shard(d)]``):

* column-parallel weights (and their biases) ``Shard(0)`` of the dense shape; row-parallel weights
  ``Shard(1)``; row-parallel biases replicated.
* a column-parallel linear of ``S > 1`` sections (the ``sections`` of its placement's ``"tp"`` cut, set by
  :func:`~lowband.parallel.tp_shard.shard_tp` from the plan; a fused ``[q; k; v]`` has 3): its rows
  are permuted so that rank r holds ``[q_r; k_r; v_r]`` (:func:`~lowband.parallel.tensor.permute_sections`),
  a permutation that depends on ``T``. The checkpoint stores the dense section order viewed as
  ``(S, m/S, n)`` with ``Shard(1)``: rank r's rows are then exactly its local block, so no data moves.
  Every state tensor whose rows (or columns) index those output rows is stored in that order too.
* TP-REKLS state of a sharded ``m x n`` matrix: ``L`` (rows, ``m/T x m``), ``R``, ``Q_L``, ``Q_R`` as
  row-sharded ``DTensor`` s of the full ``d x d`` (sectioned: ``(S, m/S, m)`` with ``Shard(1)``; the columns
  of ``L`` are re-ordered to the canonical order, the columns of ``Q_L`` index eigenvectors and are not);
  ``exp_avg_out`` (the first moment in the parameter's coordinates; sectioned rows re-ordered), ``exp_avg_sq``
  (eigenbasis coordinates, independent of the row order), ``lam_L``, ``lam_R`` replicated plain
  tensors; ``step`` an int. A different TP size re-splits all of them on load (DCP reads each rank's
  new rows); the permutation of the new ``T`` is applied when the state is installed.
* AdamW state (TP-REKLS's AdamW path, or ``tp_optimizer = "adamw"``): ``exp_avg``/``exp_avg_sq`` with
  the parameter's layout; ``step`` an int (TP-REKLS) or a scalar tensor (torch AdamW).
* Replicated parameters and their state: plain tensors (written once).
* Module buffers: those ``model.state_dict()`` holds (torch's rule: ``persistent=False`` ones are left
  out; TP never splits a buffer) as plain tensors (replicated, written once), under their state-dict
  names. A checkpoint written before buffers were saved has none: :meth:`TPStateLayout.fit_template`
  drops their keys from the load template so ``dcp.load`` does not stop at them, and
  :meth:`TPStateLayout.load_state_dict` then leaves the buffers as they are.

Parameters whose optimizer state does not exist yet get the state their optimizer would create
(zeros, identity bases, step 0), so a template always has every key, and loading a never-stepped
state is the same as a fresh start.

Communication: none of its own; the DTensors live on the ``(dp, tp)`` slice of the mesh's own ``DeviceMesh``
(:meth:`lowband.parallel.mesh.ParallelMesh.device_mesh`, no new process group) when the caller gives it, else on
one built once with ``init_device_mesh`` (new process groups, every rank alike); DCP moves the bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lowband.buffers import drop_unsaved, persistent_buffers
from lowband.optim.rekls import REKLS, ReklsHyper, init_rekls_state
from lowband.optim.sharded_state import group_hyperparams
from lowband.parallel.tensor import permute_sections
from lowband.sharding import cut_of, placement_of


def sections_perm(m: int, sections: int, t: int) -> torch.Tensor:
    """Canonical row of each row of a TP-permuted sectioned tensor of ``m`` rows (``perm[p] = c``)."""
    return permute_sections(torch.arange(m), sections, t)


def qkv_perm(e: int, t: int) -> torch.Tensor:
    """Canonical row of each row of the TP-permuted qkv (``perm[p] = c``; ``[q; k; v]`` is canonical)."""
    return sections_perm(3 * e, 3, t)


class TPStateLayout:
    """Converts a TP model's local state to DCP's canonical state and back (see the module docstring).

    Args:
        model: the model (its planned linears already column/row-parallel, e.g. by
            :func:`~lowband.parallel.tp_shard.shard_tp`; no :class:`~lowband.parallel.tensor.TPInputGather`
            wrapper).
        optimizer: its optimizer (:class:`~lowband.optim.tp_rekls.TpRekls` or torch AdamW).
        tp_size, dp_size: the mesh; ranks are ``dp * tp_size + tp`` (:func:`lowband.parallel.mesh.build_mesh`).
        device_mesh: the ``(dp, tp)`` ``DeviceMesh`` the DTensors live on, e.g.
            ``parallel_mesh.device_mesh(dev)["dp", "tp"]`` (:meth:`lowband.parallel.mesh.ParallelMesh.device_mesh`:
            the mesh's own groups, what the trainer's ``tp`` strategy passes); ``None``: one is created on first
            use with ``init_device_mesh`` (new process groups, every rank alike).
        include_buffers: the model's persistent buffers are ``"model"`` entries (default ``True``; DCP writes
            rank 0's); ``False`` leaves them out, for a caller that saves every rank's buffers itself (lowband's
            trainer).

    Communication: none of its own beyond a created ``DeviceMesh``'s groups; DCP moves the bytes.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, tp_size: int, dp_size: int, *,
                 device_mesh: Any = None, include_buffers: bool = True) -> None:
        self.model, self.optimizer = model, optimizer
        self.include_buffers = include_buffers
        self.t, self.dp = tp_size, dp_size
        self.params = dict(model.named_parameters())
        self.names = {id(p): n for n, p in self.params.items()}
        if device_mesh is not None and tuple(device_mesh.shape) != (dp_size, tp_size):
            raise ValueError(f"TPStateLayout: device_mesh has shape {tuple(device_mesh.shape)}; expected (dp, tp) = "
                             f"({dp_size}, {tp_size})")
        self._mesh = device_mesh
        self._perm: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------------------------ helpers
    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The model's persistent buffers by state-dict name (read anew: a module may rebind a buffer); none
        without ``include_buffers``."""
        return dict(persistent_buffers(self.model)) if self.include_buffers else {}

    def mesh(self):
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            dev = next(iter(self.params.values())).device.type
            self._mesh = init_device_mesh(dev, (self.dp, self.t), mesh_dim_names=("dp", "tp"))
        return self._mesh

    def _perms(self, m: int, sections: int) -> tuple[torch.Tensor, torch.Tensor]:
        if (m, sections) not in self._perm:
            perm = sections_perm(m, sections, self.t)
            self._perm[(m, sections)] = (perm, torch.argsort(perm))
        return self._perm[(m, sections)]

    def _sharded(self, local: torch.Tensor, dim: int, global_shape: tuple[int, ...]) -> Any:
        """``local`` as a DTensor ``[Replicate(), Shard(dim)]`` of ``global_shape`` (plain if T = 1)."""
        local = local.contiguous()
        if self.t == 1:
            return local.clone()
        from torch.distributed.tensor import DTensor, Replicate, Shard

        stride = torch.empty(global_shape, device="meta").stride()
        return DTensor.from_local(local.clone(), self.mesh(), [Replicate(), Shard(dim)], run_check=False,
                                  shape=torch.Size(global_shape), stride=stride)

    @staticmethod
    def _local(x: Any) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return x.to_local() if isinstance(x, DTensor) else x

    @staticmethod
    def _sections(p: torch.Tensor) -> int:
        """Sections of a column-parallel tensor whose rows are section-permuted (1: none)."""
        cut = cut_of(p, "tp")
        return cut.sections if cut is not None and cut.dim == 0 else 1

    @staticmethod
    def _full_shape(p: torch.Tensor) -> tuple[int, ...]:
        """The dense shape (the local shape of a replicated parameter)."""
        pl = placement_of(p)
        return pl.shape if pl is not None else tuple(p.shape)

    # ------------------------------------------------------------------- parameter-shaped tensors
    def _param_like_out(self, p: torch.Tensor, x: torch.Tensor) -> Any:
        """A tensor with ``p``'s local layout (the parameter, or an AdamW moment) -> canonical."""
        cut = cut_of(p, "tp")
        if cut is None:
            return x.detach().clone()
        sec = self._sections(p)
        if sec > 1:
            m, *rest = self._full_shape(p)
            return self._sharded(x.detach().reshape(sec, m // sec // self.t, *rest), 1, (sec, m // sec, *rest))
        return self._sharded(x.detach(), cut.dim, self._full_shape(p))

    def _param_like_in(self, p: torch.Tensor, x: Any) -> torch.Tensor:
        return self._local(x).reshape(p.shape).contiguous()

    # ------------------------------------------------------------------------ optimizer templates
    def _kind(self, gi: int, pi: int, p: torch.Tensor) -> tuple[str, tuple[int, ...]]:
        group = self.optimizer.param_groups[gi]
        if not isinstance(self.optimizer, REKLS):
            return "torch-adamw", tuple(p.shape)
        kind, pd, full = self.optimizer.classify(group, gi, pi, p, ReklsHyper.from_group(group))
        cut = cut_of(p, "tp")
        if pd != (cut.dim if cut is not None else None):
            # the layout of the saved tensors follows the placement: a group's partition_dim key that says
            # otherwise would save one rank's chunk (or per-rank REKLS state) as if every rank held the same
            raise ValueError(
                f"TPStateLayout: param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) is stepped with "
                f"partition_dim={pd} (the param group's 'partition_dim' key) but its placement says "
                f"{'partition_dim=' + str(cut.dim) if cut is not None else 'replicated'}; the checkpoint layout "
                "follows the placement, so it cannot save it: declare the TP layout on the parameter "
                "(lowband.parallel.tensor.mark_partition) instead of the group key")
        return kind, tuple(full)

    def _fresh_state(self, gi: int, pi: int, p: torch.Tensor) -> dict[str, Any]:
        """The state ``p``'s optimizer creates at its first step (local layout)."""
        kind, full = self._kind(gi, pi, p)
        if kind == "torch-adamw":
            from torch.optim.optimizer import _get_scalar_dtype

            return {"step": torch.tensor(0.0, dtype=_get_scalar_dtype()), "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p)}
        if kind == "adamw":
            return {"step": 0, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        h = ReklsHyper.from_group(self.optimizer.param_groups[gi])
        dtype = h.dtype_for(p)
        st: dict[str, Any] = {}
        if kind == "rekls":
            init_rekls_state(st, full[0], full[1], dtype, p.device)
            return st
        t, r = self.t, self.optimizer.tp_comm.rank
        m, n = full
        st["step"] = 0
        st["exp_avg_out"] = torch.zeros(m, n, dtype=dtype, device=p.device)
        st["exp_avg_sq"] = torch.zeros(m, n, dtype=dtype, device=p.device)
        st["L"] = torch.zeros(m // t, m, dtype=dtype, device=p.device)
        st["R"] = torch.zeros(n // t, n, dtype=dtype, device=p.device)
        st["Q_L"] = torch.eye(m, dtype=dtype, device=p.device)[r * m // t:(r + 1) * m // t].clone()
        st["Q_R"] = torch.eye(n, dtype=dtype, device=p.device)[r * n // t:(r + 1) * n // t].clone()
        st["lam_L"] = torch.zeros(m, dtype=dtype, device=p.device)
        st["lam_R"] = torch.zeros(n, dtype=dtype, device=p.device)
        return st

    def _state_out(self, kind: str, p: torch.Tensor, full: tuple[int, ...], st: dict[str, Any]) -> dict[str, Any]:
        if kind in ("torch-adamw", "adamw"):
            return {k: (self._param_like_out(p, v) if k != "step" else
                        (v.detach().clone() if isinstance(v, torch.Tensor) else int(v))) for k, v in st.items()}
        if kind == "rekls":
            return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
        m, n = full
        sec = self._sections(p)
        out: dict[str, Any] = {"step": int(st["step"]), "exp_avg_sq": st["exp_avg_sq"].clone(),
                               "lam_L": st["lam_L"].clone(), "lam_R": st["lam_R"].clone()}
        out["R"] = self._sharded(st["R"], 0, (n, n))
        out["Q_R"] = self._sharded(st["Q_R"], 0, (n, n))
        if sec > 1:
            _perm, inv = self._perms(m, sec)
            b = m // sec
            out["exp_avg_out"] = st["exp_avg_out"].index_select(0, inv)
            out["L"] = self._sharded(st["L"].index_select(1, inv).reshape(sec, b // self.t, m), 1, (sec, b, m))
            out["Q_L"] = self._sharded(st["Q_L"].reshape(sec, b // self.t, m), 1, (sec, b, m))
        else:
            out["exp_avg_out"] = st["exp_avg_out"].clone()
            out["L"] = self._sharded(st["L"], 0, (m, m))
            out["Q_L"] = self._sharded(st["Q_L"], 0, (m, m))
        return out

    def _state_in(self, kind: str, p: torch.Tensor, full: tuple[int, ...], saved: dict[str, Any]) -> dict[str, Any]:
        if kind in ("torch-adamw", "adamw"):
            return {k: (self._param_like_in(p, v) if k != "step" else
                        (v.clone() if isinstance(v, torch.Tensor) else int(v))) for k, v in saved.items()}
        if kind == "rekls":
            return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in saved.items()}
        m, _n = full
        t = self.t
        st: dict[str, Any] = {"step": int(saved["step"]), "exp_avg_sq": saved["exp_avg_sq"].contiguous().clone(),
                              "lam_L": saved["lam_L"].clone(), "lam_R": saved["lam_R"].clone(),
                              "R": self._local(saved["R"]).contiguous().clone(),
                              "Q_R": self._local(saved["Q_R"]).contiguous().clone()}
        sec = self._sections(p)
        if sec > 1:
            perm, _inv = self._perms(m, sec)
            st["exp_avg_out"] = saved["exp_avg_out"].index_select(0, perm).contiguous()
            st["L"] = self._local(saved["L"]).reshape(m // t, m).index_select(1, perm).contiguous()
            st["Q_L"] = self._local(saved["Q_L"]).reshape(m // t, m).contiguous().clone()
        else:
            st["exp_avg_out"] = saved["exp_avg_out"].contiguous().clone()
            st["L"] = self._local(saved["L"]).contiguous().clone()
            st["Q_L"] = self._local(saved["Q_L"]).contiguous().clone()
        return st

    # ------------------------------------------------------------------------------------ public
    def _each_param(self) -> list[tuple[int, int, torch.Tensor]]:
        return [(gi, pi, p) for gi, g in enumerate(self.optimizer.param_groups) for pi, p in enumerate(g["params"])]

    def state_dict(self) -> dict[str, Any]:
        """Canonical state (see the module docstring); copies, so the caller may keep it."""
        model = {n: self._param_like_out(p, p) for n, p in self.params.items()}
        model.update({n: b.detach().clone() for n, b in self.buffers.items()})
        optim: dict[str, Any] = {}
        for gi, pi, p in self._each_param():
            kind, full = self._kind(gi, pi, p)
            st = self.optimizer.state.get(p) or self._fresh_state(gi, pi, p)
            for k, v in self._state_out(kind, p, full, st).items():
                optim[f"state.{self.names[id(p)]}.{k}"] = v
        optim.update(group_hyperparams(self.optimizer.param_groups))
        return {"model": model, "optim": optim}

    def fit_template(self, state: dict[str, Any], saved_keys: set[str]) -> list[str]:
        """Fit a fresh :meth:`state_dict` (the load template) to a checkpoint written before module buffers
        were saved: drop the ``model.<buffer>`` entries the checkpoint does not have (``saved_keys``: its
        flattened DCP keys, relative to this state), so ``dcp.load`` does not stop at a missing key;
        :meth:`load_state_dict` then leaves those buffers as they are. Returns the dropped keys. No
        communication (every rank reads the same metadata and drops the same keys)."""
        return drop_unsaved(state.get("model", {}), self.buffers, saved_keys)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Install a filled :meth:`state_dict` template: parameters, persistent buffers (a buffer the
        template lacks, see :meth:`fit_template`, is left as it is), optimizer state, hyperparameters."""
        for n, p in self.params.items():
            p.copy_(self._param_like_in(p, state["model"][n]))
        for n, b in self.buffers.items():
            if n in state["model"]:
                b.copy_(state["model"][n])
        optim = state["optim"]
        for gi, pi, p in self._each_param():
            kind, full = self._kind(gi, pi, p)
            prefix = f"state.{self.names[id(p)]}."
            saved = {k[len(prefix):]: v for k, v in optim.items() if k.startswith(prefix)}
            self.optimizer.state[p] = self._state_in(kind, p, full, saved)
        for gi, g in enumerate(self.optimizer.param_groups):
            for k in list(g):
                key = f"param_groups.{gi}.{k}"
                if k != "params" and key in optim:
                    g[k] = optim[key]

    def param_shapes(self) -> dict[str, tuple[list[int], str]]:
        """Dense shapes (of the placement; the local shape of replicated parameters)."""
        return {n: (list(self._full_shape(p)), str(p.dtype).removeprefix("torch."))
                for n, p in self.params.items()}


def full_state(state: dict[str, Any], fn: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Flatten ``{"model": ..., "optim": ...}`` to ``{"model.<k>" | "optim.<k>": full tensor or value}``
    (DTensors gathered: a collective on every rank). For tests and inspection."""
    from torch.distributed.tensor import DTensor

    out = {}
    for top, sub in state.items():
        for k, v in sub.items():
            v = v.full_tensor() if isinstance(v, DTensor) else v
            out[f"{top}.{k}"] = fn(v) if fn else v
    return out
