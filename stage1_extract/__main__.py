"""Stage 1 entry point.

    python -m stage1_extract {generate,plan,extract,status,verify,reprocess,check} --config configs/default.yaml [key=value ...]

Parses the config, runs one command, prints its JSON summary. Logic lives in `commands.py` and the modules it composes.
"""

from __future__ import annotations

import argparse
import sys

from shared.cli import command_parser, load_config, print_check, run_command, to_json
from stage1_extract import commands

COMMANDS = ("download", "generate", "plan", "extract", "status", "verify", "reprocess", "check")


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("python -m stage1_extract", __doc__, COMMANDS)
    parser.add_argument("--force", action="store_true", help="extract even when the plan says the disk is too small")
    parser.add_argument("--repair", action="store_true", help="verify: re-extract every bad shard")
    parser.add_argument(
        "--deep", action="store_true",
        help="verify: also tokenize the data again and compare every stored sample; status: rehash the target's weights",
    )
    return run_command(parser, argv, run)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    if args.command == "check":
        print_check(cfg, with_docs=args.explain, quiet=args.quiet)
        return 0
    progress = not args.no_progress
    if args.command == "download":
        out = commands.cmd_download(cfg)
    elif args.command == "generate":
        out = commands.cmd_generate(cfg, progress=progress)
    elif args.command == "plan":
        out = commands.cmd_plan(cfg)
    elif args.command == "extract":
        out = commands.cmd_extract(cfg, force=args.force, progress=progress)
    elif args.command == "status":
        out = commands.cmd_status(cfg, deep=args.deep)
    elif args.command == "reprocess":
        out = commands.cmd_reprocess(cfg, force=args.force, progress=progress)
    else:
        out = commands.cmd_verify(cfg, repair=args.repair, progress=progress, deep=args.deep)
        print(to_json(out))
        return 0 if out["ok"] else 1
    print(to_json(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
