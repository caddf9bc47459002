"""``python -m lowband.train --config configs/demo.toml [--section.key=value ...]``.

Under ``torchrun`` every rank trains. Started without ``torchrun`` and with ``run.world_size > 1``,
it validates the config and then launches ``run.world_size`` CPU ranks itself through
``torch.distributed.run --standalone``. A bad config or a bad data shard prints one line naming the
field or file and exits with code 2 before any rank enters a collective.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from lowband.train.config import ConfigError, load_config, validate


def _parse(argv: list[str]) -> tuple[str | None, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m lowband.train", add_help=True,
                                     description="Train the reference GPT with a lowband strategy.")
    parser.add_argument("--config", help="TOML config file (configs/*.toml)")
    args, rest = parser.parse_known_args(argv)
    return args.config, rest


def _check_data(cfg) -> None:
    if cfg.data.source == "bin":
        from lowband.data import load_tokens

        load_tokens(cfg.data.train_bin)
        if cfg.data.val_bin:
            load_tokens(cfg.data.val_bin)


@record
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        config_path, overrides = _parse(argv)
        cfg = load_config(config_path, overrides)
        world = int(os.environ["WORLD_SIZE"]) if under_torchrun else cfg.run.world_size
        validate(cfg, world_size=world)
        _check_data(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"lowband.train: error: {e}", file=sys.stderr)
        return 2
    if not under_torchrun and cfg.run.world_size > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={cfg.run.world_size}", "--module", "lowband.train", *argv]
        return subprocess.call(cmd)
    import torch.distributed as dist

    from lowband.train.checkpoint import CheckpointError
    from lowband.train.guards import NonFiniteStepError, PeerFailureError
    from lowband.train.trainer import train

    try:
        train(cfg)
    except CheckpointError as e:
        print(f"lowband.train: error: {e}", file=sys.stderr)
        return 2
    except (NonFiniteStepError, PeerFailureError) as e:
        print(f"lowband.train: error: {e}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
