"""``data.source = "text"``: your UTF-8 files, byte-tokenized into cached ``.bin`` shards (lowband.data.text)."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

import lowband.data.text as text_mod
from lowband.data import ByteTokenizer
from lowband.data.shards import read_shard
from lowband.data.text import TextSourceError, split_sizes, text_corpus, text_files
from lowband.train import preflight
from lowband.train.config import Config, ConfigError, validate

BOS = ByteTokenizer.BOS


@pytest.fixture(autouse=True)
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own cache root ($LOWBAND_CACHE_DIR), never the user's."""
    root = tmp_path / "cache"
    monkeypatch.setenv("LOWBAND_CACHE_DIR", str(root))
    return root


def _expected_stream(*texts: str) -> np.ndarray:
    ids: list[int] = []
    for t in texts:
        ids += [BOS, *t.encode("utf-8")]
    return np.array(ids, dtype=np.uint16)


def test_round_trip_one_file(tmp_path: Path) -> None:
    text = "héllo wörld ✓ — naïve 𝄞\nsecond line\n" * 5
    f = tmp_path / "a.txt"
    f.write_text(text, encoding="utf-8")
    train, val, folder = text_corpus(str(f), 0.1)
    stream = np.concatenate([train, val])
    np.testing.assert_array_equal(stream, _expected_stream(text))
    assert train.dtype == np.uint16 and val.dtype == np.uint16
    assert ByteTokenizer().decode(stream) == text  # BOS is skipped by decode: lossless round trip
    # the cache holds the same arrays in the .bin shard format
    np.testing.assert_array_equal(read_shard(folder / "train.bin"), train)
    np.testing.assert_array_equal(read_shard(folder / "val.bin"), val)


def test_glob_reads_files_in_sorted_order_each_with_bos(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("bravo\n")
    (tmp_path / "a.txt").write_text("alpha\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("charlie\n")
    (tmp_path / "skip.md").write_text("not matched\n")
    assert text_files(str(tmp_path / "*.txt")) == [tmp_path / "a.txt", tmp_path / "b.txt"]
    assert text_files(str(tmp_path / "**" / "*.txt")) == [tmp_path / "a.txt", tmp_path / "b.txt",
                                                          tmp_path / "sub" / "c.txt"]
    train, val, _ = text_corpus(str(tmp_path / "**" / "*.txt"), 0.25)
    np.testing.assert_array_equal(np.concatenate([train, val]), _expected_stream("alpha\n", "bravo\n", "charlie\n"))


@pytest.mark.parametrize(("n", "frac", "expected"), [
    (1001, 0.05, (951, 50)),   # round(50.05) = 50
    (1000, 0.05, (950, 50)),
    (31, 0.5, (15, 16)),       # round(15.5) = 16 (round half to even)
    (2, 0.01, (1, 1)),         # at least one validation token
    (10, 0.99, (1, 9)),        # at least one training token
])
def test_split_sizes(n: int, frac: float, expected: tuple[int, int]) -> None:
    assert split_sizes(n, frac) == expected


@pytest.mark.parametrize("frac", [0.0, 1.0, -0.1])
def test_split_sizes_rejects_fraction_outside_open_interval(frac: float) -> None:
    with pytest.raises(ValueError, match=r"val_fraction must be in \(0, 1\)"):
        split_sizes(100, frac)


def test_split_is_the_tail_of_the_stream(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_bytes(b"x" * 999 + b"\n")  # 1001 tokens with BOS
    train, val, _ = text_corpus(str(f), 0.05)
    assert (train.size, val.size) == (951, 50)
    assert int(train[0]) == BOS and bytes(val.astype(np.uint8)) == b"x" * 49 + b"\n"


def test_cache_is_reused_without_tokenizing_the_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     cache_root: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("some text to cache\n" * 10)
    train1, val1, folder1 = text_corpus(str(f), 0.1)
    assert folder1.parent == cache_root and folder1.name.startswith("text-")
    meta = json.loads((folder1 / "source.json").read_text())
    assert meta["train_tokens"] == train1.size and meta["val_tokens"] == val1.size
    digest = hashlib.sha256(f.read_bytes()).hexdigest()
    assert meta["key"]["files"] == [[f.stat().st_size, f"sha256-{digest}"]]  # keyed by content
    assert meta["paths"] == [str(f.resolve())]

    def no_tokenize(*a, **k):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(text_mod, "_file_tokens", no_tokenize)
    train2, val2, folder2 = text_corpus(str(f), 0.1)
    assert folder2 == folder1
    np.testing.assert_array_equal(train2, train1)
    np.testing.assert_array_equal(val2, val1)


def test_cache_is_rebuilt_when_a_file_changes(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("first version of the text\n" * 4)
    _, _, folder1 = text_corpus(str(f), 0.1)
    # same size, new content and a new modification time: a new key, re-tokenized
    f.write_text("FIRST VERSION OF THE TEXT\n" * 4)
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    train, val, folder2 = text_corpus(str(f), 0.1)
    assert folder2 != folder1
    np.testing.assert_array_equal(np.concatenate([train, val]), _expected_stream("FIRST VERSION OF THE TEXT\n" * 4))
    # a different split is a different cache too
    assert text_corpus(str(f), 0.2)[2] not in (folder1, folder2)
    # adding a file to the glob changes the key
    (tmp_path / "u.txt").write_text("more\n")
    assert text_corpus(str(tmp_path / "*.txt"), 0.1)[2] not in (folder1, folder2)


def test_same_size_edit_with_the_modification_time_kept_is_rebuilt(tmp_path: Path, cache_root: Path) -> None:
    # cp -p / rsync -a / tar x / touch -r: same size, same mtime, other bytes. The old cache must not be read.
    f = tmp_path / "t.txt"
    f.write_text("alpha beta gamma\n" * 8)
    _, _, folder1 = text_corpus(str(f), 0.1)
    st = f.stat()
    f.write_text("ALPHA BETA GAMMA\n" * 8)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    train, val, folder2 = text_corpus(str(f), 0.1)
    assert folder2 != folder1
    np.testing.assert_array_equal(np.concatenate([train, val]), _expected_stream("ALPHA BETA GAMMA\n" * 8))
    # the first cache is still there, untouched (nothing deletes a cache), and serves the first text again
    assert (folder1 / "source.json").is_file()
    f.write_text("alpha beta gamma\n" * 8)
    assert text_corpus(str(f), 0.1)[2] == folder1
    # a rename keeps the key (contents, not paths)
    f.rename(tmp_path / "renamed.txt")
    assert text_corpus(str(tmp_path / "renamed.txt"), 0.1)[2] == folder1
    assert sorted(p.name for p in cache_root.iterdir()) == sorted([folder1.name, folder2.name])


def test_a_file_edited_during_the_build_is_cached_under_the_bytes_read(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "t.txt"
    f.write_text("old old old\n" * 5)
    real_read = text_mod._read_file

    def read_after_edit(p: Path) -> bytes:  # the file changes between the key lookup and the build's read
        f.write_text("new new new\n" * 5)
        return real_read(p)

    monkeypatch.setattr(text_mod, "_read_file", read_after_edit)
    train, val, folder = text_corpus(str(f), 0.1)
    monkeypatch.setattr(text_mod, "_read_file", real_read)
    np.testing.assert_array_equal(np.concatenate([train, val]), _expected_stream("new new new\n" * 5))
    assert text_corpus(str(f), 0.1)[2] == folder  # keyed by what was tokenized: found again
    f.write_text("old old old\n" * 5)
    train, val, _ = text_corpus(str(f), 0.1)
    np.testing.assert_array_equal(np.concatenate([train, val]), _expected_stream("old old old\n" * 5))


def test_incomplete_cache_is_rebuilt(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("a text whose cache is interrupted\n" * 3)
    train, val, folder = text_corpus(str(f), 0.1)
    train, val = np.array(train), np.array(val)  # copies: the memory-mapped val.bin is overwritten below
    (folder / "source.json").unlink()  # written last: its absence means an interrupted build
    (folder / "val.bin").write_bytes(b"junk")
    train2, val2, folder2 = text_corpus(str(f), 0.1)
    assert folder2 == folder
    np.testing.assert_array_equal(train2, train)
    np.testing.assert_array_equal(val2, val)


def test_error_missing_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(TextSourceError) as e:
        text_corpus(missing)
    assert str(e.value) == f"data.path {missing!r}: no such file, and no file matches it as a glob"


def test_error_glob_matches_nothing(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("x")
    pattern = str(tmp_path / "*.txt")
    with pytest.raises(TextSourceError, match=r"no such file, and no file matches it as a glob"):
        text_corpus(pattern)


def test_error_directory(tmp_path: Path) -> None:
    with pytest.raises(TextSourceError) as e:
        text_corpus(str(tmp_path))
    assert str(e.value) == (f"data.path {str(tmp_path)!r} is a directory; name a file or a glob such as "
                            f"'{tmp_path}/*.txt'")


def test_error_empty_file(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("fine\n")
    (tmp_path / "b.txt").write_bytes(b"")
    with pytest.raises(TextSourceError) as e:
        text_corpus(str(tmp_path / "*.txt"))
    assert str(e.value) == f"data.path: {str(tmp_path / 'b.txt')!r} is empty"


def test_error_not_utf8_names_file_and_byte_offset(tmp_path: Path) -> None:
    f = tmp_path / "latin1.txt"
    f.write_bytes("café au lait".encode() + " crème".encode("latin-1"))  # é in latin-1 is 0xe8
    offset = len("café au lait cr".encode())
    with pytest.raises(TextSourceError) as e:
        text_corpus(str(f))
    assert str(e.value) == (f"data.path: {str(f)!r} is not UTF-8 text: byte 0xe8 at byte offset {offset} "
                            "(invalid continuation byte); convert it to UTF-8 (e.g. iconv -t UTF-8)")


def test_error_leaves_no_cache(tmp_path: Path, cache_root: Path) -> None:
    f = tmp_path / "bad.txt"
    f.write_bytes(b"ok \xff")
    with pytest.raises(TextSourceError, match="byte 0xff at byte offset 3"):
        text_corpus(str(f))
    assert not cache_root.exists() or not any(cache_root.iterdir())


def _text_cfg(path: str) -> Config:
    cfg = Config()
    cfg.data.source, cfg.data.path = "text", path
    cfg.model.seq_len, cfg.data.batch_size = 16, 2
    return cfg


def test_validate_text_rules() -> None:
    cfg = _text_cfg("")
    with pytest.raises(ConfigError, match=r"^data\.path must name a UTF-8 text file or a glob of "
                                          r"them when data\.source = text$"):
        validate(cfg)
    cfg = _text_cfg("x.txt")
    cfg.data.val_fraction = 1.0
    with pytest.raises(ConfigError, match=r"^data.val_fraction must be in \(0, 1\), got 1.0$"):
        validate(cfg)
    cfg = _text_cfg("x.txt")
    cfg.model.vocab_size = 200
    with pytest.raises(ConfigError, match=r"smaller than the byte tokenizer's 258 ids \(data.source = text\)"):
        validate(cfg)
    validate(_text_cfg("x.txt"))  # the file's existence is checked by the pre-flight, not by validate


def test_preflight_turns_text_errors_into_config_errors(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.txt")
    with pytest.raises(ConfigError) as e:
        preflight.check_data(_text_cfg(missing), 1)
    assert str(e.value) == f"data.path {missing!r}: no such file, and no file matches it as a glob"


def test_preflight_text_too_short_for_one_batch(tmp_path: Path) -> None:
    f = tmp_path / "short.txt"
    f.write_text("y" * 99)  # 100 tokens: 95 train, 5 validation at val_fraction 0.05
    cfg = _text_cfg(str(f))
    cfg.model.seq_len, cfg.data.batch_size = 16, 2
    # training: (95 - 1) // 16 = 5 windows >= 2 x 2 ranks; validation: (5 - 1) // 16 = 0 < 2 x 2
    with pytest.raises(ConfigError) as e:
        preflight.check_data(cfg, 2)
    assert str(e.value).startswith(f"data: data.path {str(f)!r} (validation split, the last data.val_fraction = "
                                   "0.05) has 5 tokens, 0 windows of model.seq_len = 16 (+1 target), fewer than one "
                                   "global batch")
    cfg.data.val_fraction = 0.5  # 50 / 50 tokens: 3 windows each, enough for one batch of 2 x 1
    preflight.check_data(cfg, 1)
    with pytest.raises(ConfigError, match=r"training split\) has 50 tokens, 3 windows"):
        preflight.check_data(cfg, 2)


def test_trainer_end_to_end_on_a_text_file(tmp_path: Path) -> None:
    from lowband.train.trainer import train

    f = tmp_path / "story.txt"
    f.write_text("The quick brown fox jumps over the lazy dog. " * 40)  # 1801 tokens
    cfg = _text_cfg(str(f))
    cfg.run.out_dir, cfg.run.name, cfg.run.steps, cfg.run.threads = str(tmp_path / "runs"), "own", 3, 1
    cfg.run.log_every, cfg.run.val_every, cfg.run.val_batches = 1, 0, 1
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head = 1, 32, 2
    cfg.strategy.name = "single"
    validate(cfg, world_size=1)
    preflight.check_data(cfg, 1)
    res = train(cfg, log=False)
    assert res.steps == 3
    assert res.final_loss is not None and math.isfinite(res.final_loss)
    assert res.final_val_loss is not None and math.isfinite(res.final_val_loss)
    # an untrained byte model starts near ln(320); three steps on English text cannot leave that range
    assert 0 < res.final_loss < 2 * math.log(320)
    assert res.run_dir == tmp_path / "runs" / "own"
    assert (res.run_dir / "metrics.jsonl").is_file()
    assert 'source = "text"' in (res.run_dir / "config.toml").read_text()


def _small_vocab_gpt(cfg: Config):
    from lowband.model import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=200, seq_len=cfg.model.seq_len, n_layer=1, n_head=2, n_embd=32))


def test_a_model_whose_plan_vocabulary_is_below_258_is_refused(tmp_path: Path) -> None:
    from lowband.train.trainer import train

    f = tmp_path / "t.txt"
    f.write_text("enough text for one batch of two windows\n" * 20)
    cfg = _text_cfg(str(f))
    cfg.run.steps, cfg.run.threads, cfg.strategy.name = 1, 1, "single"
    with pytest.raises(ConfigError, match=r"^the model's vocabulary \(200, from its plan\) is smaller than the "
                                          r"byte tokenizer's 258 ids \(data\.source = text\)$"):
        train(cfg, model_factory=_small_vocab_gpt, write_run_dir=False, log=False)
