"""``python -m lowband.sample --run runs/NAME --prompt "..."``: generate text from a trained run's model.

Loads ``<run>/model.safetensors`` + ``model.json`` (written at the end of training when ``run.export``
is true, the default; :func:`lowband.load_trained`), encodes the prompt with the byte tokenizer
(``[BOS]`` + the prompt's bytes exactly as given on the command line: a byte that is not UTF-8 is fed
as that byte, ``os.fsencode``), and extends it with :func:`lowband.model.generate.iter_tokens`: the
context is cropped to the model's ``seq_len`` window (generation goes on past it, the model seeing the
last ``seq_len`` tokens), candidates are the 256 byte ids plus BOS and EOS, and a sample ends early at
the first BOS or EOS it generates (the model ending its document). Each sample is printed as the
prompt plus its continuation, decoded as UTF-8 with ``errors="replace"``, and streamed: every token is
written (and flushed) as soon as it is drawn. Several samples (``--num-samples``) are drawn one after
another from the one seeded generator and separated by a line ``---``.

Options: ``--temperature`` (0 = greedy; default 0.8; any finite value > 0 is well defined), ``--top-k``
(0 = no limit; default 0), ``--max-tokens`` (default 200, at most :data:`MAX_TOKENS`), ``--seed``
(default 0: the same seed, model and device give the same text), ``--device`` (cpu | cuda | cuda:N |
auto), ``--num-samples`` (default 1, at most :data:`MAX_SAMPLES`).

Exit codes: 0 done; 2 a usage error or an unusable run, one line on stderr: the run directory or its
model files are missing (the message says how to get them), ``model.json`` / ``model.safetensors``
damaged (truncated, corrupt) or not matching each other (names, shapes), weights or logits that are
NaN/inf, an empty prompt, a setting out of range, an unavailable device; 1 an unexpected error (a bug:
one line naming it; ``LOWBAND_DEBUG=1`` prints the traceback); 130 interrupted (Ctrl-C). No
communication.
"""

from __future__ import annotations

import argparse
import codecs
import math
import os
import sys
import traceback
from collections.abc import Callable

EXIT_USAGE = 2
EXIT_BUG = 1
MAX_TOKENS = 10_000
"""Largest ``--max-tokens`` (tokens generated per sample)."""
MAX_SAMPLES = 100
"""Largest ``--num-samples``."""
MAX_SEED = 2**63 - 1
PREFIX = "lowband.sample"


class SampleError(ValueError):
    """A bad argument or run directory; reported as one line with exit code 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lowband.sample",
                                description="Generate text from the model a lowband training run exported.")
    p.add_argument("--run", required=True, help="the run directory (runs/NAME) holding model.safetensors")
    p.add_argument("--prompt", required=True, help="text to continue (not empty); its bytes are fed as given")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = all (default 0)")
    p.add_argument("--max-tokens", type=int, default=200,
                   help=f"tokens to generate per sample, 1 to {MAX_TOKENS:,} (default 200)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the draws (default 0)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto (default cpu)")
    p.add_argument("--num-samples", type=int, default=1, help=f"samples to draw, 1 to {MAX_SAMPLES} (default 1)")
    return p


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise SampleError(f"--device {name!r} is not a device (cpu | cuda | cuda:N | auto)") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SampleError(f"--device {name}: CUDA is not available here; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise SampleError(f"--device {name!r}: use cpu | cuda | cuda:N | auto")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise SampleError(f"--device {name}: only {torch.cuda.device_count()} GPU(s) are visible")
    return device


def check_args(args: argparse.Namespace) -> bytes:
    """Raise :class:`SampleError` for an out-of-range argument; the prompt's bytes as given."""
    prompt = os.fsencode(args.prompt)  # the bytes of argv: an invalid UTF-8 byte stays that byte
    if not prompt:
        raise SampleError("--prompt is empty; give the text to continue")
    if not 1 <= args.max_tokens <= MAX_TOKENS:
        raise SampleError(f"--max-tokens must be >= 1 and <= {MAX_TOKENS:,}, got {args.max_tokens}")
    if not 1 <= args.num_samples <= MAX_SAMPLES:
        raise SampleError(f"--num-samples must be >= 1 and <= {MAX_SAMPLES}, got {args.num_samples}")
    if args.top_k < 0:
        raise SampleError(f"--top-k must be >= 0 (0 = no limit), got {args.top_k}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise SampleError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if not 0 <= args.seed <= MAX_SEED:
        raise SampleError(f"--seed must be in [0, 2**63 - 1], got {args.seed}")
    return prompt


def stream_samples(args: argparse.Namespace, write: Callable[[str], None]) -> None:
    """Generate for parsed ``args``, calling ``write`` with each piece of text as soon as it is decoded
    (the prompt, then every token's text, ``"\\n"`` at the end of a sample, ``"---\\n"`` between samples).

    Raises:
        SampleError, TrainedModelError, NonFiniteLogitsError (all ``ValueError``): bad input or an
            unusable run.
    """
    prompt = check_args(args)
    device = _device(args.device)

    import torch

    from lowband.data.tokenizer import ByteTokenizer
    from lowband.model.generate import context_len_of, iter_tokens
    from lowband.train.trained import load_trained, read_meta

    meta = read_meta(args.run)  # TrainedModelError (a ValueError) for a missing dir or damaged files
    if meta.get("tokenizer") != "bytes":
        raise SampleError(f"{args.run}: the model's tokenizer is {meta.get('tokenizer')!r}; this sampler encodes "
                          "with the byte tokenizer only")
    model = load_trained(args.run, device)  # refuses damaged, mismatched or non-finite weights
    tok = ByteTokenizer()
    window = min(int(meta["seq_len"]), context_len_of(model) or int(meta["seq_len"]))
    vocab_limit = min(int(meta["vocab_size"]), tok.EOS + 1)
    ids = [tok.BOS, *prompt]
    generator = torch.Generator(device=device).manual_seed(args.seed)
    for i in range(args.num_samples):
        if i:
            write("---\n")
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        write(decoder.decode(prompt))
        idx = torch.tensor([ids], dtype=torch.long, device=device)
        tokens = iter_tokens(model, idx, args.max_tokens, args.temperature, args.top_k or None, generator,
                             context_len=window, vocab_limit=vocab_limit)
        try:
            for token in tokens:
                t = int(token)
                if t >= tok.n_bytes:  # BOS / EOS: the model ended its document
                    break
                write(decoder.decode(bytes([t])))
        finally:
            tokens.close()
            write(decoder.decode(b"", final=True) + "\n")


def sample_texts(args: argparse.Namespace) -> list[str]:
    """The decoded samples for parsed ``args`` (raises ``ValueError`` on bad input; see :func:`stream_samples`)."""
    pieces: list[str] = []
    stream_samples(args, pieces.append)
    return "".join(pieces)[:-1].split("\n---\n")


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _error(line: str) -> None:
    print(f"{PREFIX}: error: {line}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the sampler; returns the exit code (see the module docstring)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or argparse's own usage error (2)
        return int(e.code or 0)
    try:
        stream_samples(args, _write_stdout)
    except ValueError as e:  # SampleError, TrainedModelError, NonFiniteLogitsError, a factory's ConfigError
        _error(" ".join(str(e).split()))
        return EXIT_USAGE
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except BrokenPipeError:  # `| head`: the reader left; no traceback
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except Exception as e:  # a bug: one line, the traceback only on request
        if os.environ.get("LOWBAND_DEBUG", "") not in ("", "0"):
            traceback.print_exc()
        text = " ".join(str(e).split())[:300]
        _error(f"unexpected {type(e).__name__}{': ' + text if text else ''} (not a lowband.sample error; please "
               "report it, or rerun with LOWBAND_DEBUG=1 to print the traceback)")
        return EXIT_BUG
    return 0


if __name__ == "__main__":
    sys.exit(main())
