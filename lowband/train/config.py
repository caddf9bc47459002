"""Trainer configuration: dataclass sections, a TOML file, and ``--section.key=value`` overrides.

Each section is a dataclass whose attribute docstrings are the schema. ``load_config(path, overrides)``
reads the TOML file (``tomllib``), applies the overrides, type-checks every value against the field's
type and validates ranges, raising :class:`ConfigError` with one line naming the field and what was
expected. The CLI turns that into exit code 2 before any process group exists.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowband.train.errors import ConfigError
from lowband.train.strategies.diloco import DilocoConfig, FtConfig
from lowband.train.strategies.gtp import GTPConfig
from lowband.train.strategies.sharded import ShardedConfig, SparseConfig
from lowband.train.strategies.tp import TPConfig


@dataclass(kw_only=True)
class RunConfig:
    """The run: its name and directory, length, logging, world size, device and dtype."""

    name: str = "run"
    """Run name; the run directory is ``<out_dir>/<name>``: one folder name (not empty, no ``/``, not ``..``)."""
    out_dir: str = "runs"
    """Where run directories go."""
    overwrite: bool = False
    """Let this run replace the outputs of another run in its run directory (``metrics.jsonl``, ``config.toml``,
    ``summary.json``, ``loss.png``, ``tensorboard/``, ``model.safetensors``, ``model.json``). false = a run
    directory holding them is refused (exit 2) unless this run resumes from a checkpoint of its own checkpoint
    directory or its config is the one in the directory's ``config.toml`` (the same command again)."""
    seed: int = 0
    """Seed for model init and data order."""
    steps: int = 100
    """Optimizer steps to train."""
    log_every: int = 10
    """Rank 0 logs one row every this many steps (and at the first and last); its per-step figures are means
    over the steps since the previous row (metrics.jsonl, docs/cli.md)."""
    val_every: int = 50
    """Validation loss every this many steps (and at the end); 0 = only at the end."""
    val_batches: int = 4
    """Batches of data.batch_size sequences (per rank) averaged for one validation loss (read in data.grad_accum
    microbatches, so the validation set is the same whatever grad_accum, and at any world size with the same
    global batch)."""
    world_size: int = 1
    """Ranks to launch when started without torchrun (CPU, gloo). Under torchrun, WORLD_SIZE wins."""
    device: str = "cpu"
    """cpu | cuda | auto."""
    dtype: str = "float32"
    """Parameter dtype: float32 | float64 | bfloat16."""
    threads: int = 0
    """torch intra-op threads per rank; 0 = cores / local ranks (at least 1)."""
    timeout_s: float = 300.0
    """Process-group timeout: a dead peer ends the others with an error after this long."""
    tensorboard: bool = False
    """Rank 0 also writes TensorBoard scalars (loss, val_loss, lr, grad_norm, tokens/s, wire MB, cumulative
    bytes) to ``<run_dir>/tensorboard/``; needs ``pip install 'lowband[tb]'``."""
    plot: bool = True
    """Rank 0 draws ``loss.png`` (loss and cumulative wire bytes, matplotlib) at the end of the run; false
    skips it (about a second of CPU for a short run; ``metrics.jsonl`` holds the same figures)."""
    export: bool = True
    """At the end of the run write the final model, unsharded, to ``<run dir>/model.safetensors`` plus
    ``model.json`` (how to rebuild it): load with ``lowband.load_trained``, sample with ``python -m
    lowband.sample`` (docs/cli.md); false = no model file."""
    check_replicas_every: int = 100
    """Every this many steps check that ranks meant to hold the same weights still hold the same bits
    (:func:`lowband.consistency.check_replicas`: one all-gather of ``2 + 4 x tensors`` int64 checksums per rank;
    GTP/TP shards compared among the ranks holding the same shard, DiLoCo replicas not with each other); a
    drift ends the run (exit 1) naming the first parameter that differs. 0 = off."""
    compile: bool = False
    """``torch.compile`` the model after the strategy has distributed it, for every strategy: each transformer
    block on its own where the model has blocks (the largest ``nn.ModuleList`` of same-type modules,
    torchtitan's way), else the whole model; in place (``module.compile()``), so parameter names,
    checkpoints and exports are unchanged. lowband's collectives and GTP/TP layers are graph breaks that run
    eagerly (docs/gtp.md). The first steps include compile time."""


@dataclass(kw_only=True)
class ModelConfig:
    """The model: lowband's reference GPT from these keys, or the user's own model from ``factory``."""

    factory: str = ""
    """``package.module:function`` that builds the model instead of lowband's GPT (docs/adopt.md). Called
    on every rank as ``function(cfg)`` after ``torch.manual_seed(run.seed)``; returns an ``nn.Module``, or
    ``(module, lowband.plan.ModelPlan)`` (else ``module.lowband_plan()`` or the generic rules). The GPT
    keys below other than vocab_size and seq_len are then the factory's to read or ignore."""
    forward: str = "auto"
    """How the trainer gets the loss (:mod:`lowband.train.forward`): targets (``model(x, y)`` returns the
    loss, ``(logits, loss)`` or an object with ``.loss``) | logits (``model(x)`` returns logits or an object
    with ``.logits``; the trainer takes the next-token cross-entropy) | auto (logits for a Hugging Face
    ``transformers`` model, else targets)."""
    vocab_size: int = 320
    """Embedding rows (the byte tokenizer needs 258; 320 is padded to a multiple of 64)."""
    seq_len: int = 128
    """Tokens per training sequence (the data loader's window)."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; n_embd / n_head must be even (rotary)."""
    n_embd: int = 128
    """Width of the residual stream (embedding size)."""
    mlp_ratio: int = 4
    """MLP hidden width as a multiple of n_embd."""
    bigram_rows: int = 0
    """Rows of the hashed bigram table; 0 = no table."""


@dataclass(kw_only=True)
class DataConfig:
    """Training data: the built-in corpus, your own text files, or pre-tokenized .bin shards."""

    source: str = "builtin"
    """builtin (Python's own docs, built at run time) | text (your UTF-8 files, data.path) | bin (speedrun .bin
    shards)."""
    path: str = ""
    """A UTF-8 text file or a glob of them (source = text; refused with another source): byte-tokenized into
    cached .bin shards under ``$LOWBAND_CACHE_DIR`` (default ``~/.cache/lowband``) ``/text-<key>/``, rebuilt
    when a file changes."""
    val_fraction: float = 0.05
    """Share of the text token stream, taken from its end, that is the validation split (source = text)."""
    train_bin: str = ""
    """Glob of training .bin shards (source = bin)."""
    val_bin: str = ""
    """Glob of validation .bin shards (source = bin); "": the last 1/20 of the training tokens, held out of
    training."""
    batch_size: int = 8
    """Sequences per rank per optimizer step (split over grad_accum microbatches)."""
    grad_accum: int = 1
    """Microbatches per step; batch_size must divide by it."""


@dataclass(kw_only=True)
class OptimConfig:
    """Optimizer hyperparameters and the learning-rate schedule (every strategy reads them)."""

    lr: float = 3e-3
    """Peak learning rate of AdamW (and of the AdamW part of combined optimizers)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW and Muon) of parameters with >= 2 dims; 1-D ones (norms, biases) get none."""
    beta1: float = 0.9
    """AdamW first-moment decay, in [0, 1)."""
    beta2: float = 0.95
    """AdamW second-moment decay, in [0, 1)."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    warmup_steps: int = 10
    """Steps of linear lr warmup from lr / warmup_steps to the peak; 0 = none."""
    schedule: str = "cosine"
    """cosine | linear | constant (after linear warmup)."""
    min_lr_ratio: float = 0.1
    """Final lr as a fraction of the peak (cosine and linear)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 = off."""
    muon_lr: float = 0.02
    """Peak lr of Muon (hidden matrices) for strategies that use it."""
    muon_momentum: float = 0.95
    """Muon's (Nesterov) momentum."""
    muon_ns_method: str = "ns5"
    """Muon orthogonalization: ns5 (quintic Newton-Schulz, 3.4445/-4.7750/2.0315) | polar_express."""
    muon_ns_dtype: str = "auto"
    """dtype of the orthogonalization: auto (bfloat16 on GPU, float32 on CPU) | bfloat16 | float32 | float64."""


@dataclass(kw_only=True)
class StrategyConfig:
    """Which strategy distributes the model, and the gradient wire every data-parallel strategy shares.

    Each strategy's own knobs live in its section: ``[sharded]``, ``[sparse]``, ``[gtp]``, ``[tp]``,
    ``[diloco]``. The keys that used to sit here (``strategy.gtp_size`` ...) are refused with a message
    naming their new key (:data:`MOVED_KEYS`).
    """

    name: str = "ddp"
    """How the model is distributed; see ``lowband.train.strategies.available()``."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MB (ddp, sharded-*, diloco's inner data parallelism)."""
    grad_wire_dtype: str = "float32"
    """Gradients travel as float32 | bfloat16 (the reduction accumulates in fp32): ddp, sharded-*, gtp, diloco;
    fp8 (e4m3, one fp32 scale per 256 elements, one all-to-all per bucket or GTP weight, fp32 sums at the
    owner; gtp's replicated gradients and its data-parallel all-reduce as a block-scaled all-reduce):
    sharded-*, diloco.inner = sharded-* and gtp only."""
    find_unused_parameters: bool = False
    """ddp (and diloco.inner = ddp): torch DDP's find_unused_parameters, needed by a model with parameters that
    get no gradient on some steps (branches, MoE routing, early exits): such a parameter is averaged with
    zeros where unused, left untouched where no rank used it (an extra graph walk per step). Without it DDP
    stops at the first such step naming this key. Other strategies handle such parameters without it."""

    def __getattr__(self, key: str) -> Any:
        if key in MOVED_KEYS.get("strategy", {}):
            raise AttributeError(moved_key_message("strategy", key))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}")

    def __setattr__(self, key: str, value: Any) -> None:
        if key in MOVED_KEYS.get("strategy", {}):
            raise AttributeError(moved_key_message("strategy", key))
        object.__setattr__(self, key, value)


MOVED_KEYS: dict[str, dict[str, str]] = {
    "strategy": {
        "param_wire_dtype": "sharded.param_wire_dtype",
        "sparse_embeddings": "sparse.tables",
        "sparse_mode": "sparse.mode",
        "gtp_size": "gtp.size",
        "gtp_gather": "gtp.gather",
        "gtp_fp8_block": "gtp.fp8_block",
        "gtp_finalize_depth": "gtp.finalize_depth",
        "tp_size": "tp.size",
        "tp_optimizer": "tp.optimizer",
    },
}
"""Keys that moved out of the flat ``[strategy]`` section: ``{section: {old key: new "section.key"}}``.
A config (TOML, CLI override, or attribute access on :class:`StrategyConfig`) that uses an old key fails
with one line naming the new one."""


def moved_key_message(section: str, key: str) -> str:
    """The one-line error for a key that moved (see :data:`MOVED_KEYS`)."""
    new = MOVED_KEYS[section][key]
    nsec, nkey = new.split(".", 1)
    return f"config key '{section}.{key}' moved to '{new}' (in TOML: [{nsec}] {nkey} = ...; on the CLI: --{new}=...)"


@dataclass(kw_only=True)
class CheckpointConfig:
    """Distributed checkpoints (``torch.distributed.checkpoint``); see docs/checkpoints.md."""

    dir: str = ""
    """Checkpoint directory; "" = ``<run.out_dir>/<run.name>/checkpoint``. Holds ``step-<N>/`` folders."""
    every: int = 0
    """Save every this many optimizer steps and at the end; 0 = off (then only an explicit resume path loads)."""
    keep_last: int = 2
    """Committed checkpoints kept; older ones are deleted after each successful save."""
    async_save: bool = False
    """Write in a background thread (``dcp.async_save``); training continues after the state is copied."""
    resume: str = "latest"
    """latest (newest committed checkpoint in ``dir``, if any, when ``every > 0``) | none | a step-<N> path."""
    verify: bool = True
    """Record SHA-256 of every checkpoint file at save and check it (rank 0) before loading."""
    on_save_error: str = "stop"
    """A save that fails (disk full, permission): stop (exit 1) | continue (warn, keep training)."""
    overwrite: bool = False
    """Let this run replace checkpoints in ``dir`` it does not continue (another run's, or ones newer than the
    resumed step); they are deleted after this run's first save. false = such a folder is refused."""
    allow_data_change: bool = False
    """Resume although the training data differ from the checkpoint's (fingerprint, source or token count)."""


@dataclass(kw_only=True)
class GuardConfig:
    """Non-finite loss / gradient-norm guard; see docs/checkpoints.md."""

    skip_nonfinite: bool = True
    """Skip (on every rank alike) a step whose loss or gradient norm is NaN/inf; false = stop at once."""
    max_consecutive: int = 3
    """Stop with an error after this many skipped steps in a row."""


@dataclass(kw_only=True)
class Config:
    """The whole trainer config: one attribute per TOML section."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    sharded: ShardedConfig = field(default_factory=ShardedConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    gtp: GTPConfig = field(default_factory=GTPConfig)
    tp: TPConfig = field(default_factory=TPConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    ft: FtConfig = field(default_factory=FtConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


CHOICES: dict[str, tuple[str, ...]] = {
    "run.device": ("cpu", "cuda", "auto"),
    "run.dtype": ("float32", "float64", "bfloat16"),
    "data.source": ("builtin", "text", "bin"),
    "optim.schedule": ("cosine", "linear", "constant"),
    "optim.muon_ns_method": ("ns5", "polar_express"),
    "optim.muon_ns_dtype": ("auto", "bfloat16", "float32", "float64"),
    "strategy.grad_wire_dtype": ("float32", "bfloat16", "fp8"),
    "diloco.inner": ("ddp", "sharded-adamw", "sharded-muon", "gtp"),
    "model.forward": ("auto", "targets", "logits"),
    "sharded.param_wire_dtype": ("float32", "bfloat16"),
    "sharded.exchange": ("ring", "p2p"),
    "gtp.gather": ("native", "bf16", "fp8"),
    "gtp.optimizer": ("adamw", "muon"),
    "tp.optimizer": ("rekls", "adamw"),
    "sparse.mode": ("auto", "sparse", "dense"),
    "checkpoint.on_save_error": ("stop", "continue"),
}
POSITIVE: tuple[str, ...] = (
    "run.steps", "run.log_every", "run.val_batches", "run.world_size", "run.timeout_s",
    "model.vocab_size", "model.seq_len", "model.n_layer", "model.n_head", "model.n_embd", "model.mlp_ratio",
    "checkpoint.keep_last", "guard.max_consecutive",
    "data.batch_size", "data.grad_accum", "optim.lr", "strategy.bucket_mb",
    "gtp.fp8_block", "gtp.muon_bucket_mb", "ft.groups", "ft.min_replicas", "ft.timeout_s", "ft.quorum_timeout_s",
    "ft.connect_timeout_s",
)
NON_NEGATIVE: tuple[str, ...] = (
    "checkpoint.every", "run.check_replicas_every", "gtp.size", "gtp.finalize_depth", "tp.size",
    "run.val_every", "run.threads", "model.bigram_rows", "optim.weight_decay", "optim.warmup_steps",
    "optim.min_lr_ratio", "optim.grad_clip", "optim.eps", "optim.muon_lr", "optim.muon_momentum",
)


def _sections() -> dict[str, type]:
    return {f.name: f.type if isinstance(f.type, type) else typing.get_type_hints(Config)[f.name]
            for f in dataclasses.fields(Config)}


def _field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, tp: Any, value: Any, from_cli: bool) -> Any:
    """Check ``value`` against ``tp`` (parsing strings from the CLI); raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        errs = []
        for arm in typing.get_args(tp):
            if arm is type(None):
                if value is None or (from_cli and str(value).lower() in ("none", "null")):
                    return None
                continue
            try:
                return _coerce(key, arm, value, from_cli)
            except ConfigError as e:
                errs.append(str(e))
        raise ConfigError(f"{key}: expected {tp}, got {value!r}")
    if origin in (list, tuple):
        (arm, *_rest) = typing.get_args(tp) or (str,)
        if from_cli and isinstance(value, str):  # a,b  or TOML's spelling [a, "b"]; '' and [] are empty
            text = value.strip()
            if text.startswith("[") and text.endswith("]"):
                text = text[1:-1]
            value = [v.strip().strip("'\"") for v in text.split(",") if v.strip() != ""]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(key, arm, v, from_cli) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if from_cli and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if isinstance(value, int | float):
            return float(value)
        if from_cli and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported field type {_type_name(tp)}")


def _apply(cfg: Config, section: str, key: str, value: Any, from_cli: bool) -> None:
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section not in sections:
        raise ConfigError(f"unknown config section {section!r}; allowed: {', '.join(sections)}")
    obj = getattr(cfg, section)
    types_ = _field_types(type(obj))
    if key in MOVED_KEYS.get(section, {}):
        raise ConfigError(moved_key_message(section, key))
    if key not in types_:
        raise ConfigError(f"unknown config key '{section}.{key}'; allowed in [{section}]: "
                          f"{', '.join(types_)}")
    setattr(obj, key, _coerce(f"{section}.{key}", types_[key], value, from_cli))


def parse_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """``["--model.n_layer=4", ...]`` -> ``[("model", "n_layer", "4"), ...]``."""
    out = []
    for a in args:
        if not a.startswith("--") or "=" not in a or "." not in a.split("=", 1)[0]:
            raise ConfigError(f"bad override {a!r}; expected --section.key=value")
        k, v = a[2:].split("=", 1)
        section, key = k.split(".", 1)
        out.append((section, key, v))
    return out


def override_value(dotted: str, text: str) -> Any:
    """The value ``--section.key=text`` sets, parsed and checked against the field's type as the CLI does
    (``ConfigError`` naming an unknown key or a value of the wrong type); the config itself is not validated."""
    section, key = dotted.split(".", 1)
    cfg = Config()
    _apply(cfg, section, key, text, from_cli=True)
    return getattr(getattr(cfg, section), key)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build a :class:`Config` from defaults, a TOML file and CLI overrides, then validate it."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} not found")
        try:
            data = tomllib.loads(p.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not UTF-8 text: byte 0x{e.object[e.start]:02x} at offset "
                              f"{e.start} ({e.reason}); save it as UTF-8") from e
        except OSError as e:
            raise ConfigError(f"config file {str(p)!r} cannot be read ({e.strerror or e})") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from e
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"config file {str(p)!r}: top-level key {section!r} must be a [section]")
            for key, value in values.items():
                _apply(cfg, section, key, value, from_cli=False)
    for section, key, value in parse_overrides(overrides or []):
        _apply(cfg, section, key, value, from_cli=True)
    validate(cfg)
    return cfg


def config_from_dict(data: dict[str, dict[str, Any]]) -> Config:
    """A validated :class:`Config` from a nested dict (as ``Config.to_dict`` returns)."""
    cfg = Config()
    for section, values in data.items():
        for key, value in values.items():
            _apply(cfg, section, key, value, from_cli=False)
    validate(cfg)
    return cfg


def _get(cfg: Config, dotted: str) -> Any:
    section, key = dotted.split(".", 1)
    return getattr(getattr(cfg, section), key)


def check_run_name(name: str) -> None:
    """``run.name`` names one folder inside ``run.out_dir``: not empty, no path separator, not ``.``/``..``."""
    import os

    seps = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    if not name.strip():
        raise ConfigError("run.name is empty; give the run a name (its directory is <run.out_dir>/<run.name>)")
    if name in (".", "..") or any(c in name for c in seps) or "\0" in name:
        raise ConfigError(f"run.name = {name!r} is not a folder name inside run.out_dir (no '/', '.' or '..'): "
                          "put the directory part in run.out_dir instead")


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Range and cross-field checks; ``world_size`` (when known) is checked against the strategy.

    Every float field must be finite (``optim.lr = inf`` is a config error, not a run that turns every
    parameter into NaN at step 1).
    """
    import math

    for sec in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, sec.name)):
            v = getattr(getattr(cfg, sec.name), f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{sec.name}.{f.name} must be a finite number, got {v!r}")
    for k in POSITIVE:
        v = _get(cfg, k)
        if not v > 0:
            raise ConfigError(f"{k} must be positive, got {v!r}")
    for k in NON_NEGATIVE:
        v = _get(cfg, k)
        if v < 0:
            raise ConfigError(f"{k} must be >= 0, got {v!r}")
    for k, allowed in CHOICES.items():
        v = _get(cfg, k)
        if v not in allowed:
            raise ConfigError(f"{k} must be one of {', '.join(allowed)}; got {v!r}")
    check_run_name(cfg.run.name)
    if cfg.data.path and cfg.data.source != "text":
        raise ConfigError(f"data.path = {cfg.data.path!r} is read only when data.source = text, but data.source = "
                          f"{cfg.data.source}; set data.source = text to train on it, or remove data.path")
    m = cfg.model
    if m.n_embd % m.n_head:
        raise ConfigError(f"model.n_embd ({m.n_embd}) must be divisible by model.n_head ({m.n_head})")
    if (m.n_embd // m.n_head) % 2:
        raise ConfigError(f"model.n_embd / model.n_head = {m.n_embd // m.n_head} must be even (rotary)")
    if cfg.data.source in ("builtin", "text") and m.vocab_size < 258:
        raise ConfigError(f"model.vocab_size = {m.vocab_size} is smaller than the byte tokenizer's 258 ids "
                          f"(data.source = {cfg.data.source}); use model.vocab_size >= 258 (320 is the padded "
                          "default)")
    if m.bigram_rows == 1:
        raise ConfigError("model.bigram_rows must be 0 (off) or >= 2, got 1")
    if cfg.data.batch_size % cfg.data.grad_accum:
        raise ConfigError(f"data.batch_size ({cfg.data.batch_size}) must be divisible by data.grad_accum "
                          f"({cfg.data.grad_accum})")
    if cfg.data.source == "bin" and not cfg.data.train_bin:
        raise ConfigError("data.train_bin must name .bin shards (a glob) when data.source = bin")
    if cfg.data.source == "text" and not cfg.data.path.strip():
        raise ConfigError("data.path must name a UTF-8 text file or a glob of them when data.source = text")
    if not 0 < cfg.data.val_fraction < 1:
        raise ConfigError(f"data.val_fraction must be in (0, 1), got {cfg.data.val_fraction}")
    if not 0 <= cfg.optim.beta1 < 1 or not 0 <= cfg.optim.beta2 < 1:
        raise ConfigError(f"optim.beta1/beta2 must be in [0, 1), got {cfg.optim.beta1}, {cfg.optim.beta2}")
    if cfg.optim.min_lr_ratio > 1:
        raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {cfg.optim.min_lr_ratio}")
    if cfg.checkpoint.resume not in ("latest", "none") and not cfg.checkpoint.resume.strip():
        raise ConfigError("checkpoint.resume must be latest, none or a checkpoint path; got ''")
    if cfg.ft.enabled and cfg.strategy.name != "diloco":
        raise ConfigError(f"ft.enabled = true needs strategy.name = diloco (fault-tolerant replica groups sync "
                          f"through Streaming DiLoCo); got strategy.name = {cfg.strategy.name}")
    from lowband.train.strategies import get_strategy_class

    strategy_cls = get_strategy_class(cfg.strategy.name)
    strategy_cls.validate_config(cfg, cfg.run.world_size if world_size is None else world_size)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML text (round-trips through :func:`load_config`)."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            lines.append(f"{k} = {json.dumps(v)}")
        lines.append("")
    return "\n".join(lines)
