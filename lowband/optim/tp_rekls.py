"""TP-REKLS: REKLS with Kronecker factors and eigenbases sharded over a tensor-parallel group.

The math is :mod:`lowband.optim.rekls`; this module only decides who holds which slice, who
decomposes which factor and what travels. The result equals single-process :class:`REKLS` on the
dense parameters (bitwise on CPU: every factor is decomposed from bitwise the same full matrix by
the same code, see tests/distributed/test_tp_rekls.py).

Layout (TP group of size ``T``, this rank ``r``), for a TP-sharded parameter of full shape m x n:

* parameter and gradient: Megatron chunk ``r`` along ``partition_dim`` (0: rows, m/T x n; 1:
  columns, m x n/T). ``partition_dim`` comes from the parameter's ``"tp"`` cut
  (:func:`lowband.sharding.placement_of`: the placement :mod:`lowband.parallel.tensor` records, or a TP
  declaration ``param.partition_dim`` / ``param.tp_comm`` on a user's own layer), or from a param-group key
  ``partition_dim`` (0, 1 or None) that overrides it.
* state ``L`` (m/T x m), ``R`` (n/T x n), ``Q_L`` (m/T x m), ``Q_R`` (n/T x n): rows
  ``[r*d/T, (r+1)*d/T)`` of the dense factor / eigenbasis (1/T of the memory each; both m and n
  must therefore be divisible by T). ``lam_L`` (m), ``lam_R`` (n), ``exp_avg_sq`` V and
  ``exp_avg_out`` (m x n) are full and identical on every TP rank, as in the reference TpRekls;
  ``exp_avg_out`` is the first moment rotated out, ``Q_L M Q_R^T``.

One step, all TP-sharded parameters batched (2 collectives per step, whatever the number of
parameters):

1. **gather** (one ``all_to_all``, ``tag="tp_rekls:gather"``): every rank sends its gradient chunk
   of every parameter to every rank, and its rows of each factor plus its rows of the other side's
   previous basis to the factor's owner.
2. **decompose**: each (parameter, factor) is owned by one rank, assigned greedily by cost ``d^3``
   (largest first, to the least-loaded rank). The owner computes the KL factor update and its
   ``eigh``. Each factor is decomposed exactly once per step in the whole group (the reference
   decomposes every factor twice on every rank).
3. **exchange** (one ``all_to_all``, ``tag="tp_rekls:bases"``): each owner sends every rank the new
   eigenbasis (d x d), eigenvalues (d) and that rank's rows of the new factor (d/T x d).
4. **update** (local, replicated): rotate M in, Adam in the new basis, back-projection, apply the
   local chunk, rotate M out with the new basis (the product REKLS forms at its next step, so only
   the owners need the previous bases); store this rank's rows of the new factors and bases.

A first-step validation (``all_gather_object``, ``tag="tp_rekls:validate"``) makes every rank raise
the same error if any rank's layout is wrong or differs.

Wire bytes per rank per step (element size ``s``, bytes sent): gradients ``(T-1)/T * s * sum(mn)``,
rows to owners ``s * sum_{factors not owned}(d^2 + e^2)/T`` (e = the other side), bases
``(T-1) * s * sum_{owned}(d^2 + d + d^2/T)``; group average
``(T-1)/T * s * sum(mn + (1 + 3/T)(m^2 + n^2) + m + n)``. This is more than the reference's
``4 (T-1)/T (mn + m^2 + n^2)`` because the bases travel so that nobody decomposes a factor twice;
:func:`tp_rekls_wire_bytes` computes it exactly.

Replicated parameters (``partition_dim=None``) run plain REKLS locally on every rank (no traffic;
every rank must hold the same gradient). Parameters that are not 2-D or have a side above
``max_precond_dim`` use AdamW on their local chunk (elementwise, so sharding does not matter; 1-D
layer biases marked ``partition_dim=0`` take this path).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lowband.comm import Comm
from lowband.optim.rekls import (
    REKLS,
    ReklsHyper,
    adam_direction,
    adamw_step_,
    apply_update_,
    eigh_descending,
    kl_factor_update,
    rekls_step_,
    rotate_in,
    rotate_out,
    shampoo_beta_hat,
    uses_rekls,
)
from lowband.sharding import cut_of, placement_of

PARTITION_DIMS = (0, 1, None)


def assign_owners(dims: list[int], size: int) -> list[int]:
    """Owner rank of each factor (sides ``dims``): greedy by cost d^3, largest first.

    Deterministic (ties go to the lower factor index / lower rank), so every rank computes the
    same plan without communicating.
    """
    load = [0] * size
    owners = [0] * len(dims)
    for f in sorted(range(len(dims)), key=lambda i: (-dims[i] ** 3, i)):
        r = min(range(size), key=lambda j: (load[j], j))
        owners[f] = r
        load[r] += dims[f] ** 3
    return owners


def tp_rekls_wire_bytes(shapes: list[tuple[int, int]], size: int, rank: int,
                        element_size: int = 4) -> dict[str, int]:
    """Exact per-rank wire bytes of one TP-REKLS step for sharded params of full ``shapes``.

    Returns ``{"gather": ..., "bases": ..., "total": ..., "reference": ...}`` (bytes this rank sends,
    as the ledger counts all-to-all) where ``reference`` is the upstream TpRekls formula
    ``(T-1)/T * s * sum(mn + m^2 + n^2)`` (rounded like the ledger).
    """
    t, s = size, element_size
    if t == 1:
        return {"gather": 0, "bases": 0, "total": 0, "reference": 0}
    dims = [d for m, n in shapes for d in (m, n)]
    others = [d for m, n in shapes for d in (n, m)]
    owners = assign_owners(dims, t)
    grads = sum(m * n // t for m, n in shapes)
    to_owner = [sum((dims[f] ** 2 + others[f] ** 2) // t for f in range(len(dims)) if owners[f] == j)
                for j in range(t)]
    gather = s * sum(grads + to_owner[j] for j in range(t) if j != rank)
    mine = sum(d * d + d + d * d // t for d, o in zip(dims, owners) if o == rank)
    bases = (t - 1) * mine * s
    reference = sum((t - 1) * (m * n + m * m + n * n) * s // t for m, n in shapes)
    return {"gather": gather, "bases": bases, "total": gather + bases, "reference": reference}


@dataclass
class _Item:
    """One TP-sharded parameter in a step."""

    param: torch.Tensor
    state: dict
    h: ReklsHyper
    pd: int
    m: int
    n: int
    grad: torch.Tensor
    k: int = 0


def _param_name(group: dict, gi: int, pi: int) -> str:
    names = group.get("param_names")
    if names is not None and pi < len(names):
        return repr(names[pi])
    return f"group {gi} param {pi}"


class TpRekls(REKLS):
    """REKLS over a tensor-parallel group (see the module docstring for layout and traffic).

    Args:
        params, lr, betas, shampoo_beta, eps, weight_decay, first_step, max_precond_dim,
        state_dtype: as for :class:`~lowband.optim.rekls.REKLS`. A param group may add
            ``partition_dim`` (0, 1 or None) to override the parameters' own ``partition_dim``.
        tp_comm: the TP group's :class:`Comm`. If ``None``, the ``tp_comm`` attribute of the
            parameters (set by the TP layers) is used; a multi-rank run with TP-sharded parameters
            and no group raises ``ValueError``.

    Every TP rank must step the same parameters in the same order (all sharded parameters travel
    in one buffer). All TP-sharded parameters must share one state dtype.
    """

    handles_sharded_axes = ("tp",)  # its TP slices' factors are whole-matrix statistics (no refusal)

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 shampoo_beta: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.01, *,
                 tp_comm: Comm | None = None, first_step: str = "plain", max_precond_dim: int = 8192,
                 state_dtype: torch.dtype | None = None) -> None:
        super().__init__(params, lr, betas, shampoo_beta, eps, weight_decay, first_step=first_step,
                         max_precond_dim=max_precond_dim, state_dtype=state_dtype)
        self.tp_comm = self._resolve_comm(tp_comm).private("tp_rekls")  # its own process group
        self._validated: tuple | None = None
        self._owners_cache: dict[tuple[int, ...], list[int]] = {}

    # ------------------------------------------------------------------------------ layout
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if "partition_dim" in group:
            pd = group["partition_dim"]
            if pd not in PARTITION_DIMS or isinstance(pd, bool):
                self.param_groups.pop()  # a refused group is not kept
                raise ValueError(f"TpRekls param group {len(self.param_groups)}: partition_dim must "
                                 f"be 0, 1 or None, got {pd!r}")

    def _declared(self, group: dict, p: torch.Tensor) -> tuple[Any, bool]:
        """``(partition_dim, explicit)``: the param group's key overrides the parameter's placement; a TP
        declaration placement_of cannot read (a bad ``partition_dim``) is returned raw, to be refused."""
        if "partition_dim" in group:
            return group["partition_dim"], True
        cut = cut_of(p, "tp")
        return (cut.dim if cut is not None else getattr(p, "partition_dim", None)), False

    def _resolve_comm(self, tp_comm: Comm | None) -> Comm:
        if tp_comm is not None:
            if not isinstance(tp_comm, Comm):
                raise TypeError(f"TpRekls: tp_comm must be a lowband.comm.Comm, got "
                                f"{type(tp_comm).__name__}")
            return tp_comm
        sharded, comms = [], []
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                pd, _ = self._declared(group, p)
                if pd is not None:
                    sharded.append(_param_name(group, gi, pi) + f" (shape {tuple(p.shape)})")
                    cut = cut_of(p, "tp")
                    c = cut.group if cut is not None else getattr(p, "tp_comm", None)
                    if c is not None and all(c is not x for x in comms):
                        comms.append(c)
        if len(comms) > 1:
            raise ValueError("TpRekls: the parameters carry different tp_comm groups "
                             f"({', '.join(repr(c) for c in comms)}); pass tp_comm explicitly")
        if comms:
            return comms[0]
        if sharded and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(f"TpRekls: tp_comm is required: parameter {sharded[0]} is TP-sharded and "
                             "torch.distributed has more than one rank; pass the TP group's Comm "
                             "(it is never taken to be the world group)")
        return Comm(name="tp")

    def classify(self, group: dict, gi: int, pi: int, p: torch.Tensor,
                 h: ReklsHyper) -> tuple[str, int | None, tuple[int, ...]]:
        """How parameter ``pi`` of param group ``gi`` is stepped: ``(kind, partition_dim, full_shape)``.

        ``kind``: ``"sharded"`` (TP-sharded REKLS, factors split over the TP group), ``"rekls"``
        (replicated REKLS) or ``"adamw"`` (elementwise, on the local chunk). ``full_shape`` is the
        dense shape. Public so that state layouts (:class:`lowband.optim.tp_state.TPStateLayout`)
        can tell which state a parameter has. No collective; raises ``TypeError``/``ValueError`` on a
        bad layout."""
        t = self.tp_comm.size
        pd, explicit = self._declared(group, p)
        name = _param_name(group, gi, pi)
        shape = tuple(p.shape)
        if pd not in PARTITION_DIMS or isinstance(pd, bool):
            raise ValueError(f"TpRekls: parameter {name} (shape {shape}): partition_dim must be 0, 1 or "
                             f"None, got {pd!r}")
        if pd is None:
            return ("rekls" if uses_rekls(p, shape, h) else "adamw"), None, shape
        if p.dim() != 2:
            if p.dim() == 1 and not explicit:  # a TP layer's sharded bias: AdamW on the chunk
                return "adamw", pd, shape
            raise TypeError(f"TpRekls: parameter {name} (shape {shape}) is {p.dim()}-D but declared "
                            f"TP-sharded with partition_dim={pd}; only 2-D parameters can be TP-sharded")
        full = list(shape)
        full[pd] *= t
        declared_full = placement_of(p).shape if cut_of(p, "tp") is not None else None
        if declared_full is not None and not explicit and tuple(declared_full) != tuple(full):
            raise ValueError(f"TpRekls: parameter {name} (local shape {shape}, partition_dim {pd}): "
                             f"its full_shape {tuple(declared_full)} is not the local shape times the TP "
                             f"size {t} along dim {pd} ({tuple(full)})")
        for d in (0, 1):
            if full[d] % t:
                raise ValueError(f"TpRekls: parameter {name} (local shape {shape}, full shape "
                                 f"{tuple(full)}, partition_dim {pd}): dim {d} of the full shape "
                                 f"({full[d]}) is not divisible by the TP size {t}; L and R are stored "
                                 "sharded by rows, so both sides must divide")
        if not uses_rekls(p, tuple(full), h):
            return "adamw", pd, tuple(full)
        return "sharded", pd, tuple(full)

    def _validate(self, entries: list, error: BaseException | None) -> None:
        """Raise the same error on every TP rank if any rank's layout is wrong or differs."""
        sig = None if error else tuple((e[1], e[2], e[3], str(e[5].h.dtype_for(e[5].param)) if e[5]
                                        else "") for e in entries)
        if error is None and sig == self._validated:
            return
        if self.tp_comm.size == 1:
            if error:
                raise error
        else:
            payload = (None if error is None else (type(error).__name__, str(error)), sig)
            everyone = self.tp_comm.all_gather_object(payload, tag="tp_rekls:validate")
            for r, (err, _) in enumerate(everyone):
                if err is not None:
                    cls = TypeError if err[0] == "TypeError" else ValueError
                    raise cls(f"{err[1]} (on TP rank {r})")
            if any(s != everyone[0][1] for _, s in everyone):
                raise ValueError("TpRekls: the TP ranks step different parameter layouts "
                                 "(kind, partition_dim, full shape, state dtype per parameter): "
                                 + "; ".join(f"rank {r}: {s}" for r, (_, s) in enumerate(everyone)))
        dtypes = {s[3] for s in sig if s[0] == "sharded"}
        if len(dtypes) > 1:
            raise ValueError(f"TpRekls: all TP-sharded parameters must share one state dtype, got "
                             f"{sorted(dtypes)}")
        self._validated = sig

    # -------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step of every parameter with a gradient (2 TP collectives for all sharded ones)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries: list = []  # (param, kind, pd, full, h, item-or-None)
        error: BaseException | None = None
        try:
            for gi, group in enumerate(self.param_groups):
                h = ReklsHyper.from_group(group)
                for pi, p in enumerate(group["params"]):
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        raise TypeError(f"TpRekls: parameter {_param_name(group, gi, pi)} has a sparse "
                                        "gradient; not supported")
                    kind, pd, full = self.classify(group, gi, pi, p, h)
                    item = None
                    if kind == "sharded":
                        item = _Item(p, self.state[p], h, pd, full[0], full[1],
                                     p.grad.to(h.dtype_for(p)).contiguous())
                    entries.append((p, kind, pd, full, h, item))
        except (TypeError, ValueError) as e:
            error = e
        self._validate(entries, error)
        items = []
        for p, kind, _pd, _full, h, item in entries:
            if kind == "adamw":
                adamw_step_(p, p.grad, self.state[p], h.lr, h.beta1, h.beta2, h.eps, h.weight_decay)
            elif kind == "rekls":
                rekls_step_(p, p.grad, self.state[p], h)
            else:
                items.append(item)
        if items:
            self._step_sharded(items)
        return loss

    def _init_state(self, it: _Item) -> None:
        t, r = self.tp_comm.size, self.tp_comm.rank
        m, n = it.m, it.n
        dtype, dev = it.grad.dtype, it.grad.device
        st = it.state
        st["step"] = 0
        st["exp_avg_out"] = torch.zeros(m, n, dtype=dtype, device=dev)
        st["exp_avg_sq"] = torch.zeros(m, n, dtype=dtype, device=dev)
        st["L"] = torch.zeros(m // t, m, dtype=dtype, device=dev)
        st["R"] = torch.zeros(n // t, n, dtype=dtype, device=dev)
        st["Q_L"] = torch.eye(m, dtype=dtype, device=dev)[r * m // t:(r + 1) * m // t].clone()
        st["Q_R"] = torch.eye(n, dtype=dtype, device=dev)[r * n // t:(r + 1) * n // t].clone()
        st["lam_L"] = torch.zeros(m, dtype=dtype, device=dev)
        st["lam_R"] = torch.zeros(n, dtype=dtype, device=dev)

    def _step_sharded(self, items: list[_Item]) -> None:
        comm = self.tp_comm
        t, me = comm.size, comm.rank
        dtype, dev = items[0].grad.dtype, items[0].grad.device
        for it in items:
            if not it.state:
                self._init_state(it)
            it.k = it.state["step"] + 1
        dims = [d for it in items for d in (it.m, it.n)]  # factor f = 2 i + side: L (m), R (n)
        others = [d for it in items for d in (it.n, it.m)]  # the other side of factor f
        key = (t, *dims)
        if key not in self._owners_cache:
            self._owners_cache[key] = assign_owners(dims, t)
        owners = self._owners_cache[key]
        owned = [[f for f, o in enumerate(owners) if o == j] for j in range(t)]

        # 1. one all-to-all: gradient chunks to every rank; this rank's rows of each factor and of the
        #    other side's previous basis to the factor's owner
        grads = [it.grad.reshape(-1) for it in items]
        chunks: list[torch.Tensor] = []
        sizes = []
        for j in range(t):
            part = list(grads)
            for f in owned[j]:
                i, side = divmod(f, 2)
                st = items[i].state
                part += ([st["L"].reshape(-1), st["Q_R"].reshape(-1)] if side == 0
                         else [st["R"].reshape(-1), st["Q_L"].reshape(-1)])
            chunks += part
            sizes.append(sum(x.numel() for x in part))
        send = torch.cat(chunks)
        recv = torch.empty(t * sizes[me], dtype=dtype, device=dev)
        comm.all_to_all(recv, send, output_split_sizes=[sizes[me]] * t, input_split_sizes=sizes,
                        tag="tp_rekls:gather")
        recv = recv.view(t, sizes[me])
        full_g: list[torch.Tensor] = []
        off = 0
        for it in items:
            size = it.m * it.n // t
            lshape = tuple(it.grad.shape)
            full_g.append(torch.cat([recv[j, off:off + size].view(lshape) for j in range(t)], dim=it.pd))
            off += size

        # 2. owners update and decompose their factors (each factor once in the whole group)
        results: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for f in owned[me]:
            i, side = divmod(f, 2)
            d, e = dims[f], others[f]
            factor = recv[:, off:off + d * d // t].reshape(d, d)
            off += d * d // t
            q_other = recv[:, off:off + e * e // t].reshape(e, e)
            off += e * e // t
            it = items[i]
            st, h = it.state, it.h
            bh = shampoo_beta_hat(h.shampoo_beta, it.k)
            plain = h.first_step == "plain" and it.k == 1
            if side == 0:
                F = kl_factor_update(factor, full_g[i], q_other, st["lam_R"], bh, h.eps, plain)
            else:
                F = kl_factor_update(factor, full_g[i].T, q_other, st["lam_L"], bh, h.eps, plain)
            q, lam = eigh_descending(F)
            results[f] = (q, lam, F)

        # 3. one all-to-all: each owner sends every rank the new basis, eigenvalues and its factor rows
        bsizes = [sum(dims[f] ** 2 + dims[f] + dims[f] ** 2 // t for f in owned[j]) for j in range(t)]
        chunks = []
        for j in range(t):
            for f in owned[me]:
                q, lam, F = results[f]
                d = dims[f]
                chunks += [q.reshape(-1), lam, F[j * d // t:(j + 1) * d // t].reshape(-1)]
        send2 = torch.cat(chunks) if chunks else torch.empty(0, dtype=dtype, device=dev)
        out2 = torch.empty(sum(bsizes), dtype=dtype, device=dev)
        comm.all_to_all(out2, send2, output_split_sizes=bsizes, input_split_sizes=[bsizes[me]] * t,
                        tag="tp_rekls:bases")
        new: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        starts = [sum(bsizes[:r]) for r in range(t)]
        for f, owner in enumerate(owners):
            d = dims[f]
            o = starts[owner]
            # fresh (aligned, row-major) copies: BLAS may round differently on other layouts
            q = out2[o:o + d * d].view(d, d).clone()
            lam = out2[o + d * d:o + d * d + d].clone()
            rows = out2[o + d * d + d:o + d * d + d + d * d // t].view(d // t, d).clone()
            starts[owner] = o + d * d + d + d * d // t
            new[f] = (q, lam, rows)

        # 4. local update with the new bases; keep this rank's rows. M is kept rotated out
        #    (Q_L M Q_R^T, the same product single-device REKLS forms at the next step), so the previous
        #    bases are needed by the factor owners only.
        for i, it in enumerate(items):
            st, h = it.state, it.h
            ql, lam_l, l_rows = new[2 * i]
            qr, lam_r, r_rows = new[2 * i + 1]
            m_rot = rotate_in(st["exp_avg_out"], ql, qr) if it.k > 1 else st["exp_avg_out"]
            u = adam_direction(m_rot, st["exp_avg_sq"], full_g[i], ql, qr, h.beta1, h.beta2, h.eps, it.k)
            apply_update_(it.param, u.chunk(t, dim=it.pd)[me], h)
            m, n = it.m, it.n
            st["exp_avg_out"] = rotate_out(m_rot, ql, qr)
            st["L"], st["R"] = l_rows, r_rows
            st["Q_L"] = ql[me * m // t:(me + 1) * m // t].clone()
            st["Q_R"] = qr[me * n // t:(me + 1) * n // t].clone()
            st["lam_L"], st["lam_R"] = lam_l, lam_r
            st["step"] = it.k
