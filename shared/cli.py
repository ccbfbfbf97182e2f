"""What both entry points share: the verbs' command line, config loading, `check`, error reporting.

    run_cli("python -m stage2_train", __doc__, VERBS, argv)

Each verb has its own `--help` (a description of what it does and its options), speaks to people by
default (`show`: a short readable summary) and to scripts with `--json` (the same result, as JSON,
the same keys every time). `--version` names the package version. Every command a verb suggests (in
its result, its notes and warnings, its log lines and its errors) is spelled for the run it was called
with (`for_this_run`): its `--config` and `key=value` overrides. Ctrl-C ends a verb with one line
(exit 130) saying whether the same command resumes.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TextIO

import yaml

from shared.config import RunConfig, explain, load_run_config
from shared.errors import UserError


@dataclass(frozen=True)
class Verb:
    """One command: what it does (`summary` in the list, `description` in its --help), how it runs
    (`run(args)` returns the result, or None when it printed its own), how people read the result
    (`show`; None when the result is already text), its exit status (`exit_code`) and what Ctrl-C
    leaves (`interrupted`: the line printed, e.g. that the same command resumes)."""

    name: str
    summary: str
    run: Callable[[argparse.Namespace], Any]
    show: Callable[[Any], str] | None = None
    options: Callable[[argparse.ArgumentParser], None] | None = None
    description: str = ""
    exit_code: Callable[[Any], int] | None = None
    as_json: Callable[[Any], str] | None = None  # the result as JSON text, when not `to_json(result)`
    interrupted: str = "interrupted"


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("dflash-pipeline")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def usage(prog: str, doc: str, verbs: Sequence[Verb]) -> str:
    width = max(len(v.name) for v in verbs)
    lines = [doc.split("\n\n")[0].strip(), "", f"usage: {prog} COMMAND [--config PRESET] [--json] [key=value ...]", "", "commands:"]
    lines += [f"  {v.name:<{width}}  {v.summary}" for v in verbs]
    lines += ["", f"`{prog} COMMAND --help` describes a command and its options; --version prints the version."]
    return "\n".join(lines)


def run_cli(prog: str, doc: str, verbs: Sequence[Verb], argv: list[str] | None = None) -> int:
    """Parse `COMMAND [options] [key=value ...]` (overrides may come before or after options), run
    the verb, print its result for people or, with --json, as JSON, every command it suggests spelled
    for this run; a UserError is one line on stderr (exit 2; DFLASH_TRACEBACK=1 shows its traceback),
    Ctrl-C the verb's `interrupted` line (exit 130). Anything else keeps its traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    by_name = {v.name: v for v in verbs}
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(prog, doc, verbs))
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"{prog} {version()}")
        return 0
    verb = by_name.get(argv[0])
    if verb is None:
        print(f"error: unknown command {argv[0]!r}; the commands are {', '.join(by_name)} (`{prog} --help`)", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"{prog} {verb.name}", description=verb.description or verb.summary)
    add_common_args(parser)
    parser.add_argument("--json", action="store_true", help="print the result as JSON (the same keys every time), for scripts")
    if verb.options is not None:
        verb.options(parser)
    args = parser.parse_intermixed_args(argv[1:])
    args.command = verb.name
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    def spell(text: str) -> str:
        return for_this_run(text, args.config, args.overrides)

    try:
        with spelled_output(spell):
            out = verb.run(args)
    except UserError as exc:
        return report_error(exc, args.config, args.overrides)
    except KeyboardInterrupt:
        if os.environ.get("DFLASH_TRACEBACK"):
            raise
        print(verb.interrupted, file=sys.stderr)
        return 130
    if out is None:
        return 0
    if verb.as_json is not None and (args.json or verb.show is None):
        print(verb.as_json(out))  # the verb's own JSON text (the doctor's): it suggests no command
    elif args.json or verb.show is None:
        print(spell(out) if isinstance(out, str) else to_json(spelled_result(out, spell)))
    else:
        print(spell(verb.show(out)))
    return verb.exit_code(out) if verb.exit_code is not None else 0


class _SpelledStream:
    """A text stream that writes each piece with the commands it suggests spelled (`spell`)."""

    def __init__(self, stream: TextIO, spell: Callable[[str], str]):
        self._stream, self._spell = stream, spell

    def write(self, text: str) -> int:
        self._stream.write(self._spell(text) if "`" in text else text)
        return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno, encoding: the stream's own
        return getattr(self._stream, name)


@contextmanager
def spelled_output(spell: Callable[[str], str]) -> Iterator[None]:
    """While a verb runs, what it prints (`check`'s warnings and notes, `note:` lines, a dry run) and
    logs goes out with each command it suggests spelled for this run: a suggestion without the run's
    --config would act on runs/default."""
    saved = sys.stdout, sys.stderr
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.StreamHandler) and h.stream in saved]
    sys.stdout, sys.stderr = _SpelledStream(saved[0], spell), _SpelledStream(saved[1], spell)
    streams = [h.setStream(_SpelledStream(h.stream, spell)) for h in handlers]
    try:
        yield
    finally:
        for handler, stream in zip(handlers, streams):
            handler.setStream(stream)
        sys.stdout, sys.stderr = saved


def spelled_result(value: Any, spell: Callable[[str], str]) -> Any:
    """A JSON-able result with every string's suggested commands spelled (before it is encoded)."""
    if isinstance(value, str):
        return spell(value) if "`" in value else value
    if isinstance(value, dict):
        return {k: spelled_result(v, spell) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [spelled_result(v, spell) for v in value]
    return value


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default="default", help="a YAML file, or a preset name from the project's configs/ (default: %(default)s)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (logs, CI)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. data.max_samples=32")


def check_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--explain", action="store_true", help="every key with its type, default and meaning")
    parser.add_argument("--quiet", action="store_true", help="print nothing unless the config is refused")


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


def report_error(exc: UserError, config: str | None = None, overrides: Sequence[str] = ()) -> int:
    """The error on one line; with the command's `config` and `overrides`, every command it suggests
    is spelled for this run (`for_this_run`)."""
    if os.environ.get("DFLASH_TRACEBACK"):
        raise exc
    message = str(exc) if config is None else for_this_run(str(exc), config, overrides)
    print(f"error: {message}", file=sys.stderr)
    return exc.exit_code


# A command a message suggests, in backticks: `python -m stage1_extract verify --repair` (or torchrun's
# `-m`), `make extract`; group 1 is the command up to its verb or target, group 2 what follows.
SUGGESTED = re.compile(r"`((?:[^`]*?-m (?:stage1_extract|stage2_train)|make) [a-z][a-z_-]*)([^`]*)`")


def for_this_run(message: str, config: str, overrides: Sequence[str]) -> str:
    """`message` with each command it suggests given this run's `--config` and command-line
    `key=value` overrides: errors name the fix without knowing how the command was called, and
    without them the fix would act on --config's default (runs/default), not on the run that failed.
    A command that names its own --config is left as it is (a `--config ...` placeholder is filled
    in); a key the suggestion sets itself keeps the suggestion's value."""
    given = [o for o in overrides if "=" in o and not o.startswith("-")]

    def spelled(match: re.Match[str]) -> str:
        command, rest = match[1], match[2]
        if "--config" in rest.replace("--config ...", "") or "CONFIG=" in rest:
            return match[0]
        rest = rest.replace(" --config ...", "")
        own = {word.split("=", 1)[0] for word in rest.split() if "=" in word and not word.startswith("-")}
        carried = [o for o in given if o.split("=", 1)[0] not in own]
        if command.startswith("make "):
            args = f" ARGS={shlex.quote(' '.join(carried))}" if carried else ""
            return f"`{command} CONFIG={shlex.quote(config)}{args}{rest}`"
        return f"`{command} --config {' '.join(shlex.quote(w) for w in (config, *carried))}{rest}`"

    return SUGGESTED.sub(spelled, message)


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
