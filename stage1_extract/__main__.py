"""Stage 1 entry point.

    python -m stage1_extract {generate,plan,extract,status,verify,reprocess,check} --config configs/default.yaml [key=value ...]

Parses the config, runs one command, prints its JSON summary. Logic lives in `pipeline.py`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from shared.cli import add_common_args, load_config, report_error
from stage1_extract import pipeline

COMMANDS = ("generate", "plan", "extract", "status", "verify", "reprocess", "check")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stage1_extract", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=COMMANDS)
    add_common_args(parser)
    parser.add_argument("--force", action="store_true", help="extract even when the plan says the disk is too small")
    parser.add_argument("--repair", action="store_true", help="verify: re-extract every bad shard")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args, pipeline.SECTIONS)
        if args.command == "check":
            from shared.cli import print_check

            print_check(cfg)
            return 0
        progress = not args.no_progress
        if args.command == "generate":
            out = pipeline.cmd_generate(cfg, progress=progress)
        elif args.command == "plan":
            out = pipeline.cmd_plan(cfg)
        elif args.command == "extract":
            out = pipeline.cmd_extract(cfg, force=args.force, progress=progress)
        elif args.command == "status":
            out = pipeline.cmd_status(cfg)
        elif args.command == "reprocess":
            out = pipeline.cmd_reprocess(cfg, force=args.force, progress=progress)
        else:
            out = pipeline.cmd_verify(cfg, repair=args.repair, progress=progress)
            print(pipeline.to_json(out))
            return 0 if out["ok"] else 1
        print(pipeline.to_json(out))
        return 0
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as exc:
        return report_error(exc)


if __name__ == "__main__":
    sys.exit(main())
