"""What both entry points share: the common arguments, config loading, `check`, error reporting."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

import yaml

from shared.config import RunConfig, Section, load_run_config

# What a command may raise for bad input or a bad store: reported in one line, exit status 2.
USER_ERRORS = (ValueError, FileNotFoundError, OSError, RuntimeError, KeyError)


def command_parser(prog: str, doc: str, commands: Sequence[str]) -> argparse.ArgumentParser:
    """`prog COMMAND [--config ...] [--no-progress] [key=value ...]`; the caller adds its options."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument("command", choices=commands)
    add_common_args(parser)
    return parser


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None, run: Callable[[argparse.Namespace], int]) -> int:
    """Parse (overrides may follow options: `make batches ARGS=...`), set up logging, run, and turn
    user errors into one line on stderr (DFLASH_TRACEBACK=1 re-raises them)."""
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except USER_ERRORS as exc:
        return report_error(exc)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/default.yaml", help="YAML preset (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (logs, CI)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. data.max_samples=32")


def load_config(args: argparse.Namespace, sections: dict[str, type[Section]]) -> RunConfig:
    return load_run_config(args.config, list(args.overrides), sections)


def print_check(cfg: RunConfig) -> None:
    """The resolved config, then every departure from the published recipe."""
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    warnings = cfg.recipe_warnings()
    for warning in warnings:
        print(f"WARNING: {warning}", file=sys.stderr)
    if not warnings:
        print("# no departures from the published DFlash recipe", file=sys.stderr)


def report_error(exc: BaseException) -> int:
    if os.environ.get("DFLASH_TRACEBACK"):
        raise exc
    print(f"error: {exc}", file=sys.stderr)
    return 2
