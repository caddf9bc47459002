"""Single-process pieces of GTP: fp8 block quantization, the buffer cache, options, 1-rank runtime."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lowband.comm import Comm, CommLedger
from lowband.parallel.gtp import GTPOptions, GTPRuntime, shard_embeddings, shard_linears
from lowband.parallel.gtp_cache import GTPBufferCache
from lowband.parallel.gtp_quant import (
    BlockSpec,
    check_block_rule,
    fp8_dequantize,
    fp8_pack,
    fp8_packet_bytes,
    fp8_quantize,
    fp8_unpack_gathered,
    quantize_dequantize,
)


def test_fp8_blocks_scale_independently_and_roundtrip():
    block = BlockSpec(2, 4)
    w = torch.randn(4, 8)
    w[:2, :4] *= 1000  # one block with a large range must not affect the others
    q, s = fp8_quantize(w, block)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 2)
    torch.testing.assert_close(s[0, 0], w[:2, :4].abs().max() / 448)
    torch.testing.assert_close(s[1, 1], w[2:, 4:].abs().max() / 448)
    back = fp8_dequantize(q, s, block)
    assert ((back - w).abs() <= 0.07 * w.abs() + 1e-6).all()  # e4m3: 3 mantissa bits
    assert torch.equal(fp8_quantize(torch.zeros(2, 4), block)[1], torch.ones(1, 1))


def test_fp8_packets_concatenate_like_the_full_weight():
    block = BlockSpec(2, 4)
    full = torch.randn(6, 8)
    packets = torch.cat([fp8_pack(full[r * 2:(r + 1) * 2], block) for r in range(3)])
    assert packets.numel() == 3 * fp8_packet_bytes(2, 8, block) == 3 * (16 + 2 * 4)
    out = torch.empty(6, 8)
    fp8_unpack_gathered(packets, 3, 2, 8, block, out)
    assert torch.equal(out, quantize_dequantize(full, "fp8", block))


def test_block_rule_and_bad_blocks():
    check_block_rule("fp8", BlockSpec(4, 8), 16, "w")
    check_block_rule("bf16", BlockSpec(4, 8), 12, "w")  # only fp8 has a block rule
    with pytest.raises(ValueError, match="in_features 12 is not a multiple of the fp8 block width 8"):
        check_block_rule("fp8", BlockSpec(4, 8), 12, "w")
    with pytest.raises(ValueError, match="block rows must be a positive int"):
        BlockSpec(0, 8)
    with pytest.raises(ValueError, match="not a multiple of block"):
        fp8_quantize(torch.zeros(3, 8), BlockSpec(2, 8))


def test_cache_affinity_parity_and_counters():
    c = GTPBufferCache()
    a = c.get("t1", (4, 4), torch.float32, "fwd", 0, torch.device("cpu"))
    b = c.get("t2", (4, 4), torch.float32, "fwd", 1, torch.device("cpu"))  # other parity: other buffer
    assert a.data_ptr() != b.data_ptr() and c.live_unsharded_bytes() == 128
    c.release(a)
    c.release(b)
    x = c.get("t3", (4, 4), torch.float32, "fwd", 0, torch.device("cpu"))  # reuses a
    c.release(x)
    again = c.get("t1", (4, 4), torch.float32, "fwd", 0, torch.device("cpu"))
    assert again is a and c.num_buffers() == 2 and c.high_water["fwd"] == 128
    with pytest.raises(ValueError, match="double release"):
        c.release(b)
    with pytest.raises(ValueError, match="still held"):
        c.clear()
    c.release(again)
    c.clear()
    assert c.num_buffers() == 0


def test_options_validation():
    assert GTPOptions(fp8_block=(4, 8)).fp8_block == BlockSpec(4, 8)
    for kw, msg in [({"gather_format": "int4"}, "gather_format"), ({"finalize_depth": -1}, "finalize_depth"),
                    ({"grad_mode": "token"}, "grad_mode"), ({"grad_wire_dtype": torch.int8}, "grad_wire_dtype")]:
        with pytest.raises(ValueError, match=msg):
            GTPOptions(**kw)
    with pytest.raises(TypeError, match="prefetch must be a bool"):
        GTPOptions(prefetch=1)
    with pytest.raises(TypeError, match="not both"):
        GTPRuntime(Comm(), GTPOptions(), prefetch=False)


def test_one_rank_runtime_matches_and_counts():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 5))
    model = copy.deepcopy(ref)
    ledger = CommLedger()
    rt = GTPRuntime(Comm(ledger=ledger))
    shard_embeddings(model, rt)
    shard_linears(model, rt)
    idx = torch.randint(0, 10, (3, 4))
    for _ in range(2):
        model(idx).square().mean().backward()
        ref(idx).square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    assert ledger.count(tag="gtp:ag:fwd") == 6 and ledger.count(tag="gtp:ag:bwd") == 2 * 2  # no emb bwd
    assert ledger.count(tag="gtp:rs") == 6 and rt.pending() == {"reduce_scatters": 0, "gathers": 0,
                                                                "held_buffers": 0}
    with torch.no_grad():  # inference: on-demand gathers, no chain state touched
        torch.testing.assert_close(model(idx), ref(idx))
    assert ledger.count(tag="gtp:ag:eval") == 3


def test_one_rank_fp8_state_dict_is_refused_not_padded():
    """With fp8 gathers a group of one still pads a weight's rows to the fp8 block: a plain ``state_dict()`` returned
    the padded shard under the weight's name (a (32, 32) '0.weight' for a Linear(32, 10)); now refused by name,
    while an unpadded weight (rows a multiple of the block) keeps its plain state_dict."""
    from lowband.parallel.gtp import GTPStateError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 10))
    shard_linears(model, GTPRuntime(Comm(), gather_format="fp8"))
    assert model[0].gtp.pad == 22
    with pytest.raises(GTPStateError, match=r"\(GTPLinear '0'\) would label its fp8-block padded shard \(32 rows\) "
                                            r"as the weight of 10 rows"):
        model.state_dict()
    with pytest.raises(GTPStateError, match="fp8-block padded shard"):
        model.load_state_dict({})
    whole = nn.Sequential(nn.Linear(32, 64))
    shard_linears(whole, GTPRuntime(Comm(), gather_format="fp8"))
    assert whole[0].gtp.pad == 0 and whole.state_dict()["0.weight"].shape == (64, 32)
