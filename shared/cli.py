"""What both entry points share: the common arguments, config loading, `check`, error reporting."""

from __future__ import annotations

import argparse
import os
import sys

import yaml

from shared.config import RunConfig, Section, load_run_config


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
