"""A trained model as the trainer exports it, and :func:`load_trained` to rebuild it in one process.

The trainer (``run.export = true``, the default; :mod:`lowband.train.export`) writes two files to the
run directory at the end of every run:

``model.safetensors``
    Every entry of the plain (unsharded) model's ``state_dict()`` under its plain FQN (the names the
    ``single`` and ``ddp`` strategies use: ``blocks.0.attn.qkv.weight``), in the run's dtype, written
    with ``safetensors.torch.save_file``. Tied parameters (an output head tied to the embedding) are
    stored once, under the alphabetically first of their names; the file's metadata maps each dropped
    name to the kept one (``safetensors.torch.save_model``'s convention), and
    ``safetensors.torch.load_model`` restores the tie.

``model.json``
    How to rebuild the module before loading the weights (:data:`FORMAT` ``"lowband.model/1"``)::

        {"format": "lowband.model/1", "weights": "model.safetensors",
         "builder": "gpt" | "factory",
         "gpt": {GPTConfig fields} | null,       # builder gpt: lowband.model.GPT(GPTConfig(**gpt))
         "factory": "package.module:function" | null,   # builder factory: called as function(cfg)
         "config": {the run's full config, section -> key -> value},
         "dtype": "float32" | "float64" | "bfloat16",
         "tokenizer": "bytes", "vocab_size": int, "seq_len": int, "forward": "targets" | "logits",
         "strategy": str, "world_size": int, "step": int, "source": str}

    ``source`` says which copy was written (the model every rank holds, for DiLoCo the average of the
    replicas' models, or a fault-tolerant group's own model; see :mod:`lowband.train.export`).

Loading lowband's GPT needs only ``safetensors`` and :class:`lowband.model.GPT` (no trainer)::

    import json, safetensors.torch, torch
    from lowband.model import GPT, GPTConfig
    meta = json.load(open("runs/demo/model.json"))
    model = GPT(GPTConfig(**meta["gpt"])).to(getattr(torch, meta["dtype"]))
    model.load_state_dict(safetensors.torch.load_file("runs/demo/model.safetensors"))

No communication happens in this module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

FORMAT = "lowband.model/1"
WEIGHTS_FILE = "model.safetensors"
META_FILE = "model.json"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}

__all__ = ["DTYPES", "FORMAT", "META_FILE", "WEIGHTS_FILE", "TrainedModelError", "build_untrained",
           "load_trained", "read_meta"]


class TrainedModelError(ValueError):
    """A run directory without a usable exported model; the message says what is missing and how to get it."""


def read_meta(run_dir: str | Path) -> dict[str, Any]:
    """The parsed ``model.json`` of ``run_dir``, checked for the files and fields :func:`load_trained` needs.

    Raises:
        TrainedModelError: the directory, ``model.json`` or ``model.safetensors`` is missing, or
            ``model.json`` is not a lowband model description.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise TrainedModelError(f"run directory {str(run)!r} does not exist")
    meta_path, weights = run / META_FILE, run / WEIGHTS_FILE
    if not weights.is_file() or not meta_path.is_file():
        missing = WEIGHTS_FILE if not weights.is_file() else META_FILE
        raise TrainedModelError(f"{str(run)!r} has no {missing}: the trainer writes the model at the end of a run "
                                "with run.export = true (the default); train again with it on")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise TrainedModelError(f"{str(meta_path)!r} is not readable JSON ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise TrainedModelError(f"{str(meta_path)!r} is not a {FORMAT} model description (format {got!r})")
    if meta.get("dtype") not in DTYPES or meta.get("builder") not in ("gpt", "factory"):
        raise TrainedModelError(f"{str(meta_path)!r}: dtype must be one of {', '.join(DTYPES)} and builder gpt or "
                                f"factory; got {meta.get('dtype')!r}, {meta.get('builder')!r}")
    for key in ("vocab_size", "seq_len"):
        v = meta.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TrainedModelError(f"{str(meta_path)!r}: {key} must be a positive integer; got {v!r} (a damaged "
                                    "or hand-edited file? export the model again)")
    if meta["builder"] == "gpt" and not isinstance(meta.get("gpt"), dict):
        raise TrainedModelError(f"{str(meta_path)!r}: builder gpt needs the GPT's settings under \"gpt\"; got "
                                f"{type(meta.get('gpt')).__name__}")
    if meta["builder"] == "factory" and not isinstance(meta.get("config"), dict):
        raise TrainedModelError(f"{str(meta_path)!r}: builder factory needs the run's config under \"config\"")
    return meta


def build_untrained(meta: dict[str, Any], device: str | torch.device = "cpu") -> nn.Module:
    """The module ``meta`` (a ``model.json``) describes, with fresh weights, on ``device`` in its dtype.

    ``builder = "gpt"``: ``GPT(GPTConfig(**meta["gpt"]))``. ``builder = "factory"``: the run's config is
    rebuilt from ``meta["config"]`` and ``meta["factory"]`` is imported and called exactly as the trainer
    did (:func:`lowband.train.models.call_factory`: seeded with ``run.seed``, moved to the dtype); this
    path imports ``lowband.train.config`` (the factory takes its ``Config``) and the factory's module,
    which must be importable here.

    Raises:
        TrainedModelError: a factory model whose factory was a Python callable without an importable
            ``module:function`` name (pass it to ``train`` as ``model_factory`` from a module instead,
            or rebuild the model yourself and use ``safetensors.torch.load_model``).
    """
    dtype = DTYPES[meta["dtype"]]
    if meta["builder"] == "gpt":
        from lowband.model.gpt import GPT, GPTConfig

        return GPT(GPTConfig(**meta["gpt"])).to(device=device, dtype=dtype)
    spec = meta.get("factory")
    if not spec:
        raise TrainedModelError(f"the model was built by {meta.get('factory_repr', 'a Python callable')}, which has "
                                "no importable 'module:function' name; build the module yourself and load "
                                f"the weights with safetensors.torch.load_model(module, '{WEIGHTS_FILE}')")
    from lowband.train.config import config_from_dict
    from lowband.train.models import call_factory, load_factory

    cfg = config_from_dict(meta["config"])
    model, _plan = call_factory(load_factory(spec), cfg, torch.device(device))
    return model


def load_trained(run_dir: str | Path, device: str | torch.device = "cpu", *, check_finite: bool = True) -> nn.Module:
    """The model a run exported (``<run_dir>/model.safetensors`` + ``model.json``), in eval mode.

    Rebuilds the module (:func:`build_untrained`) and loads every tensor strictly (a missing or
    unexpected name is an error; tied parameters come back tied) with ``safetensors.torch.load_model``.

    Args:
        run_dir: the run directory (``<run.out_dir>/<run.name>``).
        device: where the model goes (``"cpu"``, ``"cuda"``, ``"cuda:1"`` ...).
        check_finite: refuse weights holding NaN or inf (one pass over them).

    Raises:
        TrainedModelError: see :func:`read_meta` and :func:`build_untrained`; also a ``model.json`` this
            version cannot build, a ``model.safetensors`` that is truncated, corrupt or does not match it
            (names, shapes), and non-finite weights.
    """
    from safetensors.torch import load_model

    meta = read_meta(run_dir)
    meta_path, weights = Path(run_dir) / META_FILE, Path(run_dir) / WEIGHTS_FILE
    try:
        model = build_untrained(meta, device)
    except TrainedModelError:
        raise
    except (TypeError, ValueError, KeyError) as e:  # GPTConfig(**gpt) with unknown or bad fields, a bad config
        from lowband.train.config import ConfigError

        if isinstance(e, ConfigError):  # the factory's own one-line error (model.factory = ...: ...)
            raise
        raise TrainedModelError(f"{str(meta_path)!r} does not describe a model this lowband can build "
                                f"({_first_line(e)})") from e
    try:
        load_model(model, str(weights), strict=True, device=str(device))
    except Exception as e:  # safetensors' own error (truncated, corrupt header), shape / name mismatch
        raise TrainedModelError(f"{str(weights)!r} cannot be loaded into the model {META_FILE} describes "
                                f"({_first_line(e)}); a damaged or mismatched run: export it again") from e
    if check_finite:
        for name, t in model.state_dict().items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                raise TrainedModelError(f"{str(weights)!r}: {name} holds {bad} NaN/inf value(s) of {t.numel()} (the "
                                        "run diverged, or the file is damaged); nothing meaningful can be sampled")
    return model.eval()


def _first_line(e: BaseException) -> str:
    """``Type: text`` in one line: the first informative line of ``e`` (a load_state_dict error's mismatch)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if len(lines) > 1 and lines[0].startswith("Error(s) in loading state_dict"):
        lines = lines[1:]
    text = "; ".join(lines)[:300]
    return f"{type(e).__name__}{': ' + text if text else ''}"
