"""``unsharded_copy(model, device=..., keep=...)`` and the DiLoCo export's bucketed average: a copy made
layer by layer onto another device, ranks that take part in the gathers and keep nothing, and an average
over replicas that never holds a second copy of the model on the device.

References: ``unsharded_copy(model)`` (the copy on the model's device, the form every other test checks
against the dense model) and one all-reduce of the whole model. Equality is bitwise: the same gathers move
the same bits, and an average is elementwise, so cutting the model into buckets changes no element's sum.
The ``meta`` device stands in for "another device than the model's" on a CPU machine: every tensor of the
copy must land there, the replicated rest included, which is what bounds an accelerator's extra memory when
a GPU run copies to ``"cpu"``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowband.comm import Comm, default_ledger
from lowband.parallel import unsharded_copy
from lowband.testing import run_ranks


def _gtp_model():
    from tests.external.test_gtp import _build

    return _build(True)[1]  # tied head and embedding (kept replicated), every other linear GTP-sharded


def _tp_model():
    from tests.external.test_tp import _build

    return _build(True)[1]


def _records(start: int) -> list[tuple[str, str, int, int]]:
    return [(r.op, r.tag, r.numel, r.wire_bytes) for r in default_ledger().records[start:]]


def _copies(kind: str) -> dict:
    model = _gtp_model() if kind == "gtp" else _tp_model()
    led = default_ledger()
    s0 = len(led.records)
    ref = unsharded_copy(model)
    s1 = len(led.records)
    meta = unsharded_copy(model, device="meta")
    s2 = len(led.records)
    host = unsharded_copy(model, device="cpu")
    s3 = len(led.records)
    kept = unsharded_copy(model, keep=dist.get_rank() == 0)  # rank 0 keeps; the others only take part
    s4 = len(led.records)
    seen: list[str] = []

    def double(layer: nn.Module) -> None:  # sees each gathered layer once, may change it in place
        seen.append(type(layer).__name__)
        layer.weight.mul_(2)

    doubled = unsharded_copy(model, device="meta", each_layer=double)
    host_doubled = unsharded_copy(model, each_layer=double)
    from lowband.parallel.dense import is_sharded_module

    outer = [n for n, m in model.named_modules() if is_sharded_module(m)]
    outer = [n for n in outer if not any(n.startswith(f"{o}.") for o in outer)]
    names = [n for n, _ in ref.named_parameters(remove_duplicate=False)]
    out = {
        "ref_records": _records(s0)[:s1 - s0], "meta_records": _records(s1)[:s2 - s1],
        "host_records": _records(s2)[:s3 - s2], "kept_records": _records(s3)[:s4 - s3],
        "kept_is_none": kept is None,
        "meta_devices": sorted({t.device.type for t in [*meta.parameters(), *meta.buffers()]}),
        "meta_names": [n for n, _ in meta.named_parameters(remove_duplicate=False)] == names,
        "meta_tied": meta.lm_head.weight is meta.transformer.wte.weight,
        "host_tied": host.lm_head.weight is host.transformer.wte.weight,
        "host_equal": all(torch.equal(a, b) and a.dtype == b.dtype for a, b in
                          zip(host.state_dict().values(), ref.state_dict().values(), strict=True))
        and list(host.state_dict()) == list(ref.state_dict()),
        "requires_grad": [p.requires_grad for p in host.parameters()] == [p.requires_grad for p in ref.parameters()],
        "types": sorted({type(m).__name__ for m in host.modules()} & {"Linear", "Embedding", "GTPLinear",
                                                                       "ColumnParallelLinear", "RowParallelLinear"}),
        "original_untouched": all(p.device.type == "cpu" for p in model.parameters()),
        "each_layer_calls": len(seen) == 2 * len(outer) > 0, "each_layer_meta": doubled is not None and all(
            t.device.type == "meta" for t in doubled.parameters()),
        "each_layer_applied": all(
            torch.equal(host_doubled.get_submodule(n).weight, 2 * ref.get_submodule(n).weight) for n in outer)
        and all(torch.equal(host_doubled.get_parameter(n), ref.get_parameter(n))
                for n, _ in ref.named_parameters() if not any(n.startswith(f"{o}.") for o in outer)),
    }
    if kept is not None:
        out["kept_equal"] = all(torch.equal(a, b) for a, b in
                                zip(kept.state_dict().values(), ref.state_dict().values(), strict=True))
    return out


@pytest.mark.parametrize(("kind", "world"), [("gtp", 2), ("gtp", 4), ("tp", 2)])
def test_a_copy_onto_another_device_and_ranks_that_keep_nothing(kind: str, world: int) -> None:
    res = run_ranks(_copies, world, kind)
    for r, o in enumerate(res):
        assert o["ref_records"] and o["ref_records"] == o["meta_records"] == o["host_records"] == o["kept_records"]
        assert o["meta_devices"] == ["meta"] and o["meta_names"] and o["meta_tied"]  # every tensor moved, ties kept
        assert o["host_equal"] and o["host_tied"] and o["requires_grad"] and o["original_untouched"]
        assert o["types"] == ["Embedding", "Linear"] or o["types"] == ["Linear"]
        assert o["kept_is_none"] == (r != 0)
        assert o["each_layer_calls"] and o["each_layer_meta"] and o["each_layer_applied"]
    assert res[0]["kept_equal"]


# ------------------------------------------------------------------------ the export's bucketed average
class _Mixed(nn.Module):
    """Tied weights, a bf16 parameter, a non-contiguous buffer, an integer buffer (not averaged), a frozen one."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(7, 5)
        self.head = nn.Linear(5, 7, bias=False)
        self.head.weight = self.emb.weight
        self.proj = nn.Linear(5, 3)
        self.narrow = nn.Parameter(torch.randn(4, 3, generator=g).to(torch.bfloat16))
        self.frozen = nn.Parameter(torch.randn(6, generator=g), requires_grad=False)
        self.register_buffer("tr", torch.randn(3, 4, generator=g).t())  # non-contiguous
        self.register_buffer("count", torch.tensor([seed, 2 * seed]))
        with torch.no_grad():
            for p in (self.emb.weight, self.proj.weight, self.proj.bias):
                p.copy_(torch.randn(p.shape, generator=g))


def _average(bucket_bytes: int) -> dict:
    from lowband.diloco.average import _host_copy
    from lowband.diloco.average import average_modules as _average_over

    comm = Comm(name="world")
    live = _Mixed(seed=1 + dist.get_rank())
    led = default_ledger()
    whole = _host_copy(live)
    _average_over(comm, live, whole, bucket_bytes=1 << 30)  # the reference: one all-reduce
    start = len(led.records)
    bucketed = _host_copy(live)
    _average_over(comm, live, bucketed, bucket_bytes=bucket_bytes)
    records = _records(start)
    in_place = _host_copy(live)
    _average_over(comm, in_place, in_place, bucket_bytes=bucket_bytes)  # source and destination alike
    _average_over(comm, live, None, bucket_bytes=bucket_bytes)  # a rank that keeps nothing still takes part
    before = {k: v.clone() for k, v in live.state_dict().items()}
    return {"records": records, "numel": sum(t.numel() for t in {id(t): t for t in [*live.parameters(),
                                                                                     *live.buffers()]}.values()
                                              if t.is_floating_point()),
            "bucketed": all(torch.equal(a, b) for a, b in zip(bucketed.state_dict().values(),
                                                              whole.state_dict().values(), strict=True)),
            "in_place": all(torch.equal(a, b) for a, b in zip(in_place.state_dict().values(),
                                                              whole.state_dict().values(), strict=True)),
            "whole": {k: v.clone() for k, v in whole.state_dict().items()},
            "bucketed_state": {k: v.clone() for k, v in bucketed.state_dict().items()}, "live": before,
            "tied": bucketed.head.weight is bucketed.emb.weight,
            "strides": bucketed.tr.stride() == live.tr.stride()}


@pytest.mark.parametrize("world", [2, 4])
def test_the_export_average_in_buckets_equals_one_all_reduce(world: int) -> None:
    bucket = 40  # bytes: 10 fp32 elements, so tensors span buckets and buckets span tensors
    res = run_ranks(_average, world, bucket)
    n = res[0]["numel"]
    for o in res:
        assert (o["in_place"] == o["bucketed"]) and o["tied"] and o["strides"]
        assert o["bucketed"] or world > 2  # 2 terms: a + b in any order; more: gloo's order follows the buckets
        # one all-reduce of the digests first, then every element differs on some rank (seeded per rank): all travel
        assert [r[:2] for r in o["records"]] == ([("all_reduce", "average:digests")]
                                                 + [("all_reduce", "average")] * -(-n // 10))
        assert sum(r[2] for r in o["records"][1:]) == n
    lives = [o["live"] for o in res]
    for form in ("whole", "bucketed_state"):
        for k, v in res[0][form].items():  # the average itself, against the replicas' own values
            if not v.is_floating_point():
                assert v.equal(lives[0][k])  # integer buffers are not averaged
                continue
            mean = sum(lv[k].double() for lv in lives) / world
            magnitude = sum(lv[k].double().abs() for lv in lives) / world
            # an fp32 sum of `world` terms in any order (world - 1 roundings of at most eps/2 of the running sum)
            # and the division, then one rounding to v's dtype (bf16 for `narrow`)
            bound = world * torch.finfo(torch.float32).eps * magnitude + torch.finfo(v.dtype).eps * mean.abs()
            assert ((v.double() - mean).abs() <= bound).all(), (form, k)
            assert all(o[form][k].equal(v) for o in res)  # every rank holds the same average
