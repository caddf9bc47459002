"""Reference GPT and hashed bigram embedding: shapes, init, exact formulas, float64 gradient checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from lowband.model import (
    GPT,
    GPTConfig,
    HashedBigramEmbedding,
    apply_rope,
    bigram_hash,
    bigram_hash_np,
    rope_cos_sin,
)

TINY = dict(vocab_size=32, seq_len=4, n_layer=1, n_head=2, n_embd=8, mlp_ratio=4)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny float64 models: one intra-op thread is faster than several on a shared, loaded CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("field,value,exc", [
    ("vocab_size", 0, ValueError), ("seq_len", -1, ValueError), ("n_layer", 0, ValueError),
    ("n_head", 0, ValueError), ("n_embd", 0, ValueError), ("mlp_ratio", 0, ValueError),
    ("bigram_rows", 1, ValueError), ("bigram_rows", -5, ValueError), ("rope_base", 0.0, ValueError),
    ("norm_eps", -1e-6, ValueError), ("n_embd", 2.5, TypeError), ("n_layer", True, TypeError),
    ("rope_base", float("nan"), ValueError),
])
def test_config_rejects_bad_field(field, value, exc):
    with pytest.raises(exc, match=field):
        GPTConfig(**{field: value})


def test_config_head_constraints():
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(n_embd=130, n_head=4)  # not divisible
    with pytest.raises(ValueError, match="head_dim"):
        GPTConfig(n_embd=12, n_head=4)  # head_dim 3 is odd
    assert GPTConfig(n_embd=12, n_head=2).head_dim == 6


# ---------------------------------------------------------------- bigram hash


def test_bigram_hash_hand_example():
    tokens = torch.tensor([3, 5, 7])
    # position 0 -> reserved row 999; then ((36313*x_i) ^ (27191*x_{i-1})) % 999
    assert bigram_hash(tokens, 1000).tolist() == [999, 277, 124]
    assert bigram_hash_np(np.array([3, 5, 7]), 1000).tolist() == [999, 277, 124]
    # and the same formula with plain Python ints on a 2-D batch, hashing along the last dim only
    rows = 11
    batch = [[0, 1, 65535, 300], [42, 42, 7, 0]]
    expect = [[rows - 1] + [((36313 * s[i]) ^ (27191 * s[i - 1])) % (rows - 1) for i in range(1, len(s))]
              for s in batch]
    assert bigram_hash(torch.tensor(batch), rows).tolist() == expect
    assert bigram_hash_np(np.array(batch, dtype=np.uint16), rows).tolist() == expect


@pytest.mark.parametrize("shape", [(1,), (17,), (3, 9), (2, 3, 5)])
@pytest.mark.parametrize("rows", [2, 3, 1000, 251_520])
def test_bigram_hash_torch_equals_numpy(shape, rows):
    g = torch.Generator().manual_seed(rows + len(shape))
    tokens = torch.randint(0, 65536, shape, generator=g)
    h = bigram_hash(tokens, rows)
    h_np = bigram_hash_np(tokens.numpy().astype(np.uint16), rows)
    assert h.dtype == torch.int64 and h_np.dtype == np.int64 and h.shape == tokens.shape
    np.testing.assert_array_equal(h.numpy(), h_np)
    # int32 input gives the same rows
    assert torch.equal(bigram_hash(tokens.to(torch.int32), rows), h)
    # reserved row at position 0 of every sequence, hashed rows elsewhere in [0, rows - 1)
    assert (h[..., 0] == rows - 1).all()
    assert (h[..., 1:] >= 0).all() and (h[..., 1:] < rows - 1).all()


def test_bigram_hash_bad_args():
    with pytest.raises(ValueError, match="rows"):
        bigram_hash(torch.tensor([1, 2]), 1)
    with pytest.raises(TypeError, match="rows"):
        bigram_hash_np(np.array([1, 2]), 10.0)
    with pytest.raises(TypeError, match="integer"):
        bigram_hash(torch.tensor([1.0, 2.0]), 10)
    with pytest.raises(TypeError, match="integer"):
        bigram_hash_np(np.array([1.0]), 10)
    with pytest.raises(ValueError, match="rows"):
        HashedBigramEmbedding(0, 4)
    assert bigram_hash(torch.zeros(2, 0, dtype=torch.int64), 5).shape == (2, 0)


def test_hashed_bigram_embedding_lookup_grad_and_gradcheck():
    emb = HashedBigramEmbedding(13, 3).double()
    assert torch.count_nonzero(emb.weight) == 0  # speedrun init: zeros
    with torch.no_grad():
        emb.weight.copy_(torch.randn(13, 3, dtype=torch.float64))
    idx = torch.tensor([[1, 2, 3, 4], [4, 4, 4, 4]])
    rows = bigram_hash(idx, 13)
    out = emb(idx)
    assert torch.equal(out, emb.weight[rows])
    # gradient touches exactly the hashed rows (plus the reserved row)
    out.square().sum().backward()
    touched = set(rows.flatten().tolist())
    nz = {i for i in range(13) if emb.weight.grad[i].abs().sum() > 0}
    assert nz == touched and 12 in touched
    # float64 gradcheck w.r.t. the table
    assert torch.autograd.gradcheck(lambda w: F.embedding(rows, w).sin().sum(-1),
                                    (emb.weight.detach().clone().requires_grad_(),))
    assert torch.autograd.gradcheck(lambda w: functional_call(emb, {"weight": w}, (idx,)).sin(),
                                    (emb.weight.detach().clone().requires_grad_(),))


# ---------------------------------------------------------------- GPT


def test_gpt_shapes_and_attribute_names():
    torch.manual_seed(0)
    for bigram_rows in (0, 50):
        cfg = GPTConfig(vocab_size=40, seq_len=8, n_layer=2, n_head=2, n_embd=16, bigram_rows=bigram_rows)
        model = GPT(cfg)
        idx = torch.randint(0, 40, (3, 8))
        assert model(idx).shape == (3, 8, 40)
        assert model(idx[:, :5]).shape == (3, 5, 40)
        loss = model(idx, idx)
        assert loss.shape == () and torch.isfinite(loss)
        assert (model.bigram is None) == (bigram_rows == 0)
        b = model.blocks[1]
        for mod in (b.attn.qkv, b.attn.proj, b.mlp.fc, b.mlp.proj, model.lm_head):
            assert isinstance(mod, nn.Linear) and mod.bias is None
        assert b.attn.qkv.weight.shape == (48, 16) and b.mlp.fc.weight.shape == (64, 16)
        assert b.norm1.weight.dim() == 1 and b.norm2.weight.dim() == 1 and model.norm.weight.dim() == 1
        assert model.lm_head.weight.data_ptr() != model.tok_emb.weight.data_ptr()
        expect = 40 * 16 * 2 + 2 * (48 * 16 + 16 * 16 + 2 * 64 * 16 + 2 * 16) + 16 + bigram_rows * 16
        assert model.num_params() == expect == sum(p.numel() for p in model.parameters())
        assert model.num_params(non_embedding=True) == expect - 40 * 16 - bigram_rows * 16


def test_gpt_init_deterministic_and_bigram_starts_silent():
    torch.manual_seed(0)
    a = GPT(GPTConfig(**TINY))
    torch.manual_seed(0)
    b = GPT(GPTConfig(**TINY, bigram_rows=7))
    torch.manual_seed(1)
    c = GPT(GPTConfig(**TINY))
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["tok_emb.weight"], c.state_dict()["tok_emb.weight"])
    assert torch.count_nonzero(b.bigram.weight) == 0
    std = a.blocks[0].attn.qkv.weight.std().item()
    assert 0.01 < std < 0.03
    idx = torch.randint(0, 32, (2, 4))
    assert torch.equal(a(idx), b(idx))  # zero table: bigram path adds nothing
    with torch.no_grad():
        b.bigram.weight.normal_()
    assert not torch.allclose(a(idx), b(idx))
    # init_weights with a generator is reproducible
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a.init_weights(g1)
    c.init_weights(g2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))


def test_gpt_loss_equals_manual_cross_entropy_float64():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, bigram_rows=9)).double()
    idx = torch.randint(0, 32, (3, 4))
    tgt = torch.randint(0, 32, (3, 4))
    logits = model(idx)
    assert logits.dtype == torch.float64
    manual = (torch.logsumexp(logits, -1) - logits.gather(-1, tgt[..., None])[..., 0]).mean()
    loss = model(idx, tgt)
    assert loss.dtype == torch.float64
    # float64: logsumexp over 32 logits, mean of 12: |err| <~ (32 + 12) eps |loss| ~ 1.7e-14 < 1e-14 + 1e-14 |loss|
    torch.testing.assert_close(loss, manual, rtol=1e-14, atol=1e-14)


def _manual_forward(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """Plain-tensor re-implementation: explicit RMSNorm, RoPE, masked softmax attention, ReLU² MLP."""
    cfg = model.config
    B, T = idx.shape
    hd = cfg.head_dim
    sd = {k: v.detach() for k, v in model.state_dict().items()}

    def rms(x, w):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    inv = torch.tensor([cfg.rope_base ** (-2 * j / hd) for j in range(hd // 2)], dtype=torch.float64)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]

    def rope(t):  # (B, H, T, hd): rotate pairs (t[j], t[j + hd/2]) by angle pos * inv[j]
        a, b = t[..., :hd // 2], t[..., hd // 2:]
        return torch.cat([a * ang.cos() + b * ang.sin(), b * ang.cos() - a * ang.sin()], -1)

    x = sd["tok_emb.weight"][idx]
    if model.bigram is not None:
        x = x + sd["bigram.weight"][bigram_hash(idx, cfg.bigram_rows)]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(cfg.n_layer):
        p = f"blocks.{i}."
        h = rms(x, sd[p + "norm1.weight"]) @ sd[p + "attn.qkv.weight"].T
        q, k, v = (t.reshape(B, T, cfg.n_head, hd).transpose(1, 2) for t in h.split(cfg.n_embd, -1))
        q, k = rope(q), rope(k)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, cfg.n_embd)
        x = x + y @ sd[p + "attn.proj.weight"].T
        h = torch.relu(rms(x, sd[p + "norm2.weight"]) @ sd[p + "mlp.fc.weight"].T) ** 2
        x = x + h @ sd[p + "mlp.proj.weight"].T
    return rms(x, sd["norm.weight"]) @ sd["lm_head.weight"].T


def test_gpt_forward_equals_plain_tensor_reference():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, seq_len=6, n_layer=2, n_head=2, n_embd=12, bigram_rows=9)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # non-trivial norms and bigram table
    idx = torch.randint(0, 40, (2, 6))
    # float64, the same math with other matmul blockings: ~(layers x width) eps ~ 1e-14 relative; 1e-12 is
    # independent of the kernel the CPU picks
    torch.testing.assert_close(model(idx), _manual_forward(model, idx), rtol=1e-12, atol=1e-12)


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY)).double()
    idx = torch.randint(0, 32, (1, 4))
    idx2 = idx.clone()
    idx2[0, 3] = (idx[0, 3] + 1) % 32
    a, b = model(idx), model(idx2)
    torch.testing.assert_close(a[:, :3], b[:, :3], rtol=0, atol=1e-14)
    assert not torch.allclose(a[:, 3], b[:, 3])


def test_gpt_gradcheck_float64():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**TINY, "mlp_ratio": 2}, bigram_rows=11)).double()
    with torch.no_grad():
        model.bigram.weight.normal_(0.0, 0.1)  # non-zero so every path is exercised
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    idx = torch.randint(0, 32, (2, 4))
    tgt = torch.randint(0, 32, (2, 4))
    names = ["blocks.0.attn.qkv.weight", "blocks.0.mlp.fc.weight", "blocks.0.norm1.weight", "bigram.weight"]
    params = dict(model.named_parameters())
    inputs = tuple(params[n].detach().clone().requires_grad_() for n in names)

    def loss_fn(*tensors):
        return functional_call(model, dict(zip(names, tensors)), (idx, tgt))

    assert torch.autograd.gradcheck(loss_fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)
    # autograd grads through the module match functional grads
    model.zero_grad()
    model(idx, tgt).backward()
    grads = torch.autograd.grad(loss_fn(*inputs), inputs)
    for n, g in zip(names, grads):
        # float64 gradients by two differently ordered backward passes: ~1e-14 relative, 100x below the bound
        torch.testing.assert_close(params[n].grad, g, rtol=1e-12, atol=1e-14)


def test_rope_hand_example_and_relative_positions():
    cos, sin = rope_cos_sin(3, 4, 100.0, torch.float64)
    # head_dim 4, base 100: inverse frequencies 1 and 1/10; pairs are (x[0], x[2]) and (x[1], x[3])
    angles = torch.tensor([[0.0, 0.0], [1.0, 0.1], [2.0, 0.2]], dtype=torch.float64)
    torch.testing.assert_close(cos, angles.cos(), rtol=0, atol=1e-15)  # cos within 1 ulp (1.1e-16) of |1|
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64).expand(1, 1, 3, 4)
    out = apply_rope(x, cos, sin)[0, 0, 2]
    c0, s0, c1, s1 = math.cos(2.0), math.sin(2.0), math.cos(0.2), math.sin(0.2)
    expect = [1 * c0 + 3 * s0, 2 * c1 + 4 * s1, 3 * c0 - 1 * s0, 4 * c1 - 2 * s1]
    # two products summed, values <= 5: a few ulps of 5 (~1e-15)
    torch.testing.assert_close(out, torch.tensor(expect, dtype=torch.float64), rtol=0, atol=1e-14)
    # rotation: norms kept; q.k depends only on the position difference
    cos, sin = rope_cos_sin(8, 6, 10000.0, torch.float64)
    q, k = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    rq = apply_rope(q.expand(1, 1, 8, 6), cos, sin)[0, 0]
    rk = apply_rope(k.expand(1, 1, 8, 6), cos, sin)[0, 0]
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(8), rtol=1e-14, atol=0)
    torch.testing.assert_close(rq[5] @ rk[3], rq[4] @ rk[2], rtol=1e-12, atol=1e-14)


def test_attention_heads_follow_qkv_width_column_parallel():
    """A qkv returning only some heads (as a column-parallel shard does) works unchanged, and the
    per-shard outputs through the matching proj column slices sum to the full attention output."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, seq_len=6, n_layer=1, n_head=4, n_embd=16)
    model = GPT(cfg).double()
    attn = model.blocks[0].attn
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    cos, sin = rope_cos_sin(6, cfg.head_dim, cfg.rope_base, torch.float64)
    full = attn(x, cos, sin)
    wq, wk, wv = attn.qkv.weight.detach().split(16, 0)
    wp = attn.proj.weight.detach()
    total = torch.zeros_like(full)
    hd = cfg.head_dim
    for shard in range(2):  # 2 TP ranks, 2 heads each
        rows = slice(shard * 2 * hd, (shard + 1) * 2 * hd)
        qkv = nn.Linear(16, 3 * 2 * hd, bias=False).double()
        proj = nn.Linear(2 * hd, 16, bias=False).double()
        with torch.no_grad():
            qkv.weight.copy_(torch.cat([wq[rows], wk[rows], wv[rows]]))
            proj.weight.copy_(wp[:, rows])
        local = type(attn).__new__(type(attn))
        nn.Module.__init__(local)
        local.head_dim, local.qkv, local.proj = hd, qkv, proj
        total += local(x, cos, sin)
    # float64: the head sum regrouped (width 16): ~16 eps relative ~ 4e-15, well inside 1e-12
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-14)
    bad = nn.Linear(16, 10, bias=False).double()
    attn.qkv = bad
    with pytest.raises(ValueError, match="head_dim"):
        attn(x, cos, sin)


def test_gpt_forward_input_errors():
    model = GPT(GPTConfig(**TINY))
    with pytest.raises(TypeError, match="idx"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        model(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="targets"):
        model(torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="GPTConfig"):
        GPT(dict(TINY))
