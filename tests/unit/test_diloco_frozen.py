"""DiLoCo on one process: frozen parameters stay out of fragments, and the outer step of a parameter
no replica touched (issue 20): torchft's semantics with a torch outer optimizer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowband.diloco import StreamingDiLoCo, split_fragments


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.frozen = nn.Linear(3, 3).double().requires_grad_(False)
        self.a = nn.Linear(3, 3).double()
        self.late = nn.Linear(3, 3).double()  # used on the first step only
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(self.frozen(x))
        if self.steps == 0:
            h = h + self.late(h)
        self.steps += 1
        return h.square().mean()


def test_user_fragments_drop_frozen_parameters_and_refuse_a_frozen_only_one() -> None:
    model = Net()
    frags = split_fragments(model, [nn.ModuleList([model.frozen, model.a]), model.late])
    assert [f.names for f in frags] == [["a.weight", "a.bias"], ["late.weight", "late.bias"]]
    assert [f.names for f in split_fragments(model, 2)] == [["a.weight", "a.bias"], ["late.weight", "late.bias"]]
    with pytest.raises(ValueError, match=r"fragments\[0\] has only frozen parameters \(2, requires_grad=False; "
                                         r"init_sync covers them\)"):
        split_fragments(model, [model.frozen, model.a, model.late])
    # a list of parameters: the frozen ones are dropped too (never synced, never written)
    frags = split_fragments(model, [[model.frozen.weight, *model.a.parameters()], list(model.late.parameters())])
    assert frags[0].names == ["a.weight", "a.bias"]


def test_outer_momentum_moves_a_parameter_no_replica_touched_and_never_a_frozen_one() -> None:
    """``late`` gets gradients on step 1 only. Its first sync (after step 2) applies a non-zero
    pseudo-gradient and builds outer momentum; at its second sync the pseudo-gradient is exactly zero and
    torch's Nesterov SGD still moves it by ``lr * momentum^2 * buf`` (torchft sets ``.grad`` on every
    fragment parameter). The frozen linear is in no fragment and never changes."""
    model = Net()
    frozen0 = [p.detach().clone() for p in model.frozen.parameters()]
    late0 = model.late.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = StreamingDiLoCo(model, opt, sync_every=2, fragments=[model.a, model.late], delay=0, wire="fp64")
    assert [f.names for f in dl.frags] == [["a.weight", "a.bias"], ["late.weight", "late.bias"]]
    seen: list[torch.Tensor] = []
    dl.add_sync_callback(lambda d, i: seen.append(model.late.weight.detach().clone()) if i == 1 else None)
    x = torch.linspace(-1, 1, 12, dtype=torch.float64).view(4, 3)
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        model(x).backward()
        opt.step()
    dl.close()
    assert len(seen) == 2
    # replay in plain torch: step 1 moved ``late`` by the inner SGD, then nothing did
    replay = Net()
    h = replay.a(replay.frozen(x))
    (h + replay.late(h)).square().mean().backward()
    local = late0.clone().add_(replay.late.weight.grad, alpha=-0.1)
    ref = torch.optim.SGD([late := late0.clone()], lr=0.7, momentum=0.9, nesterov=True)
    late.grad = late0 - local  # first sync: the pseudo-gradient global - local
    ref.step()
    assert torch.equal(seen[0], late)
    late.grad = torch.zeros_like(late)  # the second sync: nobody touched it
    before = late.clone()
    ref.step()
    assert not torch.equal(late, before)  # momentum moved it
    assert torch.equal(seen[1], late)
    for p, p0 in zip(model.frozen.parameters(), frozen0, strict=True):
        assert torch.equal(p, p0) and not p.requires_grad
