"""Stage 1: regenerate the answers with the target, then extract its features into the store.

    python -m stage1_extract COMMAND --config PRESET [--json] [key=value ...]   (or `dflash-extract COMMAND ...`)
    python -m stage1_extract plan --gpu h100 --gpus 8            # disk and days before anything runs
    torchrun --nproc_per_node 8 -m stage1_extract generate --config my-qwen3.yaml
    torchrun --nproc_per_node 8 -m stage1_extract extract --config my-qwen3.yaml
    python -m stage1_extract status                               # which shards are current, stale, missing

Every command prints a short summary for people; `--json` prints the full result for scripts.
Logic lives in `commands.py` and the modules it composes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from shared.cli import Verb, check_options, load_config, print_check, run_cli
from shared.files import human_bytes
from stage1_extract import commands
from stage1_extract.backends import backend_problem

PROG = "python -m stage1_extract"
RESUMES = "interrupted: the same command resumes"


def main(argv: list[str] | None = None) -> int:
    return run_cli(PROG, __doc__, VERBS, argv)


def check(args: argparse.Namespace) -> None:
    cfg = load_config(args)
    print_check(cfg, with_docs=args.explain, quiet=args.quiet)
    problem = backend_problem(cfg.generate.backend)
    if problem is not None and not args.quiet:  # `generate` refuses it: said here before a job is queued
        print(f"WARNING: {problem}", file=sys.stderr)


def progress(args: argparse.Namespace) -> bool:
    return not args.no_progress


# ---- what people read ------------------------------------------------------------------------------
def size(n: float | None) -> str:
    return "?" if n is None else human_bytes(n)


def show_download(out: dict[str, Any]) -> str:
    if not out["downloaded"]:
        return out["note"]
    return "\n".join(f"{setting}: {d['hub_id']} at {d['commit']} in {d['folder']}" for setting, d in out["downloaded"].items())


def show_generate(out: dict[str, Any]) -> str:
    if "skipped" in out:
        return f"nothing to generate: {out['skipped']}"
    if out.get("rank", 0) != 0:
        return f"rank {out['rank']}: {out['generated_tokens']} tokens generated"
    return (
        f"{out['conversations']} conversations answered by the target ({out['generated_tokens']} new tokens in "
        f"{out['seconds']:.0f} s, {out['backend']}, {out['world_size']} rank(s); {out['parts_reused']} part(s) reused) "
        f"-> {out['output']}"
        + (f"\n{out['bad_rows_skipped']} bad row(s) of the {out['rows_read']} read from {out['prompts']} skipped "
           f"(data.on_bad_row=skip; the log names them)" if out.get("bad_rows_skipped") else "")
        + (f"\n{out['tool_call_turns_kept']} assistant turn(s) that call tools kept as the data has them"
           if out.get("tool_call_turns_kept") else "")
        + (f"\n{out['long_prompt_turns_kept']} assistant turn(s) whose prompt passed {out['prompt_limit']} tokens "
           f"({out['prompt_limit_why']}) kept as the data has them (the log names the rows)"
           if out.get("long_prompt_turns_kept") else "")
        + (f"\n{out['leading_turns_dropped']} turn(s) before a row's first user turn dropped (they answer nothing)"
           if out.get("leading_turns_dropped") else "")
        + cut_warning(out)
    )


def cut_warning(out: dict[str, Any]) -> str:
    """generate's line on answers cut at generate.max_new_tokens, and on parts too old to say."""
    lines = []
    if out.get("answers_cut"):
        dropped = out["turns_dropped_after_cut"]
        lines.append(
            f"warning: {out['answers_cut']} of {out['answers']} answers ({out['answers_cut_share']:.1%}) were cut at "
            f"generate.max_new_tokens={out['max_new_tokens']} before the target ended them: kept with their end-of-turn "
            f"marker unsupervised{f', the {dropped} later turn(s) of their rows dropped' if dropped else ''}; raise "
            f"generate.max_new_tokens to let them finish"
        )
    if out.get("answers_cut_unknown"):
        lines.append(
            f"{out['answers_cut_unknown']} answer(s) come from parts written before cut answers were recorded: read as "
            f"ended (delete {Path(out['output']).with_suffix('.parts')} to regenerate them)"
        )
    return "".join(f"\n{line}" for line in lines)


def show_plan(out: dict[str, Any]) -> str:
    fits = "" if out.get("fits") is None else (" (fits)" if out["fits"] else " (does NOT fit: free space or --force)")
    lines = [
        f"{out['samples']:,} samples, {out['tokens']:,} tokens x {out['bytes_per_token']:,} B/token = "
        f"{size(out['total_bytes'])} in {out['storage']} ({out['compression_note']}); free {size(out.get('free_bytes'))}{fits}",
    ]
    lines.append(
        f"{out['bad_rows_skipped']} bad row(s) skipped; {out['samples_truncated']:,} sample(s) truncated and "
        f"{out['samples_skipped']:,} skipped at data.max_length" + (" (estimated)" if out.get("answers_estimated") else "")
    )
    if rows_line(out.get("rows")):
        lines.append(rows_line(out["rows"]).strip("\n"))
    if out.get("answers_estimated"):
        lines.append(f"answers not generated yet, {out['answers_estimated']}; at most {size(out['total_bytes_at_most'])}")
    if out.get("generated_data"):
        lines.append(f"generated data: {out['generated_data']}")
    memory = out.get("gpu_memory")
    if memory:
        lines.append(
            f"GPU memory while extracting: {memory['weights_gib_per_gpu']} GiB weights + {memory['working_set_gib']} GiB working "
            f"set + {memory['reserve_gib']:g} reserve = {memory['total_gib']} of {memory['gpu_memory_gib']:g} GiB per "
            f"{memory['gpu']} at extract.tensor_parallel_size={memory['tensor_parallel_size']} ({memory['basis']})"
        )
    for stage, est in (out.get("time") or {}).items():
        lines.append(f"{stage}: ~{duration(est['hours'])} on {est['gpus']} x {est['gpu']} ({est['basis']})")
    return "\n".join(lines)


def duration(hours: float) -> str:
    if hours < 1 / 60:
        return "< 1 min"
    if hours < 1:
        return f"{hours * 60:.0f} min"
    return f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.1f} days ({hours:,.0f} h)"


def show_extract(out: dict[str, Any]) -> str:
    did = f"{out['shards_extracted_here']} shard(s) extracted"
    if "tok_per_s" in out:
        did += f" ({out['tokens']:,} tokens, {out['tok_per_s']:.0f} tok/s)"
    head = f"{out['store']}: {did}, {out['shards_already_done']} already done, {out['shards_total']} in all"
    if "num_samples" not in out:
        return head
    return head + (
        f"\nmanifest: {out['num_samples']} samples, {out['num_tokens']:,} tokens, {size(out['num_bytes'])}; "
        f"{out['num_truncated']} truncated, {out['num_skipped']} skipped, {out['bad_rows_skipped']} bad row(s) skipped"
        + (f"; {out['num_duplicates']} duplicate(s) (kept on one side of the held-out split by their {out['split_key']})"
           if out.get("num_duplicates") else "")
        + rows_line(out.get("rows"))
        + cut_answers(out)
    )


def rows_line(rows: dict[str, Any] | None) -> str:
    """The user's rows on their way to the store, counted at each stage (merge.row_accounting), as one
    line (row numbers in the log and the store count from 0)."""
    if not rows:
        return ""
    known = "?" if rows["rows"] is None else f"{rows['rows']:,}"
    line = f"\nrows: {known} read from {rows['data']}"
    if "dropped_by_generate" in rows:
        dropped = rows["dropped_by_generate"]
        line += f" -> {'?' if dropped is None else dropped} dropped by generate (bad rows)"
    line += (
        f" -> {rows['dropped_by_extract']} dropped by extract ({rows['bad_rows_skipped_by_extract']} bad, "
        f"{rows['skipped_too_long']} too long with data.on_long=skip) -> {rows['stored']:,} stored"
    )
    if rows["leading_turns_dropped"]:
        line += f"; {rows['leading_turns_dropped']} turn(s) before a row's first user turn dropped"
    if rows.get("dropped_by_generate", 0) is None:
        line += f" (generate's counts unknown: {rows['generated']} predates them; rerun generate to record them)"
    return line


def cut_answers(out: dict[str, Any]) -> str:
    """The store's answers cut at generate.max_new_tokens (the manifest's data block), as one line."""
    return (
        f"\n{out['answers_cut']} answer(s) cut at generate.max_new_tokens: their end-of-turn marker is not supervised"
        if out.get("answers_cut") else ""
    ) + (f"\n{out['answers_cut_unknown']} regenerated answer(s) from a file that does not record cuts: read as ended"
         if out.get("answers_cut_unknown") else "") + (
        f"\n{out['context_turns']} assistant turn(s) kept as context, not supervised: the chat template renders them "
        f"otherwise once a later user turn follows (Qwen3 drops their reasoning), as the target sees them when serving"
        if out.get("context_turns") else "")


def show_status(out: dict[str, Any]) -> str:
    c = out["counts"]
    lines = [
        f"{out['store']}: {c['current']} current, {c['stale']} stale, {c['missing']} missing, {c['orphaned']} orphaned "
        f"({out['shards_done']}/{out['shards_total']} shards done, {out['tokens_done']:,}/{out['tokens_total']:,} tokens)",
    ]
    if out.get("manifest_damaged"):
        lines.append(f"manifest: {out['manifest_damaged']}")
    if out.get("generated_data") not in (None, "current"):
        lines.append(f"generated data: {out['generated_data']}")
    if rows_line(out.get("rows")):
        lines.append(rows_line(out["rows"]).strip("\n"))
    if cut_answers(out):
        lines.append(cut_answers(out).strip("\n"))
    for row in out["shards"]:
        if row["state"] != "current":
            lines.append(f"  shard {row['index']}: {row['state']} ({row['why']})")
    lines.append("complete" if out["complete"] else f"not complete: `{PROG} reprocess` re-extracts what is not current")
    return "\n".join(lines)


def show_verify(out: dict[str, Any]) -> str:
    if out.get("rank", 0) != 0:  # verify --repair under torchrun: rank 0 verifies, this rank helped extract
        return f"rank {out['rank']}: " + (show_extract(out["extract"]) if out.get("extract") else "nothing to repair")
    lines = [f"{out['store']}: {out['shards_checked']} shards checked{' (deep: against the data)' if out.get('deep') else ''}"]
    for bad in out["bad_shards"]:
        lines.append(f"  {bad['shard']}: {bad['error']}")
    if out.get("repaired"):
        lines.append(f"repaired: {', '.join(out['repaired'])}")
    if cut_answers(out):
        lines.append(cut_answers(out).strip("\n"))
    # A shard only the data proves bad is found again, and repaired, by a deep check alone.
    repair = "verify --deep --repair" if any(b.get("deep") for b in out["bad_shards"]) else "verify --repair"
    lines.append("ok" if out["ok"] else f"{len(out['bad_shards'])} bad shard(s): `{PROG} {repair}` repairs them")
    return "\n".join(lines)


def show_reprocess(out: dict[str, Any]) -> str:
    if out.get("rank", 0) != 0:
        return show_extract(out)
    return show_extract(out) + (
        f"\nre-extracted {out['reextracted'] or 'nothing'}; orphans removed {out['orphans_removed'] or 'none'}"
        + (f"; settings that changed: {', '.join(out['settings_changed'])}" if out.get("settings_changed") else "")
    )


# ---- options -----------------------------------------------------------------------------------------
def force_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true", help="extract even when the plan says the disk is too small")


def verify_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repair", action="store_true", help="re-extract every bad shard")
    parser.add_argument("--deep", action="store_true", help="also tokenize the data again and compare every stored sample")


def status_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--deep", action="store_true", help="rehash the target's weights whatever the fingerprint cache says")


def plan_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu", default=None, help="GPU kind for the time estimates: h100 (default), h200, a100, l40s")
    parser.add_argument("--gpus", type=int, default=8, help="how many of them (default 8)")


VERBS = [
    Verb("check", "validate the config: every key, departures from the recipe", check, options=check_options),
    Verb("download", "fetch the Hub ids the config names (target.path, model.init_from) into the HF cache",
         lambda a: commands.cmd_download(load_config(a)), show=show_download,
         description="The one command that fetches from the Hub: every other command reads the local Hugging Face cache "
                     "(only `python -m stage2_train export --push-to-hub` uploads).",
         interrupted=f"{RESUMES} (files already downloaded are kept)"),
    Verb("plan", "the store's size and free space, and time estimates, before anything runs",
         lambda a: commands.cmd_plan(load_config(a), gpu=a.gpu, gpus=a.gpus), show=show_plan, options=plan_options),
    Verb("generate", "the target rewrites every assistant turn (vllm on GPU, transformers on CPU); resumable",
         lambda a: commands.cmd_generate(load_config(a), progress=progress(a)), show=show_generate,
         interrupted=f"{RESUMES} (finished parts are kept)"),
    Verb("extract", "run the target once over the data and store its features (resumable, every rank)",
         lambda a: commands.cmd_extract(load_config(a), force=a.force, progress=progress(a)), show=show_extract,
         options=force_option, interrupted=f"{RESUMES} (finished shards are kept)"),
    Verb("status", "each shard current, stale (and why), missing or orphaned, against the config and data",
         lambda a: commands.cmd_status(load_config(a), deep=a.deep), show=show_status, options=status_options),
    Verb("verify", "every shard against the manifest (and, --deep, against the data); --repair re-extracts",
         lambda a: commands.cmd_verify(load_config(a), repair=a.repair, progress=progress(a), deep=a.deep),
         show=show_verify, options=verify_options, exit_code=lambda out: 0 if out["ok"] else 1),
    Verb("reprocess", "re-extract only the stale and missing shards, drop orphans, rewrite the manifest",
         lambda a: commands.cmd_reprocess(load_config(a), force=a.force, progress=progress(a)), show=show_reprocess,
         options=force_option, interrupted=f"{RESUMES} (shards already re-extracted are kept)"),
]


if __name__ == "__main__":
    sys.exit(main())
