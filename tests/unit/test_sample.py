"""Sampling (lowband.model.generate) and the ``python -m lowband.sample`` CLI (issue 14, point 4).

The model is a tiny seeded GPT; the run directory is written by hand in the format documented in
:mod:`lowband.train.trained` (the trainer's side is tests/distributed/test_export.py). Greedy decoding
is compared with an argmax rollout written out here; equality is exact, as both run the same forward
on the same windows.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

from lowband import sample
from lowband.data.tokenizer import ByteTokenizer
from lowband.model import GPT, GPTConfig
from lowband.model.generate import check_sampling, generate, next_token
from lowband.train.trained import FORMAT

REPO = Path(__file__).resolve().parents[2]
SEQ = 8


def tiny_gpt(seed: int = 0, vocab: int = 320) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab, seq_len=SEQ, n_layer=1, n_head=2, n_embd=16)).eval()
    with torch.no_grad():  # logits of a few units (not the init's ~0.01): greedy is well defined, no ties
        model.lm_head.weight.mul_(50)
    return model


def argmax_rollout(model: GPT, idx: torch.Tensor, steps: int, vocab_limit: int | None = None) -> torch.Tensor:
    """Greedy decoding by hand: the argmax of the last position over the last SEQ tokens, appended."""
    with torch.no_grad():
        for _ in range(steps):
            logits = model(idx[:, -SEQ:])[:, -1, :vocab_limit]
            idx = torch.cat((idx, logits.argmax(-1, keepdim=True)), dim=1)
    return idx


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def path_probability(model: GPT, out: torch.Tensor, start: int, temperature: float, top_k: int) -> float:
    """Probability that the sampler (top-k, temperature) draws exactly the tokens ``out[:, start:]``."""
    prob = 1.0
    with torch.no_grad():
        for t in range(start, out.shape[1]):
            values, ids = torch.topk(model(out[:, max(t - SEQ, 0):t])[:, -1, :], top_k)
            p = torch.softmax(values / temperature, -1)
            hit = ids == out[:, t:t + 1]
            prob *= float((p * hit).sum(-1).prod())
    return prob


def test_greedy_equals_the_argmax_rollout_and_crops_to_the_window() -> None:
    model = tiny_gpt()
    idx = torch.tensor([[256, 72, 105, 32, 116, 104, 101, 114, 101, 33, 10]])  # 11 > SEQ tokens: cropped
    out = generate(model, idx, 12, temperature=0.0)
    assert out.shape == (1, 23) and torch.equal(out[:, :11], idx)
    assert torch.equal(out, argmax_rollout(model, idx, 12))
    limited = generate(model, idx, 12, temperature=0.0, vocab_limit=258)
    assert torch.equal(limited, argmax_rollout(model, idx, 12, vocab_limit=258)) and int(limited.max()) < 258


def test_top_k_one_is_greedy_whatever_the_temperature() -> None:
    model = tiny_gpt(1)
    idx = torch.tensor([[256, 97], [256, 98]])
    greedy = generate(model, idx, 10, temperature=0.0)
    for seed, t in enumerate((0.5, 1.0, 3.0)):
        assert torch.equal(generate(model, idx, 10, temperature=t, top_k=1, generator=gen(seed)), greedy)


def test_sampling_is_deterministic_under_a_seed() -> None:
    model = tiny_gpt(2)
    idx = torch.tensor([[256, 120]] * 3)
    a = generate(model, idx, 20, temperature=1.0, top_k=50, generator=gen(7))
    b = generate(model, idx, 20, temperature=1.0, top_k=50, generator=gen(7))
    c = generate(model, idx, 20, temperature=1.0, top_k=50, generator=gen(8))
    assert torch.equal(a, b)
    # another seed draws a again, or the sampler draws the greedy path, with these probabilities (computed
    # from the model): both far below 1e-9, so a difference is what a working sampler must show
    greedy = generate(model, idx, 20, temperature=0.0)
    assert path_probability(model, a, 2, 1.0, 50) < 1e-9 and path_probability(model, greedy, 2, 1.0, 50) < 1e-9
    assert not torch.equal(a, c)
    assert not torch.equal(a, greedy)  # sampling is not silently greedy


def test_next_token_draws_only_among_the_top_k_with_the_softmax_of_logits_over_t() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, -1.0, 2.9]])
    draws = torch.cat([next_token(logits, 1.0, 3, gen(s)) for s in range(200)])
    assert set(draws.view(-1).tolist()) == {1, 3, 5}  # the 3 largest (all drawn: p >= 0.26 each, 200 tries)
    # the draw is the multinomial of softmax(top-k / T) with the same generator
    values, ids = torch.topk(logits, 3)
    expect = ids.gather(-1, torch.multinomial(torch.softmax(values / 0.7, -1), 1, generator=gen(3)))
    assert torch.equal(next_token(logits, 0.7, 3, gen(3)), expect)
    assert torch.equal(next_token(logits, 0.0, None, None), torch.tensor([[1]]))
    assert next_token(logits, 1.0, 100, gen(0)).item() in range(6)  # top_k above the vocabulary: all candidates


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"top_k": 0}, "top_k"), ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"), ({"max_new_tokens": -1}, "max_new_tokens"),
])
def test_bad_settings_raise_naming_the_argument(kwargs: dict, match: str) -> None:
    args = {"max_new_tokens": 3, "temperature": 1.0, "top_k": None} | kwargs
    with pytest.raises(ValueError, match=match):
        check_sampling(**args)
    with pytest.raises(ValueError, match=match):
        generate(tiny_gpt(), torch.tensor([[256]]), args["max_new_tokens"], args["temperature"], args["top_k"])


def test_generate_accepts_tuple_and_object_outputs_and_restores_train_mode() -> None:
    model = tiny_gpt(3)

    class Tuple(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model
            self.config = model.config

        def forward(self, idx: torch.Tensor):
            return self.inner(idx), None

    wrapped = Tuple().train()
    idx = torch.tensor([[256, 1, 2]])
    assert torch.equal(generate(wrapped, idx, 5, temperature=0.0), argmax_rollout(model, idx, 5))
    assert wrapped.training
    with pytest.raises(ValueError, match=r"shape \(B, T\)"):
        generate(model, torch.tensor([256]), 2)


# ---------------------------------------------------------------------------------------------- CLI
def write_run(run: Path, model: GPT) -> None:
    """The trainer's export files for ``model``, written as lowband.train.trained documents them."""
    run.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(run / "model.safetensors"))
    meta = {"format": FORMAT, "weights": "model.safetensors", "builder": "gpt", "gpt": model.config.to_dict(),
            "factory": None, "config": {}, "dtype": "float32", "tokenizer": "bytes",
            "vocab_size": model.config.vocab_size, "seq_len": SEQ, "forward": "targets", "strategy": "single",
            "world_size": 1, "step": 1, "source": "test"}
    (run / "model.json").write_text(json.dumps(meta))


def expected_greedy_text(model: GPT, prompt: str, tokens: int) -> str:
    tok = ByteTokenizer()
    ids = tok.encode(prompt)
    row = argmax_rollout(model, torch.tensor([ids]), tokens, vocab_limit=tok.EOS + 1)[0].tolist()
    new = row[len(ids):]
    end = next((i for i, t in enumerate(new) if t >= 256), len(new))
    return bytes(ids[1:] + new[:end]).decode("utf-8", errors="replace")


def test_cli_greedy_prints_the_prompt_and_the_argmax_continuation(tmp_path: Path, capsys) -> None:
    model = tiny_gpt(4)
    write_run(tmp_path / "r", model)
    assert sample.main(["--run", str(tmp_path / "r"), "--prompt", "héllo", "--temperature", "0",
                        "--max-tokens", "15"]) == 0
    out = capsys.readouterr().out
    assert out == expected_greedy_text(model, "héllo", 15) + "\n"
    assert out.startswith("héllo")


def test_cli_samples_are_deterministic_under_a_seed(tmp_path: Path, capsys) -> None:
    write_run(tmp_path / "r", tiny_gpt(5))
    argv = ["--run", str(tmp_path / "r"), "--prompt", "ab", "--max-tokens", "12", "--num-samples", "3",
            "--top-k", "40", "--temperature", "1.0"]
    assert sample.main([*argv, "--seed", "11"]) == 0
    first = capsys.readouterr().out
    assert sample.main([*argv, "--seed", "11"]) == 0
    assert capsys.readouterr().out == first
    assert first.count("\n---\n") == 2  # three samples, separated
    assert all(s.startswith("ab") for s in first.split("\n---\n"))


@pytest.mark.parametrize(("argv", "message"), [
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt", "x", "--temperature", "-1"], "--temperature must be"),
    (["--prompt", "x", "--temperature", "nan"], "--temperature must be"),
    (["--prompt", "x", "--top-k", "-1"], "--top-k must be >= 0"),
    (["--prompt", "x", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--prompt", "x", "--num-samples", "0"], "--num-samples must be >= 1"),
    (["--prompt", "x", "--device", "tpu"], "--device"),
])
def test_cli_bad_arguments_exit_2_with_one_line(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    write_run(tmp_path / "r", tiny_gpt())
    assert sample.main(["--run", str(tmp_path / "r"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lowband.sample: error: ") and message in err and err.count("\n") == 1


def test_cli_missing_run_or_model_exit_2_and_say_how_to_get_one(tmp_path: Path, capsys) -> None:
    assert sample.main(["--run", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "trained_without_export").mkdir()
    assert sample.main(["--run", str(tmp_path / "trained_without_export"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "no model.safetensors" in err and "run.export = true" in err and err.count("\n") == 1


@pytest.mark.filterwarnings("ignore:'lowband.sample' found in sys.modules:RuntimeWarning")  # runpy, imported
def test_python_dash_m_lowband_sample(tmp_path: Path) -> None:
    """The module runs as ``python -m lowband.sample``: exit 0 with text, 2 with one error line, 2 for
    argparse's own usage errors (a missing --prompt), 0 for --help."""
    model = tiny_gpt(6)
    write_run(tmp_path / "r", model)
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lowband.sample", *argv], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)

    ok = run("--run", str(tmp_path / "r"), "--prompt", "Hi", "--temperature", "0", "--max-tokens", "6")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == expected_greedy_text(model, "Hi", 6) + "\n"
    bad = run("--run", str(tmp_path / "missing"), "--prompt", "Hi")
    assert bad.returncode == 2 and bad.stderr.startswith("lowband.sample: error: run directory")
    for argv, code in ([["--run", str(tmp_path / "r")], 2], [["--help"], 0]):  # argparse's exits, as python -m
        with pytest.raises(SystemExit) as exit_, mock.patch.object(sys, "argv", ["lowband.sample", *argv]):
            runpy.run_module("lowband.sample", run_name="__main__")
        assert exit_.value.code == code, argv


# ------------------------------------------------------------- damaged runs, bytes, bounds (issue 21)
def run_main(tmp_path: Path, capsys, *argv: str) -> tuple[int, str, str]:
    code = sample.main(["--run", str(tmp_path / "r"), *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_error_line(err: str, *needles: str) -> None:
    assert err.startswith("lowband.sample: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "error: unexpected" not in err, err
    for n in needles:
        assert n in err, (n, err)


def test_nan_weights_are_refused_not_decoded_as_nul_bytes(tmp_path: Path, capsys) -> None:
    model = tiny_gpt(7)
    with torch.no_grad():
        model.lm_head.weight[3, 2] = float("nan")
    write_run(tmp_path / "r", model)
    code, out, err = run_main(tmp_path, capsys, "--prompt", "ab", "--temperature", "0", "--max-tokens", "5")
    assert code == 2 and "\x00" not in out
    assert_one_error_line(err, "NaN/inf", "lm_head.weight")


def test_non_finite_logits_raise_in_generate() -> None:
    from lowband.model.generate import NonFiniteLogitsError

    class Inf(torch.nn.Module):
        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(*idx.shape, 10)
            out[..., 4] = float("inf")
            return out

    for t in (0.0, 1.0):
        with pytest.raises(NonFiniteLogitsError, match="NaN/inf"):
            generate(Inf(), torch.tensor([[1]]), 3, temperature=t)


def test_a_non_utf8_prompt_byte_is_fed_as_that_byte(tmp_path: Path, capsys) -> None:
    """argv byte 0xE9 (Latin-1 'é') arrives in Python as the surrogate U+DCE9: the model must see 0xE9,
    not the three bytes ED B3 A9 that surrogatepass would give."""
    model = tiny_gpt(8)
    write_run(tmp_path / "r", model)
    code, out, _ = run_main(tmp_path, capsys, "--prompt", "a\udce9", "--temperature", "0", "--max-tokens", "6")
    assert code == 0
    row = argmax_rollout(model, torch.tensor([[256, 97, 0xE9]]), 6, vocab_limit=258)[0].tolist()
    new = row[3:]
    new = new[:next((i for i, t in enumerate(new) if t >= 256), len(new))]
    assert out == (b"a\xe9" + bytes(new)).decode("utf-8", errors="replace") + "\n"


def test_python_dash_m_lowband_sample_with_a_latin1_argv_byte(tmp_path: Path) -> None:
    model = tiny_gpt(8)
    write_run(tmp_path / "r", model)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "lowband.sample", "--run", str(tmp_path / "r"), "--prompt",
                           b"a\xe9", "--temperature", "0", "--max-tokens", "6"], cwd=REPO, env=env,
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    row = argmax_rollout(model, torch.tensor([[256, 97, 0xE9]]), 6, vocab_limit=258)[0].tolist()
    new = row[3:]
    new = new[:next((i for i, t in enumerate(new) if t >= 256), len(new))]
    assert proc.stdout == ((b"a\xe9" + bytes(new)).decode("utf-8", errors="replace") + "\n").encode()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "shape", "missing_tensor", "bad_gpt_field",
                                    "bad_seq_len"])
def test_a_damaged_or_mismatched_run_is_one_line_exit_2(tmp_path: Path, capsys, damage: str) -> None:
    model = tiny_gpt(9)
    write_run(tmp_path / "r", model)
    weights, meta_path = tmp_path / "r" / "model.safetensors", tmp_path / "r" / "model.json"
    meta = json.loads(meta_path.read_text())
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "garbage":
        weights.write_bytes(b"\xff" * 64)
    elif damage == "empty":
        weights.write_bytes(b"")
    elif damage == "shape":  # model.json says a wider model than the file holds
        meta["gpt"]["n_embd"] = 32
        meta_path.write_text(json.dumps(meta))
    elif damage == "missing_tensor":
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}, str(weights))
    elif damage == "bad_gpt_field":
        meta["gpt"]["n_wings"] = 2
        meta_path.write_text(json.dumps(meta))
    elif damage == "bad_seq_len":
        meta["seq_len"] = "eight"
        meta_path.write_text(json.dumps(meta))
    code, out, err = run_main(tmp_path, capsys, "--prompt", "ab", "--max-tokens", "3")
    assert code == 2 and out == ""
    assert_one_error_line(err, str(tmp_path / "r"))


@pytest.mark.parametrize("temperature", ["1e-300", "5e-324", "1e300", "1.7e308"])
def test_an_absurd_temperature_samples_without_nan_probabilities(tmp_path: Path, capsys, temperature: str) -> None:
    model = tiny_gpt(10)
    write_run(tmp_path / "r", model)
    code, out, err = run_main(tmp_path, capsys, "--prompt", "ab", "--temperature", temperature, "--max-tokens", "8")
    assert code == 0 and err == ""
    if float(temperature) < 1e-200:  # as good as greedy
        assert out == expected_greedy_text(model, "ab", 8) + "\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-tokens", str(sample.MAX_TOKENS + 1)], "--max-tokens must be >= 1 and <= 10,000"),
    (["--num-samples", str(sample.MAX_SAMPLES + 1)], "--num-samples must be >= 1 and <= 100"),
    (["--seed", str(2**64)], "--seed must be in"),
    (["--seed", "-1"], "--seed must be in"),
])
def test_max_tokens_num_samples_and_seed_are_bounded(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    write_run(tmp_path / "r", tiny_gpt())
    code, out, err = run_main(tmp_path, capsys, "--prompt", "x", *argv)
    assert code == 2 and out == ""
    assert_one_error_line(err, message)


def test_tokens_stream_one_write_per_token(tmp_path: Path) -> None:
    """Every generated token is handed to the writer as soon as it is drawn (the CLI flushes each)."""
    model = tiny_gpt(11)
    write_run(tmp_path / "r", model)
    args = sample._parser().parse_args(["--run", str(tmp_path / "r"), "--prompt", "ab", "--temperature", "0",
                                        "--max-tokens", "9"])
    pieces: list[str] = []
    sample.stream_samples(args, pieces.append)
    assert "".join(pieces) == expected_greedy_text(model, "ab", 9) + "\n"
    new = argmax_rollout(model, torch.tensor([[256, 97, 98]]), 9, vocab_limit=258)[0, 3:].tolist()
    n_new = next((i for i, t in enumerate(new) if t >= 256), len(new))
    assert n_new >= 3 and pieces[0] == "ab" and len(pieces) == 1 + n_new + 1  # prompt, one per token, newline


def test_generation_goes_past_the_context_window(tmp_path: Path, capsys) -> None:
    """``--max-tokens`` beyond the model's seq_len slides the window (the model sees the last SEQ tokens)."""
    model = tiny_gpt(12)
    write_run(tmp_path / "r", model)
    code, out, _ = run_main(tmp_path, capsys, "--prompt", "ab", "--temperature", "0", "--max-tokens", str(3 * SEQ))
    assert code == 0 and out == expected_greedy_text(model, "ab", 3 * SEQ) + "\n"
