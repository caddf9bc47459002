"""A model lowband did not write, built to exercise PyTorch's semantics for parameters that get no
gradient (issue 20): frozen weights, a LoRA-style adapter, conditional branches, a lane-only branch
and buffers.

``ConditionalNet`` holds:

* ``emb`` - a frozen token embedding (``requires_grad=False``);
* ``aux`` - a trainable token embedding (touches only the batch's rows: a sparse-table candidate);
* ``base`` - a frozen ``nn.Linear`` (weight and bias) with a LoRA-style adapter ``lora_a``/``lora_b``
  (trainable, no bias) beside it;
* ``branch`` - a linear used only when the forward counter ``calls`` (a buffer updated in forward) is
  even: on odd steps no rank uses it, so torch leaves it untouched;
* ``lane0`` - a linear used only by data lane 0 (the rank-0 batch) and only on steps with
  ``calls % 3 != 2``: averaged with zeros from the other lanes, and on every third step used by no
  lane at all;
* ``mlp``, ``head`` - ordinary trainable linears;
* ``mix`` - a buffer (per-rank random at construction, like any buffer of a per-rank-seeded model)
  that scales the hidden state: replicas must start from one copy of it;
* ``calls`` - an integer buffer counting forwards (the condition of ``branch`` and ``lane0``).

``reference_run`` is the single-process torch reference: rank 0's initial weights, the global batch
of every lane, the mean of the lanes' losses (what data-parallel gradient averaging computes), and
a plain torch optimizer over ``model.parameters()``, so a parameter that no lane used keeps
``.grad = None`` and torch skips it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 40
DIM = 16
RANK_R = 4
SEQ = 6
BATCH = 2
SEED = 11


class ConditionalNet(nn.Module):
    """See the module docstring. ``forward(idx, targets, lane)`` returns the mean cross-entropy."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, r: int = RANK_R) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.emb.weight.requires_grad_(False)
        self.aux = nn.Embedding(vocab, dim)
        self.base = nn.Linear(dim, dim)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(dim, r, bias=False)
        self.lora_b = nn.Linear(r, dim, bias=False)
        self.branch = nn.Linear(dim, dim)
        self.lane0 = nn.Linear(dim, dim)
        self.mlp = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mix", 0.5 + torch.rand(dim))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def uses_branch(self) -> bool:
        return int(self.calls) % 2 == 0

    def uses_lane0(self, lane: int) -> bool:
        return lane == 0 and int(self.calls) % 3 != 2

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, lane: int) -> torch.Tensor:
        h = (self.emb(idx) + self.aux(idx)) * self.mix
        h = self.base(h) + self.lora_b(self.lora_a(h))
        if self.uses_branch():
            h = h + torch.tanh(self.branch(h))
        if self.uses_lane0(lane):
            h = h + torch.tanh(self.lane0(h))
        h = h + F.relu(self.mlp(h))
        logits = self.head(h)
        with torch.no_grad():
            self.calls += 1
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def seeded_net(rank: int, dtype: torch.dtype = torch.float64) -> ConditionalNet:
    """nanoGPT-style per-rank seed: every rank builds different weights and buffers."""
    torch.manual_seed(SEED + rank)
    return ConditionalNet().to(dtype)


def lane_batch(step: int, lane: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + lane)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, y


MUON_NAMES = ("lora_a.weight", "lora_b.weight", "branch.weight", "lane0.weight", "mlp.weight")
"""The hidden matrices a Muon user would route to Muon (everything else to AdamW)."""


def muon_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    named = dict(model.named_parameters())
    muon = [named[n] for n in MUON_NAMES]
    adam = [p for n, p in named.items() if n not in MUON_NAMES]
    return muon, adam


def reference_run(world: int, steps: int,
                  make_opts: Callable[[ConditionalNet], list[torch.optim.Optimizer]],
                  net: Callable[[int], ConditionalNet] = seeded_net) -> dict:
    """Single process, plain torch: the lanes' mean loss on rank 0's initial model (``net(0)``),
    ``steps`` steps."""
    model = net(0)
    opts = make_opts(model)
    losses = []
    for step in range(steps):
        total = torch.zeros((), dtype=torch.float64)
        for lane in range(world):
            model.calls.fill_(step)  # each rank's model has seen ``step`` forwards
            total = total + model(*lane_batch(step, lane), lane)
        loss = total / world
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    model.calls.fill_(steps)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
            "state": {n: {k: (v.detach().clone() if torch.is_tensor(v) else v)
                          for k, v in opts[0].state[p].items()} for n, p in model.named_parameters()
                      if p in opts[0].state}}


# ------------------------------------------------------------------ a TP-able variant
class TPConditionalNet(ConditionalNet):
    """``ConditionalNet`` with Megatron-style pairs a tensor-parallel plan can split (see
    :func:`tp_conditional_plan`): ``branch`` -> ``branch_out``, ``lane0`` -> ``lane0_out`` and
    ``mlp`` -> ``mlp_out`` are trainable column -> row pairs, and ``base2`` -> ``base2_out`` a frozen
    pair (weights and biases ``requires_grad=False``) that every forward runs. Same conditions as the
    parent: ``branch`` pair on even ``calls``, ``lane0`` pair on lane 0 when ``calls % 3 != 2``."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, r: int = RANK_R) -> None:
        super().__init__(vocab, dim, r)
        self.branch_out = nn.Linear(dim, dim)
        self.lane0_out = nn.Linear(dim, dim)
        self.mlp_out = nn.Linear(dim, dim)
        self.base2 = nn.Linear(dim, dim)
        self.base2_out = nn.Linear(dim, dim)
        self.base2.requires_grad_(False)
        self.base2_out.requires_grad_(False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, lane: int) -> torch.Tensor:
        h = (self.emb(idx) + self.aux(idx)) * self.mix
        h = self.base(h) + self.lora_b(self.lora_a(h))
        h = h + self.base2_out(torch.tanh(self.base2(h)))
        if self.uses_branch():
            h = h + self.branch_out(torch.tanh(self.branch(h)))
        if self.uses_lane0(lane):
            h = h + self.lane0_out(torch.tanh(self.lane0(h)))
        h = h + self.mlp_out(F.relu(self.mlp(h)))
        logits = self.head(h)
        with torch.no_grad():
            self.calls += 1
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


TP_PAIRS = ("base2", "branch", "lane0", "mlp")
"""Column -> row pairs of :class:`TPConditionalNet` (``<name>`` column, ``<name>_out`` row)."""


def seeded_tp_net(rank: int, dtype: torch.dtype = torch.float64) -> TPConditionalNet:
    """Per-rank seeded :class:`TPConditionalNet`."""
    torch.manual_seed(SEED + rank)
    return TPConditionalNet().to(dtype)


def tp_conditional_plan(pairs: tuple[str, ...] = TP_PAIRS):
    """A :class:`lowband.plan.ModelPlan` splitting the given pairs of :class:`TPConditionalNet`."""
    from lowband.plan import ModelPlan, ParallelLinear

    linears = []
    for name in pairs:
        linears += [ParallelLinear(name, "column"), ParallelLinear(f"{name}_out", "row")]
    return ModelPlan(parallel_linears=tuple(linears), vocab_size=VOCAB)
