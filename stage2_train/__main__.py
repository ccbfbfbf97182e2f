"""Stage 2 entry point.

    python -m stage2_train {batches,train,eval,export,doctor,report,check} --config configs/default.yaml [key=value ...]
    python -m stage2_train batches --steps 20 --json          # one JSON object per optimizer step
    python -m stage2_train check --explain                    # every key, its value, default and meaning
    python -m stage2_train doctor [runs/default/train_log.jsonl] [--json]   # default: the config's run_dir
    torchrun --standalone --nproc_per_node 2 -m stage2_train train train.max_steps=50

Parses the config, runs one command from `commands.py`, prints its JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from shared.cli import command_parser, load_config, print_check, run_command, to_json
from shared.errors import ConfigError
from stage2_train import commands

COMMANDS = ("batches", "train", "plan", "eval", "export", "doctor", "report", "check")


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("python -m stage2_train", __doc__, COMMANDS)
    parser.add_argument("--json", action="store_true", help="batches: one JSON object per line; doctor: JSON")
    parser.add_argument("--steps", type=int, default=20, help="batches: optimizer steps to describe")
    parser.add_argument(
        "--world-size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", "1")),
        help="batches: plan for this many ranks (default: $WORLD_SIZE or 1)",
    )
    parser.add_argument("--checkpoint", default=None, help="eval/export: a checkpoint folder, or `best` (checkpoint.keep_best; default: the newest that verifies)")
    parser.add_argument("--out", default=None, help="export, report: output folder")
    parser.add_argument("--format", choices=("zlab", "speculators"), default="zlab", help="export: z-lab's layout (SGLang, vLLM dflash) or speculators'")
    parser.add_argument("--search", action="store_true", help="plan: also the largest sampler budgets (tokens, blocks) that fit each GPU")
    return run_command(parser, argv, run)


def run(args: argparse.Namespace) -> int:
    if args.command in ("doctor", "report"):
        return log_command(args)
    cfg = load_config(args)
    if args.command == "check":
        print_check(cfg, with_docs=args.explain, quiet=args.quiet)
        return 0
    if args.command == "batches":
        if args.steps < 1 or args.world_size < 1:
            raise ConfigError(f"--steps and --world-size must be >= 1, got {args.steps} and {args.world_size}")
        for row in commands.cmd_batches(cfg, args.steps, args.world_size):
            print(json.dumps(row) if args.json else format_step(row))
        return 0
    if args.command == "train":
        out = commands.cmd_train(cfg, progress=not args.no_progress)
        if out["rank"] == 0:
            print(to_json(out))
        return 0
    if args.command == "plan":
        print(to_json(commands.cmd_plan(cfg, args.search, world_size=max(args.world_size, 8))))
        return 0
    if args.command == "eval":
        print(to_json(commands.cmd_eval(cfg, args.checkpoint)))
        return 0
    print(to_json(commands.cmd_export(cfg, args.checkpoint, args.out, args.format)))
    return 0


def log_command(args: argparse.Namespace) -> int:
    """doctor/report read a training log: the path given as the first argument, else the config's
    run_dir's; the doctor's thresholds are the config's `doctor` section (defaults unless set)."""
    paths = [o for o in args.overrides if "=" not in o]
    if len(paths) > 1:
        raise ConfigError(f"{args.command} takes one log path (or run directory), got {paths}")
    args.overrides = [o for o in args.overrides if "=" in o]
    cfg = load_config(args)  # torch-free: the doctor reads a log, it never loads a model
    log_path = Path(paths[0]) if paths else Path(cfg.run_dir)
    if args.command == "doctor":
        text, code = commands.cmd_doctor(log_path, args.json, cfg)
        print(text)
        return code
    print(to_json(commands.cmd_report(log_path, Path(args.out) if args.out else None)))
    return 0


def format_step(row: dict) -> str:
    return (
        f"epoch {row['epoch']} step {row['step_in_epoch']:>5}: {row['tokens']:>7} tokens, "
        f"{row['num_samples']:>4} samples, lengths p10/p50/p90/max "
        f"{row['length_p10']:.0f}/{row['length_p50']:.0f}/{row['length_p90']:.0f}/{row['length_max']}, "
        f"unused budget {row['padding_fraction']:.3f}, rank tokens {row['rank_tokens']}, "
        f"{row['blocks']} blocks (budget filled {row['block_fill']:.3f}), rank blocks {row['rank_blocks']}"
    )


if __name__ == "__main__":
    sys.exit(main())
