"""Byte tokenizer, .bin shards, built-in corpus and the distributed loader (single process)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

import lowband.data.corpus as corpus_mod
from lowband.data import (
    ByteTokenizer,
    DistributedLoader,
    ShardError,
    build_corpus,
    builtin_corpus,
    default_cache_dir,
    is_val_document,
    iter_documents,
    load_tokens,
    read_shard,
    write_shard,
)
from lowband.data.shards import HEADER_BYTES

# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", ["", "hello, world\n", "naïve café – ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 日本語 🙂👍🏽",
                                  "a\x00b\x7f\r\n\t", "lone \ud800 surrogate \udfff"])
def test_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.BOS == 256
    assert ids[1:] == list(text.encode("utf-8", "surrogatepass"))
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, bos=False, eos=True)) == text
    assert tok.decode(np.array(ids)) == text and tok.decode(torch.tensor(ids)) == text


def test_tokenizer_specials_and_errors():
    tok = ByteTokenizer()
    assert tok.vocab_size == 320 and tok.vocab_size % 64 == 0 and tok.EOS == 257
    assert tok.encode("ab", bos=False) == [97, 98]
    assert tok.encode("ab", eos=True) == [256, 97, 98, 257]
    assert tok.decode([256, 104, 257, 105, 300]) == "hi"
    assert tok.decode([0xFF, 104]) == "\ufffdh"  # invalid UTF-8 is replaced
    with pytest.raises(ValueError, match="320"):
        tok.decode([320])
    with pytest.raises(ValueError, match="outside"):
        tok.decode([-1])
    with pytest.raises(TypeError, match="text"):
        tok.encode(b"bytes")


# ---------------------------------------------------------------- shards


def test_shard_round_trip_and_header(tmp_path):
    tokens = np.array([0, 1, 255, 256, 65535, 7], dtype=np.int64)
    path = write_shard(tmp_path / "a.bin", tokens)
    raw = path.read_bytes()
    assert len(raw) == HEADER_BYTES + 2 * tokens.size
    header = np.frombuffer(raw[:HEADER_BYTES], dtype="<i4")
    assert header[:3].tolist() == [20240520, 1, 6] and not header[3:].any()
    got = read_shard(path)
    assert isinstance(got, np.memmap) and got.dtype == np.uint16
    np.testing.assert_array_equal(got, tokens)
    np.testing.assert_array_equal(np.frombuffer(raw[HEADER_BYTES:], dtype="<u2"), tokens)
    empty = write_shard(tmp_path / "e.bin", [])
    assert read_shard(empty).size == 0
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # temp files renamed away


def test_shard_write_refuses_bad_tokens(tmp_path):
    with pytest.raises(ValueError, match="65536"):
        write_shard(tmp_path / "x.bin", [1, 65536])
    with pytest.raises(ValueError, match="65536"):
        write_shard(tmp_path / "x.bin", [-1, 3])
    with pytest.raises(TypeError, match="integer"):
        write_shard(tmp_path / "x.bin", np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="1-D"):
        write_shard(tmp_path / "x.bin", np.zeros((2, 2), dtype=np.int64))
    assert not (tmp_path / "x.bin").exists()


def _corrupt(path, offset, value):
    data = bytearray(path.read_bytes())
    data[offset:offset + 4] = np.array([value], dtype="<i4").tobytes()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind,match", [
    ("missing", "no such"), ("short", "shorter than"), ("magic", "bad magic"), ("version", "version"),
    ("count_big", "header says 11 tokens"), ("truncated", "header says 10 tokens"),
    ("extra", "header says 10 tokens"),
])
def test_shard_corruption_errors(tmp_path, kind, match):
    path = write_shard(tmp_path / "s.bin", np.arange(10))
    if kind == "missing":
        path = tmp_path / "nope.bin"
    elif kind == "short":
        path.write_bytes(path.read_bytes()[:100])
    elif kind == "magic":
        _corrupt(path, 0, 12345)
    elif kind == "version":
        _corrupt(path, 4, 2)
    elif kind == "count_big":
        _corrupt(path, 8, 11)
    elif kind == "truncated":
        path.write_bytes(path.read_bytes()[:-2])
    elif kind == "extra":
        path.write_bytes(path.read_bytes() + b"\x00\x00")
    with pytest.raises(ShardError, match=match) as info:
        read_shard(path)
    assert isinstance(info.value, ValueError)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_load_tokens_concatenates_sorted(tmp_path):
    write_shard(tmp_path / "part_001.bin", [4, 5])
    write_shard(tmp_path / "part_000.bin", [1, 2, 3])
    write_shard(tmp_path / "other.bin", [9])
    np.testing.assert_array_equal(load_tokens(tmp_path / "part_*.bin"), [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(load_tokens(str(tmp_path / "other.bin")), [9])
    with pytest.raises(ShardError, match="no token shard files match"):
        load_tokens(tmp_path / "missing_*.bin")
    _corrupt(tmp_path / "part_001.bin", 0, 1)
    with pytest.raises(ShardError, match=r"part_001\.bin: bad magic"):
        load_tokens(tmp_path / "part_*.bin")


# ---------------------------------------------------------------- corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    cache = tmp_path_factory.mktemp("corpus")
    t0 = time.perf_counter()
    train, val = builtin_corpus(cache)
    return cache, train, val, time.perf_counter() - t0


def test_corpus_nonempty_and_cache_hit(corpus, monkeypatch):
    cache, train, val, _ = corpus
    tok = ByteTokenizer()
    assert train.dtype == np.uint16 and val.dtype == np.uint16
    assert train.size > 100_000 and val.size > 1_000
    assert train[0] == tok.BOS and val[0] == tok.BOS
    assert int(train.max()) <= tok.BOS and int(val.max()) <= tok.BOS
    assert (cache / "train.bin").is_file() and (cache / "val.bin").is_file()

    def no_build(*a, **k):
        raise AssertionError("cache miss: the corpus was rebuilt")

    monkeypatch.setattr(corpus_mod, "build_corpus", no_build)
    train2, val2 = builtin_corpus(cache)
    np.testing.assert_array_equal(train2, train)
    np.testing.assert_array_equal(val2, val)


def test_corpus_deterministic_and_split_by_document(corpus):
    _, train, val, _ = corpus
    docs = list(iter_documents())
    keys = [k for k, _ in docs]
    assert len(keys) == len(set(keys))
    assert any(k.startswith("pydoc:") for k in keys) and any(k.startswith("stdlib:") for k in keys)
    assert not any("/test/" in k or "/tests/" in k or "idlelib" in k or "site-packages" in k for k in keys)
    val_keys = {k for k in keys if is_val_document(k)}
    train_keys = set(keys) - val_keys
    assert val_keys and train_keys and not (val_keys & train_keys)
    # the cached arrays are exactly the documents of each split, each as [BOS] + utf-8 bytes
    tok = ByteTokenizer()
    expect = {True: [], False: []}
    for k, text in docs:
        expect[k in val_keys].extend(tok.encode(text))
    np.testing.assert_array_equal(train, np.array(expect[False], dtype=np.uint16))
    np.testing.assert_array_equal(val, np.array(expect[True], dtype=np.uint16))
    # the split is a stable hash, not the salted hash(): pin a few keys
    assert [is_val_document(f"k{i}") for i in range(40)].count(True) == sum(
        int.from_bytes(__import__("hashlib").blake2b(f"k{i}".encode(), digest_size=8).digest(), "little") % 20
        == 0 for i in range(40))


def test_corpus_rebuilds_corrupt_cache(tmp_path, monkeypatch):
    calls = []

    def fake_build():
        calls.append(1)
        return np.array([256, 1, 2, 3], dtype=np.uint16), np.array([256, 9], dtype=np.uint16)

    monkeypatch.setattr(corpus_mod, "build_corpus", fake_build)
    train, val = builtin_corpus(tmp_path)
    assert calls == [1] and train.tolist() == [256, 1, 2, 3] and val.tolist() == [256, 9]
    builtin_corpus(tmp_path)
    assert calls == [1]
    (tmp_path / "val.bin").write_bytes(b"garbage")
    train, val = builtin_corpus(tmp_path)
    assert calls == [1, 1] and val.tolist() == [256, 9]


def test_corpus_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("LOWBAND_CACHE_DIR", str(tmp_path))
    d = default_cache_dir()
    assert d.parent == tmp_path and d.name.startswith("corpus-3.")


def test_build_corpus_small_stdlib_dir(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "pkg" / "m.py").write_text('"""Module doc."""\nclass A:\n    """Class doc."""\n'
                                           'def f():\n    """Func doc."""\n')
    (tmp_path / "tests" / "t.py").write_text('"""skipped"""\n')
    (tmp_path / "broken.py").write_text('"""never seen"""\ndef (:\n')
    docs = [(k, t) for k, t in iter_documents(tmp_path) if k.startswith("stdlib:")]
    assert docs == [("stdlib:pkg/m.py", "Module doc.\n\nClass doc.\n\nFunc doc.")]
    train, val = build_corpus(tmp_path)
    assert train.dtype == np.uint16 and train.size + val.size > 0


# ---------------------------------------------------------------- loader


def _tokens(n=1000, seed=0):
    return np.random.default_rng(seed).integers(0, 320, n).astype(np.uint16)


def test_loader_windows_shift_and_content():
    tokens = _tokens(401)
    ld = DistributedLoader(tokens, batch_size=3, seq_len=8, rank=0, world_size=1, seed=3)
    assert ld.n_windows == 50
    for step in range(5):
        x, y = ld.batch(step)
        assert x.dtype == torch.int64 and x.shape == y.shape == (3, 8)
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert x.is_contiguous() and y.is_contiguous()
        for row, w in zip(range(3), ld.windows(step)):
            assert x[row].tolist() == tokens[w * 8:w * 8 + 8].tolist()
            assert y[row].tolist() == tokens[w * 8 + 1:w * 8 + 9].tolist()


def test_loader_deterministic_and_seed_dependent():
    tokens = _tokens()
    a = DistributedLoader(tokens, 4, 16, rank=1, world_size=2, seed=7)
    b = DistributedLoader(tokens, 4, 16, rank=1, world_size=2, seed=7)
    c = DistributedLoader(tokens, 4, 16, rank=1, world_size=2, seed=8)
    for step in (0, 3, 11):
        assert all(torch.equal(u, v) for u, v in zip(a.batch(step), b.batch(step)))
    assert not all(np.array_equal(a.windows(s), c.windows(s)) for s in range(3))


def test_loader_epochs_are_permutations_and_ranks_disjoint():
    tokens = _tokens(24 * 10 + 1)  # 24 windows of seq_len 10
    loaders = [DistributedLoader(tokens, 2, 10, rank=r, world_size=4, seed=1) for r in range(4)]
    seen_epoch0 = []
    for step in range(3):  # G = 8: 3 steps = exactly one epoch
        ws = [ld.windows(step) for ld in loaders]
        flat = np.concatenate(ws)
        assert len(set(flat.tolist())) == 8  # disjoint across ranks within the step
        seen_epoch0.extend(flat.tolist())
    assert sorted(seen_epoch0) == list(range(24))
    # epoch 1 uses a different order from epoch 0
    epoch1 = np.concatenate([ld.windows(s) for s in range(3, 6) for ld in loaders])
    assert sorted(epoch1.tolist()) == list(range(24)) and not np.array_equal(epoch1, seen_epoch0)


def test_loader_stream_formula_drops_epoch_tail():
    """Step s = step s % S of epoch s // S (S = W // G) reads perm_e[(s % S) * G + r * B : ... + B]."""
    tokens = _tokens(23 * 7 + 3)  # W = 23 windows
    B, N, seed = 2, 3, 4
    G, W = B * N, 23
    S = W // G  # 3 steps per epoch; 5 windows of each epoch's permutation are dropped
    loaders = [DistributedLoader(tokens, B, 7, rank=r, world_size=N, seed=seed) for r in range(N)]
    assert loaders[0].steps_per_epoch == S and loaders[0].epoch_of(7) == 2
    for step in range(10):
        perm = np.random.default_rng([seed, step // S]).permutation(W)
        for r, ld in enumerate(loaders):
            start = (step % S) * G + r * B
            assert ld.windows(step).tolist() == perm[start:start + B].tolist()
        flat = np.concatenate([ld.windows(step) for ld in loaders])
        assert len(set(flat.tolist())) == G  # disjoint even at epoch ends


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_loader_rank_concat_equals_single_process(world_size):
    tokens = _tokens(23 * 7 + 3)  # 23 windows: global batches wrap epochs mid-step
    bs = 3
    single = DistributedLoader(tokens, bs * world_size, 7, rank=0, world_size=1, seed=5)
    ranks = [DistributedLoader(tokens, bs, 7, rank=r, world_size=world_size, seed=5)
             for r in range(world_size)]
    for step in range(12):
        xs, ys = zip(*(ld.batch(step) for ld in ranks))
        x1, y1 = single.batch(step)
        assert torch.equal(torch.cat(xs), x1) and torch.equal(torch.cat(ys), y1)
        flat = np.concatenate([ld.windows(step) for ld in ranks])
        assert len(set(flat.tolist())) == flat.size


def test_loader_resume():
    tokens = _tokens()
    ld = DistributedLoader(tokens, 2, 16, rank=1, world_size=3, seed=2)
    run = [next(ld) for _ in range(9)]
    assert ld.state_dict()["step"] == 9
    ref = DistributedLoader(tokens, 2, 16, rank=1, world_size=3, seed=2)
    k = 4
    for _ in range(k):
        next(ref)
    state = ref.state_dict()
    resumed = DistributedLoader(tokens, 2, 16, rank=1, world_size=3, seed=2)
    resumed.load_state_dict(state)
    started = DistributedLoader(tokens, 2, 16, rank=1, world_size=3, seed=2, start_step=k)
    for i in range(k, 9):
        for other in (next(ref), next(resumed), next(started)):
            assert torch.equal(other[0], run[i][0]) and torch.equal(other[1], run[i][1])
    # batch() is random access and does not move the iterator
    step = resumed.step
    assert torch.equal(resumed.batch(2)[0], run[2][0]) and resumed.step == step
    # same global batch on another world size resumes too; a different seed does not
    DistributedLoader(tokens, 3, 16, rank=0, world_size=2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        DistributedLoader(tokens, 2, 16, rank=1, world_size=3, seed=9).load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch"):
        DistributedLoader(tokens, 2, 16, rank=1, world_size=2, seed=2).load_state_dict(state)


def test_loader_accepts_tensor_and_memmap(tmp_path):
    tokens = _tokens(300)
    path = write_shard(tmp_path / "t.bin", tokens)
    a = DistributedLoader(read_shard(path), 2, 5, rank=0, world_size=2)
    b = DistributedLoader(torch.from_numpy(tokens.astype(np.int64)), 2, 5, rank=0, world_size=2)
    assert torch.equal(a.batch(3)[0], b.batch(3)[0])


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(batch_size=0), ValueError, "batch_size"), (dict(seq_len=0), ValueError, "seq_len"),
    (dict(rank=2, world_size=2), ValueError, "rank"), (dict(world_size=0), ValueError, "world_size"),
    (dict(seed=-1), ValueError, "seed"), (dict(start_step=-1), ValueError, "start_step"),
    (dict(batch_size=2.0), TypeError, "batch_size"),
    (dict(batch_size=5, world_size=2, seq_len=10), ValueError, r"9 windows.*5\*2 = 10"),
])
def test_loader_bad_args(kwargs, exc, match):
    args = dict(batch_size=2, seq_len=4, rank=0, world_size=1, seed=0, start_step=0)
    args.update(kwargs)
    tokens = _tokens(100)  # 99 // 10 = 9 windows of seq_len 10: too short for a global batch of 10
    with pytest.raises(exc, match=match):
        DistributedLoader(tokens, **args)


def test_loader_too_short_message():
    with pytest.raises(ValueError, match=r"100 tokens give 9 windows.*needs .*10 windows \(101 tokens\)"):
        DistributedLoader(_tokens(100), 5, 10, rank=0, world_size=2)
    DistributedLoader(_tokens(101), 5, 10, rank=1, world_size=2)  # exactly enough
    with pytest.raises(TypeError, match="integer"):
        DistributedLoader(np.zeros(100), 1, 4, rank=0, world_size=1)


def test_bin_source_holds_its_validation_tail_out_of_training(tmp_path) -> None:
    """data.source = bin without data.val_bin: validation is the last 1/20 of the tokens, and training the rest
    (validation tokens were trained on too, so val_loss was measured on training data)."""
    from lowband.data.shards import write_shard
    from lowband.train.config import Config
    from lowband.train.trainer import load_token_arrays

    write_shard(tmp_path / "t.bin", np.arange(1000) % 256)
    cfg = Config()
    cfg.data.source, cfg.data.train_bin = "bin", str(tmp_path / "t.bin")
    train, val = load_token_arrays(cfg, None)  # type: ignore[arg-type]  # the bin source needs no ranks
    assert len(train) == 950 and len(val) == 50
    assert np.array_equal(np.concatenate([train, val]), np.arange(1000) % 256)
    assert not np.shares_memory(train, val)
