"""Stage 2: train, evaluate and export the drafter from the feature store.

    python -m stage2_train COMMAND --config PRESET [--json] [key=value ...]      (or `dflash-train COMMAND ...`)
    python -m stage2_train train                                # train the CPU default (after `make extract`)
    torchrun --nproc_per_node 8 -m stage2_train train --config my-qwen3.yaml
    python -m stage2_train eval --checkpoint best               # held-out tau [interval] vs untrained vs n-gram
    python -m stage2_train doctor runs/default                  # a run's log (or a wandb / TensorBoard / CSV log)
    python -m stage2_train doctor --export DIR --target ID      # an exported drafter against its target

Every command prints a short summary for people; `--json` prints the full result for scripts.
Logic lives in `commands.py` and the rooms it composes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from shared.cli import Verb, check_options, load_config, print_check, run_cli
from shared.errors import ConfigError
from stage2_train import commands

PROG = "python -m stage2_train"


def main(argv: list[str] | None = None) -> int:
    return run_cli(PROG, __doc__, VERBS, argv)


# ---- the verbs ------------------------------------------------------------------------------------
def batches(args: argparse.Namespace) -> None:
    if args.steps < 1 or args.world_size < 1:
        raise ConfigError(f"--steps and --world-size must be >= 1, got {args.steps} and {args.world_size}")
    for row in commands.cmd_batches(load_config(args), args.steps, args.world_size):
        print(json.dumps(row) if args.json else format_step(row))


def train(args: argparse.Namespace) -> dict[str, Any] | None:
    out = commands.cmd_train(load_config(args), progress=not args.no_progress)
    return out if out["rank"] == 0 else None  # one summary for the job, not one per rank


def check(args: argparse.Namespace) -> None:
    print_check(load_config(args), with_docs=args.explain, quiet=args.quiet)


def log_command(args: argparse.Namespace) -> Any:
    """doctor/report read a training log: the path given as the first argument, else the config's
    run_dir's; the doctor's thresholds are the config's `detectors` section (the live detectors' own).
    `doctor --export DIR` checks an exported drafter against its target instead (`serve/diagnose.py`)."""
    paths = [o for o in args.overrides if "=" not in o]
    if args.command == "doctor" and args.export:
        if paths:
            raise ConfigError(f"doctor --export takes no log path, got {paths}")
        cfg = load_config(args)
        text, code = commands.cmd_doctor_export(cfg, args.export, args.target, args.store, args.data, args.prompts, args.json)
        return {"text": text, "code": code}
    if len(paths) > 1:
        raise ConfigError(f"{args.command} takes one log path (or run directory), got {paths}")
    args.overrides = [o for o in args.overrides if "=" in o]
    cfg = load_config(args)  # torch-free: the doctor reads a log, it never loads a model
    log_path = Path(paths[0]) if paths else Path(cfg.run_dir)
    if args.command == "doctor":
        text, code = commands.cmd_doctor(log_path, args.json, cfg)
        return {"text": text, "code": code}  # text, or JSON with --json: the doctor writes both
    return commands.cmd_report(log_path, Path(args.out) if args.out else None)


# ---- what people read ------------------------------------------------------------------------------
def show_train(out: dict[str, Any]) -> str:
    if out.get("already_complete"):
        return f"already trained: {out['steps']} steps, nothing to do ({out.get('checkpoint')}); log {out['log']}"
    final, held = out.get("final_train") or {}, out.get("final_eval") or {}
    lines = [
        f"trained {out['steps']} steps in {out['elapsed_s'] / 60:.1f} min on {out['world_size']} rank(s): "
        f"loss {final.get('loss', float('nan')):.3f}, accuracy {final.get('accuracy', float('nan')):.3f}, "
        f"accept_len {final.get('accept_len', float('nan')):.2f}",
    ]
    if held:
        walk = f", walk_tau {held['walk_tau']:.3f}" if held.get("walk_tau") is not None else ""
        lines.append(f"held-out: accuracy {held.get('accuracy', float('nan')):.3f}, accept_len {held.get('accept_len', float('nan')):.2f}{walk}")
    lines.append(f"log {out['log']}; next: `{PROG} eval` and `{PROG} export`")
    return "\n".join(lines)


def show_plan(out: dict[str, Any]) -> str:
    mb = out.get("micro_batch", {})
    fits = ", ".join(f"{gpu}: {'fits' if ok else 'does NOT fit'}" for gpu, ok in (out.get("fits") or {}).items())
    lines = [
        f"peak GPU memory per rank: {out['peak_gib']:.1f} GiB (traced step with fake tensors + untraced reserve), "
        f"micro-batch {mb.get('tokens')} tokens / {mb.get('block_rows')} block rows; {fits}",
        f"target shape from {out.get('shape_from')}",
    ]
    if ev := out.get("eval_pack"):
        steps = (out.get("traced_peak_gib") or {}).get("with_checkpointing", {}).get("step_total")
        lines.append(f"the final held-out eval's densest pack ({ev['tokens']} tokens, {ev['block_rows']} block rows, no gradients) "
                     f"is traced after the steps (the steps alone: {steps} GiB traced with checkpointing)")
    for cost, removed in (out.get("removed_costs_gib") or {}).items():
        lines.append(f"not paid: {cost} (would add {removed['would_add']:.2f} GiB)")
    for gpu, best in (out.get("largest_budgets") or {}).items():
        if best["micro_batch_blocks"] is None:
            lines.append(f"{gpu}: not even one sample's blocks fit (traced {best['traced_peak_gib']} GiB)")
        else:
            lines.append(f"largest budgets on {gpu}: sampler.micro_batch_tokens={best['micro_batch_tokens']}, "
                         f"sampler.micro_batch_blocks={best['micro_batch_blocks']}")
    return "\n".join(lines)


def show_eval(out: dict[str, Any]) -> str:
    offline = out["offline"]
    walk = f", walk_tau {offline['walk_tau']:.3f}" if offline.get("walk_tau") is not None else ""
    return "\n".join([
        f"{out['checkpoint']}: {out['num_heldout']} held-out samples",
        f"offline: accuracy {offline['accuracy']:.3f}, accept_len {offline['accept_len']:.3f}{walk}",
        f"written to {out['written_to']}",
        out["summary"],
        *(f"note: {note}" for note in (out["online"] or {}).get("notes", [])),
    ])


def show_export(out: dict[str, Any]) -> str:
    if out.get("pushed_to"):
        return f"exported {out['checkpoint']} -> {out['out_dir']} and pushed to {out['pushed_to']} ({out['commit']})"
    what = f"{out.get('format', 'zlab')} layout, block size {out['block_size']}"
    return f"exported {out['checkpoint']} -> {out['out_dir']} ({what}); README.md is its model card"


def show_report(out: dict[str, Any]) -> str:
    state = "healthy" if out["healthy"] else (f"{out['num_events']} event(s)" if out["num_events"] else "cannot tell")
    return f"{state}: {out['report']} and {len(out['plots'])} plots in {out['out_dir']}"


def format_step(row: dict) -> str:
    return (
        f"epoch {row['epoch']} step {row['step_in_epoch']:>5}: {row['tokens']:>7} tokens, "
        f"{row['num_samples']:>4} samples, lengths p10/p50/p90/max "
        f"{row['length_p10']:.0f}/{row['length_p50']:.0f}/{row['length_p90']:.0f}/{row['length_max']}, "
        f"unused budget {row['padding_fraction']:.3f}, rank tokens {row['rank_tokens']}"
    )


# ---- options -----------------------------------------------------------------------------------------
def batches_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to describe")
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "1")),
                        help="plan for this many ranks (default: $WORLD_SIZE or 1)")


def checkpoint_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", default=None,
                        help="a checkpoint folder, `best` (checkpoint.keep_best), or a drafter folder; default: the newest that verifies")


def export_options(parser: argparse.ArgumentParser) -> None:
    checkpoint_option(parser)
    parser.add_argument("--out", default=None, help="output folder (default run_dir/export)")
    parser.add_argument("--format", choices=("zlab", "speculators"), default="zlab", help="z-lab's layout (SGLang, vLLM dflash) or speculators'")
    parser.add_argument("--push-to-hub", default=None, metavar="REPO", help="upload the folder to this Hub repo (org/name)")


def plan_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--search", action="store_true", help="also the largest sampler budgets (tokens, blocks) that fit each GPU")
    parser.add_argument("--world-size", type=int, default=8, help="ranks (DDP buckets); default 8")


def doctor_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--export", default=None, metavar="DIR", help="check this exported drafter folder (or Hub id) against its target")
    parser.add_argument("--target", default=None, metavar="PATH_OR_ID", help="with --export: the target (default: the config's target.path)")
    parser.add_argument("--store", default=None, metavar="PATH", help="with --export: the store the drafter was trained on (default: the config's, if it exists)")
    parser.add_argument("--data", default=None, metavar="PATH", help="with --export: the conversations the store was made from (default: its manifest's data.source)")
    parser.add_argument("--prompts", type=int, default=4, help="with --export: prompts to decode the drafter on (0: none)")


def out_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="output folder (default: the log's folder/doctor)")


VERBS = [
    Verb("check", "validate the config: every key, departures from the recipe, the global batch", check,
         options=check_options, description="Load and validate the config; print it (or, with --explain, every key "
         "documented), every departure from the published recipe, and the measured alternatives."),
    Verb("batches", "dry run: the next optimizer steps' batches (tokens, lengths, ranks), nothing trained", batches,
         options=batches_options),
    Verb("plan", "GPU memory of one training step at the target's shape (fake tensors), per GPU kind",
         lambda a: commands.cmd_plan(load_config(a), a.search, world_size=a.world_size),
         show=show_plan, options=plan_options),
    Verb("train", "train the drafter from the store (refuses a stale store; resumes from the newest checkpoint)", train,
         show=show_train, description="Train the drafter from the feature store on every rank (torchrun / "
         "accelerate launch), logging to run_dir/train_log.jsonl and wandb, checkpointing asynchronously.",
         interrupted="interrupted: the same command resumes from the newest checkpoint (train.resume=auto; the steps "
                     "after it are trained again)"),
    Verb("eval", "held-out evaluation: offline metrics and speculative decoding vs untrained and n-gram",
         lambda a: commands.cmd_eval(load_config(a), a.checkpoint), show=show_eval, options=checkpoint_option),
    Verb("export", "write a servable drafter folder (z-lab or speculators layout) with its model card",
         lambda a: commands.cmd_export(load_config(a), a.checkpoint, a.out, a.format, push_to_hub=a.push_to_hub),
         show=show_export, options=export_options),
    Verb("doctor", "diagnose a training log: stalls, spikes, cliffs, overfitting (ours, wandb, TensorBoard, CSV)",
         log_command, show=lambda out: out["text"], as_json=lambda out: out["text"], exit_code=lambda out: out["code"],
         options=doctor_options, description="Diagnose a training log: PATH, the first argument without '=' (a run "
         "directory, this trainer's train_log.jsonl, a wandb run, a TensorBoard folder, a CSV/JSONL history; default: "
         "the config's run_dir). Or, with --export, check an exported drafter against its target: mask token, "
         "layer ids, shapes, rotary settings, the chat template the data was rendered with, then decode a few prompts."),
    Verb("report", "plots of a training log with the doctor's events marked, and a Markdown summary", log_command,
         show=show_report, options=out_option, description="Plots of a training log with the doctor's events marked, "
         "and a Markdown summary. PATH, the first argument without '=': a run directory or any log the doctor reads "
         "(default: the config's run_dir)."),
]


if __name__ == "__main__":
    sys.exit(main())
