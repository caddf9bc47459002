"""``python -m lowband.sample --run runs/NAME --prompt "..."``: generate text from a trained run's model.

Loads ``<run>/model.safetensors`` + ``model.json`` (written at the end of training when ``run.export``
is true, the default; :func:`lowband.load_trained`), encodes the prompt with the byte tokenizer
(``[BOS]`` + its UTF-8 bytes), and extends it with :func:`lowband.model.generate.generate`: the context
is cropped to the model's ``seq_len`` window, candidates are the 256 byte ids plus BOS and EOS, and a
sample ends early at the first BOS or EOS it generates (the model ending its document). Each sample is
printed as the prompt plus its continuation, decoded as UTF-8 with ``errors="replace"``; several
samples (``--num-samples``) are separated by a line ``---``.

Options: ``--temperature`` (0 = greedy; default 0.8), ``--top-k`` (0 = no limit; default 0),
``--max-tokens`` (default 200), ``--seed`` (default 0: the same seed, model and device give the same
text), ``--device`` (cpu | cuda | cuda:N | auto), ``--num-samples`` (default 1, drawn as one batch).

Exit codes: 0 done; 2 a usage error, one line on stderr: the run directory or its model files are
missing (the message says how to get them), an empty prompt, a setting out of range, an unavailable
device. No communication.
"""

from __future__ import annotations

import argparse
import math
import sys

EXIT_USAGE = 2


class SampleError(ValueError):
    """A bad argument or run directory; reported as one line with exit code 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lowband.sample",
                                description="Generate text from the model a lowband training run exported.")
    p.add_argument("--run", required=True, help="the run directory (runs/NAME) holding model.safetensors")
    p.add_argument("--prompt", required=True, help="text to continue (not empty)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = all (default 0)")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens to generate per sample (default 200)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the draws (default 0)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto (default cpu)")
    p.add_argument("--num-samples", type=int, default=1, help="samples to draw (default 1)")
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
    return device


def sample_texts(args: argparse.Namespace) -> list[str]:
    """The decoded samples for parsed ``args`` (raises :class:`SampleError` or ``ValueError`` on bad input)."""
    if args.prompt == "":
        raise SampleError("--prompt is empty; give the text to continue")
    if args.max_tokens < 1:
        raise SampleError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.num_samples < 1:
        raise SampleError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.top_k < 0:
        raise SampleError(f"--top-k must be >= 0 (0 = no limit), got {args.top_k}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise SampleError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    device = _device(args.device)

    import torch

    from lowband.data.tokenizer import ByteTokenizer
    from lowband.model.generate import generate
    from lowband.model.trained import load_trained, read_meta

    meta = read_meta(args.run)  # TrainedModelError (a ValueError) for a missing dir or files
    if meta.get("tokenizer") != "bytes":
        raise SampleError(f"{args.run}: the model's tokenizer is {meta.get('tokenizer')!r}; this sampler encodes "
                          "with the byte tokenizer only")
    model = load_trained(args.run, device)
    tok = ByteTokenizer()
    prompt = tok.encode(args.prompt, bos=True)
    idx = torch.tensor([prompt] * args.num_samples, dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    out = generate(model, idx, args.max_tokens, args.temperature, args.top_k or None, generator,
                   context_len=int(meta["seq_len"]), vocab_limit=min(int(meta["vocab_size"]), tok.EOS + 1))
    texts = []
    for row in out.tolist():
        new = row[len(prompt):]
        end = next((i for i, t in enumerate(new) if t >= tok.n_bytes), len(new))  # BOS / EOS ends the sample
        texts.append(bytes(prompt[1:] + new[:end]).decode("utf-8", errors="replace"))
    return texts


def main(argv: list[str] | None = None) -> int:
    """Run the sampler; returns the exit code (see the module docstring)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or argparse's own usage error (2)
        return int(e.code or 0)
    try:
        texts = sample_texts(args)
    except ValueError as e:  # SampleError, TrainedModelError, a factory's ConfigError
        print(f"lowband.sample: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    for i, text in enumerate(texts):
        if i:
            print("---")
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
