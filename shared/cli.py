"""What both entry points share: the common arguments, config loading, `check`, error reporting."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import yaml

from shared.config import RunConfig, explain, load_run_config
from shared.errors import UserError


def command_parser(prog: str, doc: str, commands: Sequence[str]) -> argparse.ArgumentParser:
    """`prog COMMAND [--config ...] [--no-progress] [key=value ...]`; the caller adds its options."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument("command", choices=commands)
    add_common_args(parser)
    return parser


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None, run: Callable[[argparse.Namespace], int]) -> int:
    """Parse (overrides may follow options: `make batches ARGS=...`), set up logging, run, and turn
    a UserError into one line on stderr (DFLASH_TRACEBACK=1 shows its traceback). Any other
    exception is a bug or an environment failure and keeps its traceback."""
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except UserError as exc:
        return report_error(exc)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default="default", help="a YAML file, or a preset name from the project's configs/ (default: %(default)s)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (logs, CI)")
    parser.add_argument("--explain", action="store_true", help="check: every key with its type, default and meaning")
    parser.add_argument("--quiet", action="store_true", help="check: print nothing unless the config is refused")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. data.max_samples=32")


def load_config(args: argparse.Namespace) -> RunConfig:
    return load_run_config(args.config, list(args.overrides))


def print_check(cfg: RunConfig, with_docs: bool = False, quiet: bool = False) -> list[str]:
    """The resolved config (or, with `--explain`, every key documented), then every departure from
    the published recipe on stderr, and which sections another stage validates. `quiet`: nothing
    (loading the config already refused what is wrong); `make` runs both stages' checks this way
    before a long job, so a typo in the other stage's section stops at once."""
    if "target" in cfg.sections:
        from shared.target import check_against_folder

        check_against_folder(cfg.target)
    if quiet:
        return cfg.recipe_warnings()
    if with_docs:
        print(explain(cfg))
    else:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    warnings = cfg.recipe_warnings()
    for warning in warnings:
        print(f"WARNING: {warning}", file=sys.stderr)
    if not warnings:
        print("# no departures from the published DFlash recipe", file=sys.stderr)
    alternatives = cfg.alternatives()
    if alternatives:
        print("# alternatives to the recipe, with what was measured (BENCHMARKS.md):", file=sys.stderr)
        for line in alternatives:
            print(f"#   {line}", file=sys.stderr)
    for line in cfg.notes():
        print(f"# {line}", file=sys.stderr)
    for owner, names in cfg.unvalidated_by_owner().items():
        print(f"# sections {', '.join(names)} are {owner}'s: `python -m {owner} check` validates them", file=sys.stderr)
    return warnings


def report_error(exc: UserError) -> int:
    if os.environ.get("DFLASH_TRACEBACK"):
        raise exc
    print(f"error: {exc}", file=sys.stderr)
    return exc.exit_code


def to_json(value: Any) -> str:
    """A command's summary as strict JSON: non-finite numbers become "nan"/"inf" strings (JSON has
    no NaN), anything else unknown its str()."""
    return json.dumps(_finite(value), indent=1, default=str, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
