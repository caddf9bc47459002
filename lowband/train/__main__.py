"""``python -m lowband.train --config configs/demo.toml [--debug] [--section.key=value ...]``.

``--help`` lists every config section and key (type, default, description, allowed values), the
strategies and the exit codes; ``--help-strategy NAME`` only the sections one strategy reads
(:mod:`lowband.train.help`).

Three ways this process runs:

* **launcher**: started without ``torchrun`` and with ``run.world_size > 1``: validates the config, runs
  the pre-flight checks, locks the run directory and starts the ranks itself (``lowband.train.launch``),
  then prints one line per distinct error.
* **rank**: under ``torchrun`` or the launcher (``RANK``/``WORLD_SIZE`` set): trains one rank. Under
  ``torchrun``, rank 0 also runs the pre-flight checks and takes the lock, sharing the verdict with every
  rank before the first training collective.
* **single**: ``run.world_size = 1`` without ``torchrun``: one process does all of it.

Whatever ends the run is one line on stderr and a documented exit code (``lowband.train.errors``):
0 done, 1 the run failed (non-finite steps, a save failed, a peer died, an unexpected error), 2 a bad
config / data / checkpoint or a run directory in use, 128+N stopped by signal N (130 SIGINT, 143
SIGTERM). The full traceback goes to ``<run.out_dir>/<run.name>/logs/rank<R>.log``, and to stderr with
``--debug`` or ``LOWBAND_DEBUG=1``. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

from lowband.train import errors, stop
from lowband.train.config import Config, ConfigError, load_config, validate


def _parse(argv: list[str]) -> tuple[str | None, bool, list[str]]:
    """``(config path, debug, overrides)``; ``--help`` / ``--help-strategy NAME`` print the generated help
    (:mod:`lowband.train.help`) and raise ``SystemExit`` (0, or 2 for an unknown strategy)."""
    parser = argparse.ArgumentParser(prog="python -m lowband.train", add_help=False,
                                     formatter_class=lambda prog: argparse.HelpFormatter(prog, width=100),
                                     usage="%(prog)s [-h] [--help-strategy NAME] [--config FILE] [--debug]\n"
                                           f"{' ' * 31}[--section.key=value ...]",
                                     description="Train a GPT (lowband's, or your own via model.factory) with a "
                                                 "lowband strategy.")
    parser.add_argument("-h", "--help", action="store_true",
                        help="show this help: options, override syntax, strategies, exit codes and every "
                             "config key with its type, default and description")
    parser.add_argument("--help-strategy", metavar="NAME",
                        help="show only the config sections strategy NAME reads")
    parser.add_argument("--config", metavar="FILE", help="TOML config file (configs/*.toml)")
    parser.add_argument("--debug", action="store_true",
                        help="print full tracebacks to stderr (also LOWBAND_DEBUG=1); they are always in "
                             "<run.out_dir>/<run.name>/logs/")
    args, rest = parser.parse_known_args(argv)
    if args.help or args.help_strategy is not None:
        from lowband.train import help as help_text

        try:
            text = (help_text.full_help(parser.format_help()) if args.help
                    else help_text.strategy_help(args.help_strategy, parser.format_usage()))
        except ConfigError as e:
            print(f"{errors.PREFIX}: error: --help-strategy: {e}", file=sys.stderr, flush=True)
            raise SystemExit(errors.EXIT_INPUT) from None
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:  # `--help | head`: the reader left; no traceback
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0)
    return args.config, args.debug, rest


def _print_error(exc: BaseException, debug: bool) -> int:
    """Launcher/single-process errors before any rank runs: the one line (and the traceback if debug)."""
    outcome = errors.classify(exc)
    if debug:
        print(errors.traceback_text(exc), file=sys.stderr, end="", flush=True)
    print(errors.format_line(outcome), file=sys.stderr, flush=True)
    return outcome.code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    in_rank = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        config_path, debug, overrides = _parse(argv)
        debug = errors.debug_enabled(debug)
    except SystemExit as e:  # --help / --help-strategy (0; 2 unknown strategy) or an argparse usage error (2)
        return int(e.code or 0)
    if in_rank:
        return _rank_main(config_path, overrides, debug)
    try:
        cfg = load_config(config_path, overrides)
        validate(cfg, world_size=cfg.run.world_size)
    except Exception as e:
        return _print_error(e, debug)
    if cfg.run.world_size > 1:
        from lowband.train.launch import launch

        try:
            return launch(argv, cfg)
        except KeyboardInterrupt:  # Ctrl-C before any rank started
            print("lowband.train: stopped by SIGINT before training started", file=sys.stderr, flush=True)
            return 130
        except Exception as e:
            return _print_error(e, debug)
    return _rank_main(config_path, overrides, debug)


def _route_warnings(log_path: Path | None, debug: bool) -> None:
    """Python warnings go to the rank's log file (and stderr only with --debug)."""
    if debug:
        return

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        errors.append_log(log_path, warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = show


def _rank_main(config_path: str | None, overrides: list[str], debug: bool) -> int:
    launched = os.environ.get("LOWBAND_LAUNCHED") == "1"
    stop.install_stop_handlers()
    if launched:
        stop.watch_parent(int(os.environ["LOWBAND_LAUNCHER_PID"]))
        Path(os.environ["LOWBAND_READY_FILE"]).touch()  # signals from the launcher are handled from now on
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    report_file = os.environ.get("LOWBAND_REPORT_FILE")
    run_dir: Path | None = None
    locks: list = []
    outcome = errors.Outcome(errors.EXIT_OK, "ok", "", rank, world)
    try:
        cfg = load_config(config_path, overrides)
        validate(cfg, world_size=world)
        run_dir = Path(cfg.run.out_dir) / cfg.run.name
        _route_warnings(errors.log_path_for(run_dir, rank), debug)
        outcome = _train_rank(cfg, launched, locks)
        outcome.rank, outcome.world_size = rank, world
    except BaseException as e:
        from lowband.train.lock import LockError

        log = None if isinstance(e, LockError | ConfigError) else errors.log_path_for(run_dir, rank)
        logged = errors.append_log(log, errors.traceback_text(e))
        outcome = errors.classify(e, rank, world, log if logged else None)
        if debug:
            print(errors.traceback_text(e), file=sys.stderr, end="", flush=True)
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            global _RAN_COLLECTIVES
            _RAN_COLLECTIVES = True
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        for lk in locks:
            lk.release()
    if report_file:  # the launcher prints the merged lines
        Path(report_file).write_text(outcome.to_json())
    elif outcome.code != errors.EXIT_OK:
        _print_rank_line(outcome)
    return outcome.code


def _print_rank_line(outcome: errors.Outcome) -> None:
    """Under torchrun (or alone): errors every rank raises alike print once per machine, others per rank."""
    alike = outcome.kind in ("input", "failed", "stopped")
    if outcome.world_size == 1 or alike:
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print(errors.format_line(outcome), file=sys.stderr, flush=True)
        return
    print(errors.format_line(outcome, errors.ranks_phrase([outcome.rank], outcome.world_size)), file=sys.stderr,
          flush=True)


def _train_rank(cfg: Config, launched: bool, locks: list) -> errors.Outcome:
    """Initialize, check (collectively, under torchrun), train; the stop outcome or OK."""
    from lowband.train import preflight
    from lowband.train.env import init_distributed
    from lowband.train.guards import peer_failure_guard
    from lowband.train.trainer import train

    preflight.check_device(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # before the process group
    env = init_distributed(cfg.run.device, cfg.run.timeout_s)
    with peer_failure_guard(env.rank, env.world_size, cfg.run.timeout_s):
        locks.extend(preflight.collective_checks(cfg, env, take_lock=not launched, run_local=not launched))
    result = train(cfg, env, check_outputs=False)  # checked above (or by the launcher), with the lock held
    if result.stopped_by:
        saved = (f"final checkpoint step-{result.steps} saved; the same command resumes"
                 if cfg.checkpoint.every > 0 else "checkpointing is off: nothing was saved")
        raise errors.StopRequested(result.stopped_by, f"stopped by {errors.signal_name(result.stopped_by)} after "
                                                      f"step {result.steps} of {cfg.run.steps} ({saved})")
    return errors.Outcome(errors.EXIT_OK, "ok", "")


_RAN_COLLECTIVES = False
"""Set by :func:`_rank_main` when this process had a process group: it then leaves through :func:`_exit`."""


def _exit(code: int) -> None:
    """A rank process that had a process group leaves with ``code`` after Python's own exit work (``atexit``
    handlers: logging, lowband's exchange drain, torch's compile workers; buffered streams flushed) but without
    the interpreter's finalization: a gloo object still referenced there (an async work of a collective a
    failed step left, a group's worker thread) can abort the process in its C++ destructor (``terminate called
    without an active exception``, SIGABRT): an extra stderr line and, under torchrun, a crashed rank after a
    clean exit (seen once under heavy load, a rank refused a checkpoint at resume). Every file the run writes
    is closed before this point."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _code = main()
    if _RAN_COLLECTIVES:
        _exit(_code)
    sys.exit(_code)
