"""Run every benchmark and write BENCHMARKS.md and bench/results.json from that one run.

    make bench            # = .venv/bin/python bench/run_all.py [--only data,extract,...]

Each figure is a ratio against a baseline measured in the same run (the machines are noisy).
Each benchmark runs as its own subprocess, one after another (never two on 2 cores at once).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable

BENCHES = {
    "data": ["bench/data.py"],
    "sampler": ["bench/sampler.py"],
    "extract": ["bench/extract.py", "--samples", "48"],
    "reader": ["bench/reader.py"],
    "store8b": ["bench/store8b.py"],
    "train": ["bench/train.py"],
    "checkpoint": ["bench/checkpoint.py"],
    "learning": ["bench/learning.py"],
    "scaling": ["bench/scaling.py", "--base-samples", "16", "--length-tokens", "8192"],
    "eval_cost": ["bench/eval_cost.py"],
    "attention": ["bench/attention.py"],
    "projection": ["bench/projection.py"],
}
# Run on request only (`--only learning_long`): the long CPU preset trains up to an hour.
EXTRA_BENCHES = {
    "learning_long": ["bench/learning.py", "--config", "configs/cpu-long.yaml", "--n", "100"],
    "plan8b": ["bench/plan.py"],  # ~10 min of fake-tensor traces on 2 cores
    # Settings at equal steps and seed, decoded on the same prompts with paired intervals (~2 h; ~1.5 h).
    "levers": [
        "bench/compare.py", "--name", "levers-default", "--steps", "400", "--heldout", "12", "--unseen", "32",
        "--variant", "base:loss.weighting=decay", "--variant", "dpace:loss.weighting=dpace",
        "--variant", "muon:loss.weighting=decay,optim.name=muon",
        "--variant", "distill:loss.weighting=decay,loss.distill_positions=all",
        "--variant", "distill16:loss.weighting=decay,loss.distill_positions=all,sampler.max_anchors_per_seq=16",
        "--variant", "sliding64:loss.weighting=decay,model.layer_types=[sliding_attention],model.sliding_window=64",
        "--variant", "pcaH:loss.weighting=decay,model.feature_projection=pca",
        "--variant", "pcaH2:loss.weighting=decay,model.feature_projection=pca,model.projection_dim=288",
    ],
    # Needs the all-questions store first: make extract ARGS="run_dir=runs/questions data.default_question_share=1.0"
    "questions": [
        "bench/compare.py", "--name", "qmix", "--steps", "400", "--heldout", "0", "--unseen", "44",
        "--variant", "mixed:", "--variant", "questions:store.path=runs/questions/store",
    ],
    "levers_long": [
        "bench/compare.py", "--config", "configs/cpu-long.yaml", "--name", "levers-cpu-long", "--steps", "1600",
        "--heldout", "24", "--unseen", "16", "--variant", "dpace:", "--variant", "decay:loss.weighting=decay",
        "--variant", "sliding64:model.layer_types=[sliding_attention],model.sliding_window=64",
    ],
    # DFlash (the CPU default: D-PACE) against DSpark and DFlash2 trained from the same store, same seed
    # and steps, decoded on the same prompts; DSpark also with its confidence stop (~1 h; ~2.5 h).
    "variants": [
        "bench/compare.py", "--name", "variants-default", "--steps", "400", "--heldout", "12", "--unseen", "32",
        "--variant", "dflash:", "--variant", "dspark:model.variant=dspark", "--variant", "dflash2:model.variant=dflash2",
        "--confidence-stop", "dspark=0.5",
    ],
    "variants_long": [
        "bench/compare.py", "--config", "configs/cpu-long.yaml", "--name", "variants-cpu-long", "--steps", "1600",
        "--heldout", "24", "--unseen", "16", "--variant", "dflash:", "--variant", "dspark:model.variant=dspark",
        "--variant", "dflash2:model.variant=dflash2", "--confidence-stop", "dspark=0.5",
    ],
}
GPU_RESULT = REPO / "bench" / "results" / "gpu_check.json"  # copied here from a device run, never made by make bench


def run(name: str, out_dir: Path) -> dict:
    out = out_dir / f"{name}.json"
    spec = {**BENCHES, **EXTRA_BENCHES}[name]
    command = [PY, *spec, "--json", str(out)]
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        return {"error": proc.stderr[-3000:], "seconds": round(seconds, 1), "command": " ".join(command[1:])}
    result = json.loads(out.read_text())
    return {"result": result, "seconds": round(seconds, 1), "command": ".venv/bin/python " + " ".join(spec)}


def fmt(value, digits=3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def rows_for(name: str, r: dict) -> list[tuple[str, str, str, str, str]]:
    """(figure, value, goal, baseline measured in the same run, met?)"""
    rows = []
    if name == "plan8b":
        for preset, p in r["presets"].items():
            fits = ", ".join(f"{gpu}: {'yes' if ok else '**no**'}" for gpu, ok in p["fits"].items())
            mb = p["micro_batch"]
            rows.append((f"{preset}: peak GPU memory of one training step ({mb['tokens']} tokens, {mb['block_rows']:,} block rows, checkpointing)",
                         f"{p['peak_gib']} GiB", "fits 80 GB", f"without checkpointing {p['traced_peak_gib']['without_checkpointing']['peak_with_untraced']} GiB; {fits}",
                         "yes" if p["fits"]["H100/A100 80 GB"] else "**no**"))
            for gpu, best in p.get("largest_micro_batch_tokens", {}).items():
                rows.append((f"{preset}: largest sampler.micro_batch_tokens that fits {gpu}", fmt(best["micro_batch_tokens"]), "",
                             f"traced peak {best['traced_peak_gib']} GiB + untraced {round(p['untraced_gib']['ddp_buckets'] + p['untraced_gib']['cuda_context_nccl_fragmentation'], 1)} GiB", ""))
    if name == "eval_cost":
        rows.append((f"held-out evals' share of training time ({r['evals_during_training']} evals of {r['offline_max_samples']} samples x "
                     f"{r['anchors_per_sample_during_training']} anchors, every {r['every_steps']} of {r['steps']} steps)",
                     f"{r['eval_share']:.1%}", "<= 5%", f"each {', '.join(str(x) for x in r['eval_s_each'])} s; median step {r['median_step_s']:.3g} s",
                     yes(r["eval_share"] <= 0.05)))
        rows.append(("the same curve with every anchor scored (final eval's cost x evals)", f"{r['dense_curve_share_estimate']:.1%}", "",
                     f"final dense eval {r['final_dense_eval_s']} s, {r['final_dense_blocks']} blocks", ""))
    if name == "attention":
        full = r["kinds"]["full"]
        for kind, k in r["kinds"].items():
            if kind == "full":
                continue
            rows.append((f"{kind} at {r['context']:,} context, {r['anchors']} anchors: visible pairs (flex's work) / SDPA masks / largest group's fp32 scores",
                         f"{k['visible_pairs_vs_full']}x / {k['sdpa_mask_mb']} MB / {k['largest_group_scores_mb_fp32_32_heads']:,} MB", "falls with W",
                         f"full: 1.0 / {full['sdpa_mask_mb']} MB / {full['largest_group_scores_mb_fp32_32_heads']:,} MB", ""))
    if name in ("variants", "variants_long"):
        base = r["baseline"]
        p = r["prompts"]
        rows.append((f"prompts decoded ({r['max_new_tokens']} new tokens each, every output equal to the target's greedy one)",
                     f"{p['all']}: {p['heldout']} held-out, {p['excerpt']} excerpt, {p['question']} question", "", "", ""))
        for variant, v in r["results"].items():
            a, d = v["all"], v["drafted_per_step"]
            paired = "" if variant == base or "diff" not in a else f"{a['diff']:+.3f} [{a['diff_lo']:+.3f}, {a['diff_hi']:+.3f}]"
            extra = f"; walk_tau {v['walk_tau']} +- {v['walk_tau_se']}" if "walk_tau" in v else ""
            if "params" in v:
                extra += f"; {v['params'] / 1e6:.1f} M trained parameters, {v['median_step_s']} s/step (median), {v['cpu_min']} CPU min"
            rows.append((f"online tau `{variant}` (95% interval) / drafted tokens per step [interval] / excerpt / question",
                         f"{a['tau']:.3f} [{a['lo']:.3f}, {a['hi']:.3f}] / {d['drafted_per_step']:.2f} [{d['lo']:.2f}, {d['hi']:.2f}] / "
                         + " / ".join(f"{v[k]['tau']:.3f}" for k in ("excerpt", "question") if k in v),
                         "", (f"paired vs `{base}`: {paired}" if paired else f"the baseline `{base}`" if variant == base else "") + extra,
                         "" if v.get("exact", True) else "**outputs differ**"))
        if r.get("png"):
            rows.append(("plot", f"![{name}]({r['png']})", "", "", ""))
    if name in ("levers", "levers_long", "questions"):
        base = r["baseline"]
        p = r["prompts"]
        rows.append((f"prompts decoded ({r['max_new_tokens']} new tokens each, every output equal to the target's greedy one)",
                     f"{p['all']}: {p['heldout']} held-out, {p['excerpt']} excerpt, {p['question']} question", "", "", ""))
        for variant, v in r["results"].items():
            a = v["all"]
            paired = "" if variant == base or "diff" not in a else f"{a['diff']:+.3f} [{a['diff_lo']:+.3f}, {a['diff_hi']:+.3f}]"
            extra = f"; walk_tau {v['walk_tau']} +- {v['walk_tau_se']}" if "walk_tau" in v else ""
            extra += f"; {v['cpu_min']} CPU min of training" if "cpu_min" in v else ""
            kinds = [k for k in ("heldout", "excerpt", "question") if k in v]
            rows.append((f"online tau `{variant}` (95% interval over prompts) / " + " / ".join(kinds),
                         f"{a['tau']:.3f} [{a['lo']:.3f}, {a['hi']:.3f}] / " + " / ".join(f"{v[k]['tau']:.3f}" for k in kinds),
                         "", (f"paired vs `{base}`: {paired}" if paired else f"the baseline `{base}`") + extra,
                         "" if v.get("exact", True) else "**outputs differ**"))
        if "ngram" in r["results"] and r["results"].get(base):
            best = max((k for k in r["results"] if k not in ("ngram", "untrained")), key=lambda k: r["results"][k]["all"]["tau"])
            b, g = r["results"][best]["all"], r["results"]["ngram"]["all"]
            rows.append((f"best drafter `{best}` against the n-gram drafter (same prompts)", f"{b['tau']:.3f} vs {g['tau']:.3f}",
                         "above, interval clear", f"n-gram interval [{g['lo']:.3f}, {g['hi']:.3f}]", yes(b["lo"] > g["tau"])))
        if r.get("png"):
            rows.append(("plot", f"![{name}]({r['png']})", "", "", ""))
    if name == "projection":
        for key, kept in r["energy_kept_heldout"].items():
            rows.append((f"projection {key}: second moment kept on held-out shards / median relative error",
                         f"{kept} / {r['relative_error_median'][key]}", "", f"fp8 storage error {r['fp8_relative_error_median']}", ""))
        b = r["bytes_per_token_qwen3_8b"]
        rows.append(("bytes/token at Qwen3-8B (5 x 4096, top-64): bf16 / fp8 / fp8 + projection r=H",
                     f"{fmt(b['bf16'])} / {fmt(b['fp8'])} / {fmt(b['fp8+projection r=H'])}", "",
                     f"fp8 {b['fp8_over_bf16']}x, projected {b['projected_over_bf16']}x of bf16", ""))
        f = r["fold_exactness"]
        rows.append(("export folds the projection into fc: max |logit diff| / argmax agreement", f"{f['max_abs_logit_diff']:.2g} / {f['argmax_agreement']}",
                     "argmax 1.0", "", yes(f["argmax_agreement"] == 1.0)))
    if name == "extract":
        rows.append(("extraction wall time / pure target forward", fmt(r["extract_over_forward"]), "<= 1.15",
                     f"forward {r['forward_s']} s on {r['tokens']} tokens"
                     + (f" ({r['padded_tokens']} padded)" if "padded_tokens" in r else ""), yes(r["extract_over_forward"] <= 1.15)))
        bpt = r["bytes_per_token"]
        peer = bpt["torch.save per sample (SpecForge-style, no top-k)"]
        for key in ("bf16+none", "bf16+zstd", "fp8+none", "fp8+zstd"):
            rows.append((f"bytes/token {key} (incl. top-64)", fmt(bpt[key]), "", f"torch.save per sample: {fmt(peer)} (no top-k)", ""))
        rows.append(("fp8 / bf16 bytes (whole store)", fmt(r["fp8_over_bf16"]), "<= 0.55", "bf16 in the same run", yes(r["fp8_over_bf16"] <= 0.55)))
        if "bytes_per_token_by_array" in r:
            arrays = r["bytes_per_token_by_array"]
            names = [k for k in dict.fromkeys([*arrays["bf16"], *arrays["fp8"]]) if max(arrays["bf16"].get(k, 0), arrays["fp8"].get(k, 0)) >= 1]
            split = ", ".join(f"{k} {fmt(arrays['bf16'].get(k, 0))} -> {fmt(arrays['fp8'].get(k, 0))}" for k in names)
            rows.append(("where the bytes go (bytes/token per array, bf16 -> fp8, uncompressed)", split, "", "", ""))
        rows.append(("fp8 / bf16 bytes (hidden states only)", fmt(r.get("fp8_hidden_over_bf16")), "<= 0.55", "top-k costs the same in both",
                     yes(r.get("fp8_hidden_over_bf16", 1) <= 0.55)))
        rows.append(("fp8 / bf16 bytes at Qwen3-8B size (formula)", fmt(r.get("fp8_over_bf16_at_qwen3_8b")), "<= 0.55", "", yes(r.get("fp8_over_bf16_at_qwen3_8b", 1) <= 0.55)))
        rows.append(("fp8 reconstruction error (relative L2, mean / p99)", f"{r['fp8_rel_error_mean']} / {r['fp8_rel_error_p99']}", "",
                     f"bf16 rounding alone: {r['bf16_rel_error_mean']}", ""))
        if "writer_seconds" in r:
            rows.append((f"who limits extraction: writer threads busy ({r['writer_threads']} threads, summed) / target forward",
                         f"{r['writer_seconds']} s / {r['extract_forward_s']} s", "writer < forward",
                         f"forward blocked on a full queue {r['writer_queue_wait_s']} s; peak queue {r['writer_peak_queue_mb']} MB", yes(r["writer_seconds"] / r["writer_threads"] < r["extract_forward_s"])))
        rows.append((f"random {r['read_window_tokens']}-token window reads", f"{r['read_windows_per_s']}/s ({r['read_mb_per_s']} MB/s)", "", "", ""))
    elif name == "data":
        res = r["results"]
        ours, buckets, hf = res["ours@8x4"], res["six_buckets@8x4"], res["hf_group_by_length@8x4"]
        rows.append((f"packing efficiency, budget {r['token_budget']} (8 ranks x 4 accum)", fmt(ours["efficiency"]), ">= 0.98",
                     f"six buckets {fmt(buckets['efficiency'])}, HF group_by_length {fmt(hf['efficiency'])}", yes(ours["efficiency"] >= 0.98)))
        one = res["ours@1x1"]
        rows.append(("packing efficiency, 1 rank", fmt(one["efficiency"]), ">= 0.98", f"six buckets {fmt(res['six_buckets@1x1']['efficiency'])}", yes(one["efficiency"] >= 0.98)))
        rows.append(("length mixing: TV distance per optimizer step, median / worst (8x4)",
                     f"{fmt(ours['mixing_tv_median'])} / {fmt(ours['mixing_tv_worst'])}", "lower is better",
                     f"six buckets {fmt(buckets['mixing_tv_median'])} / {fmt(buckets['mixing_tv_worst'])}", ""))
        for ranks in (2, 8):
            key = f"ours@{ranks}x1"
            rows.append((f"token imbalance max/mean, {ranks} ranks (worst step)", fmt(res[key]["imbalance_worst"], 4), "<= 1.05",
                         f"six buckets {fmt(res[f'six_buckets@{ranks}x1']['imbalance_worst'])}", yes(res[key]["imbalance_worst"] <= 1.05)))
    elif name == "train":
        t = r["throughput"]
        rows.append(("training tokens/s on CPU (tiny store)", fmt(t["tok_per_s"]), "", f"{t['blocks_per_s']} blocks/s", ""))
        split = ", ".join(f"{k.replace('_s', '')} {v:.0%}" for k, v in t["split_share"].items())
        rows.append(("step time split", split, "", f"step {t['step_s']} s", ""))
        rows.append(("data-wait fraction during training", fmt(t["data_wait_frac"]), "< 0.02", "", yes(t["data_wait_frac"] < 0.02)))
        if t.get("boundary_over_median_max") is not None:
            rows.append((f"longest step-to-step gap at an epoch boundary / median step ({t['epochs']} epochs)",
                         fmt(t["boundary_over_median_max"]), "<= 1.2",
                         f"median {t['median_step_gap_s']} s; boundaries {t['boundary_step_gaps_s']}",
                         yes(t["boundary_over_median_max"] <= 1.2)))
        if "loader" in r:
            rows.append(("loader delivery rate / trainer consumption", fmt(r["loader"]["loader_over_trainer"]), ">= 5",
                         f"trainer {r['loader']['trainer_batches_per_s']} batches/s", yes(r["loader"]["loader_over_trainer"] >= 5)))
        if "ddp" in r:
            d = r["ddp"]
            rows.append(("2 processes vs 1, same global batch: max rel. loss diff", fmt(d["max_rel_loss_diff"]), "float tolerance",
                         f"{d['steps']} steps", yes(d["max_rel_loss_diff"] < 1e-5)))
    elif name == "checkpoint":
        a = next(x for x in r["results"] if x["mode"] == "async")
        s = next(x for x in r["results"] if x["mode"] == "sync")
        rows.append((f"loop blocked by a save / median step ({a['checkpoint_mb']} MB state)", f"{a['blocked_over_step_median']} (max {a['blocked_over_step_max']})",
                     "<= 0.5", f"sync save: {s['blocked_over_step_median']} (max {s['blocked_over_step_max']})", yes(a["blocked_over_step_max"] <= 0.5)))
        rows.append(("step time during a save / median", f"{a['during_over_step_mean']} (max {a['during_over_step_max']})", "<= 1.5",
                     "", yes(a["during_over_step_mean"] is not None and a["during_over_step_mean"] <= 1.5)))
    elif name in ("learning", "learning_long"):
        points = r["points"]
        first, last = points[0], points[-1]
        curve = " / ".join(f"{p['online_tau']:.3f}" for p in points)
        steps = " / ".join(str(p["step"]) for p in points)
        cpu = " / ".join(f"{p['cpu_min']:.1f}" for p in points)
        rows.append((f"online tau after {steps} steps ({r['prompts']} held-out prompts x {r['max_new_tokens']} tokens)", curve, "",
                     f"n-gram drafter {fmt(r['ngram_tau'])} on the same prompts; CPU minutes {cpu}", ""))
        rows.append(("trained - untrained online tau (last point)", fmt(last["online_tau"] - first["online_tau"]), ">= 0.3",
                     f"untrained {fmt(first['online_tau'])}", yes(last["online_tau"] - first["online_tau"] >= 0.3)))
        rows.append(("trained - n-gram online tau (last point)", fmt(last["online_tau"] - r["ngram_tau"]), "> 0",
                     f"n-gram {fmt(r['ngram_tau'])}", yes(last["online_tau"] > r["ngram_tau"])))
        worst = max(abs(p["walk_over_online"] - 1) for p in points)
        rows.append(("offline walk_tau vs online tau, worst relative gap over the points", fmt(worst), "<= 0.15",
                     " / ".join(f"{p['walk_tau']:.3f}" for p in points), yes(worst <= 0.15)))
        exact = all(p["exact"] for p in points) and r["ngram_exact"]
        rows.append(("speculative output == target greedy, every point", str(exact), "True", "", yes(exact)))
        rows.append(("plot", f"![learning curve]({r['png']})", "", "", ""))
    elif name == "sampler":
        st, b = r["startup"], r["plan_builds"]
        rows.append((f"plan builds per epoch per rank ({r['samples']:,} samples, {r['ranks']} ranks, {b['epochs_handed_out']} epochs)",
                     fmt(b["builds_per_epoch"]), "1", f"plans held at once: {b['plans_in_memory']}", yes(b["builds_per_epoch"] <= 1.0)))
        rows.append(("CPU seconds per epoch plan", fmt(r["plan_cpu_s"]), "<= 1.0",
                     f"float-keyed search {r['searchsorted_us']['float_key']} us vs int key {r['searchsorted_us']['int_key']} us per call",
                     yes(r["plan_cpu_s"] <= 1.0)))
        rows.append(("sampler start-up before the first micro-batch (split, plan, schedule length)", f"{st['wall_s']} s", "<= 5 s",
                     f"planning every epoch up front: {r['baseline_plan_every_epoch_up_front_cpu_s']} CPU s", yes(st["wall_s"] <= 5)))
        rows.append(("longest wait for a micro-batch over 4 epochs (the next plan is built ahead)", f"{b['max_wait_for_a_micro_batch_s']} s",
                     "", "", ""))
        rss = r["peak_rss_mib_after_epochs"]
        rows.append(("peak RSS MiB after 1 / 2 / 4 epochs", " / ".join(str(v) for v in rss.values()), "flat", "", ""))
    elif name == "reader":
        sp = r["samples_per_s"]
        for mode in ("cold", "warm"):
            m = sp[mode]
            rows.append((f"random sample reads, {mode} page cache, store as configured ({r['storage']['compression']}) / per-file safetensors",
                         fmt(m["ratio"]), ">= 0.5", f"{m['store']} vs {m['per_file']} samples/s", yes(m["ratio"] >= 0.5)))
            rows.append((f"random sample reads, {mode} page cache, same store uncompressed / per-file safetensors",
                         fmt(m["ratio_uncompressed"]), ">= 0.5", f"{m['store_uncompressed']} vs {m['per_file']} samples/s",
                         yes(m["ratio_uncompressed"] >= 0.5)))
        m = sp["steady"]
        rows.append(("1,000 random reads by one long-lived reader (its chunk cache warm) / per-file", fmt(m["ratio"]), "",
                     f"{m['store']} vs {m['per_file']} samples/s", ""))
    elif name == "store8b":
        seq, ld = r["sequential_read_mb_per_s"], r["loader"]
        rows.append((f"8B-shaped store ({r['features']}, {r['tokens_per_sample']} tokens/sample, {r['samples']} samples, {r['store_gib']} GiB)",
                     f"written at {r['write']['mb_per_s']} MB/s", "", "the project's writer", ""))
        for mode in ("cold", "warm"):
            rows.append((f"loader MB/s ({ld['threads']} threads, 512 anchors x 16 slots collated) / sequential read, {mode}",
                         fmt(ld[mode]["over_sequential"]), ">= 0.7", f"{ld[mode]['mb_per_s']} vs {seq[mode]} MB/s",
                         yes(ld[mode]["over_sequential"] >= 0.7)))
        d = r["h200_demand"]
        rows.append(("loader samples/s / what one H200 trains (5-layer 8B drafter, 40% MFU)", fmt(r["loader_over_h200_demand"]), ">= 1",
                     f"{ld['warm']['samples_per_s']} vs {d['samples_per_s']} samples/s ({d['flops_per_sample'] / 1e12:.0f} TFLOP per sample)",
                     yes(r["loader_over_h200_demand"] >= 1)))
        rows.append(("zstd decode MB/s per thread (real activations compress ~1.26x)", fmt(r["zstd_decode_mb_per_s"]), "", "", ""))
    elif name == "scaling":
        s, lin = r["samples"], r["samples_vs_linear"]
        sizes = " / ".join(f"{p['multiple']}x" for p in s)
        rows.append((f"extraction loop time per token, {sizes} samples (1.0 = linear)", " / ".join(fmt(x) for x in lin["loop_s"]), "~1",
                     f"{' / '.join(fmt(p['tokens']) for p in s)} tokens in {' / '.join(str(p['shards']) for p in s)} shards", ""))
        rows.append((f"extraction whole-command time per token, {sizes}", " / ".join(fmt(x) for x in lin["wall_s"]), "",
                     f"fixed start-up {s[0]['prepare_s']} s (imports, tokenizer) amortised", ""))
        rows.append((f"a later command on the done store (token cache + checks), {sizes}", " / ".join(f"{p['rerun_s']} s" for p in s), "flat",
                     f"first extraction's prepare: {' / '.join(str(p['prepare_s']) for p in s)} s", ""))
        rows.append((f"extraction peak RSS MiB, {sizes}", " / ".join(str(x) for x in r["samples_peak_rss_mib"]["extract"]), "flat", "", ""))
        rows.append((f"training blocks/s, {sizes}", " / ".join(fmt(p["train"]["blocks_per_s"]) for p in s), "flat",
                     f"tokens/s {' / '.join(fmt(p['train']['tok_per_s']) for p in s)}; start-up "
                     f"{' / '.join(str(p['train']['startup_s']) for p in s)} s", ""))
        rows.append((f"training peak RSS MiB, {sizes}", " / ".join(str(x) for x in r["samples_peak_rss_mib"]["train"]), "flat", "", ""))
        lens = r["lengths"]
        lengths = " / ".join(str(p["length"]) for p in lens)
        t = r["length_tok_per_s"]
        rows.append((f"extraction tokens/s at sample length {lengths}", " / ".join(fmt(x) for x in t["extract_loop"]), "", "same total tokens per point", ""))
        rows.append((f"training tokens/s at sample length {lengths} ({lens[0]['train']['blocks_per_token']} -> "
                     f"{lens[-1]['train']['blocks_per_token']} blocks per token)", " / ".join(fmt(x) for x in t["train"]), "",
                     f"blocks/s {' / '.join(fmt(x) for x in t['train_blocks_per_s'])}", ""))
        rows.append(("training peak RSS MiB by length", " / ".join(str(p["train"]["peak_rss_mib"]) for p in lens), "", "", ""))
    return rows


def yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=None, help="comma-separated subset (default: every BENCHES entry, none with --adopt)")
    parser.add_argument("--adopt", action="append", default=[], metavar="NAME=JSON",
                        help="record a result its own command wrote (a long EXTRA bench run by hand, in the background)")
    args = parser.parse_args()
    out_dir = REPO / "bench" / "results"
    out_dir.mkdir(exist_ok=True)
    only = args.only if args.only is not None else ("" if args.adopt else ",".join(BENCHES))
    names = [n for n in only.split(",") if n]
    results_path = REPO / "bench" / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    for spec in args.adopt:
        name, path = spec.split("=", 1)
        result = json.loads(Path(path).read_text())
        results[name] = {"result": result, "seconds": result.get("total_s", 0), "command": ".venv/bin/python " + " ".join({**BENCHES, **EXTRA_BENCHES}[name]),
                         "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(Path(path).stat().st_mtime))}
    for name in names:
        print(f"== {name}", flush=True)
        results[name] = {**run(name, out_dir), "date": time.strftime("%Y-%m-%d %H:%M")}
        print(f"   {results[name]['seconds']} s" + (" FAILED" if "error" in results[name] else ""), flush=True)
    results["_machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M")}
    results_path.write_text(json.dumps(results, indent=1) + "\n")
    write_markdown(results)


def write_markdown(results: dict) -> None:
    lines = [
        "# Benchmarks",
        "",
        f"Written by `make bench` (`bench/run_all.py`) on {results['_machine']['date']}, "
        f"{results['_machine']['cpus']} CPU cores, no GPU. Every figure below comes from a benchmark run, not a test; raw numbers are in "
        "`bench/results.json`. Each figure is taken against a baseline measured in the same run "
        "(`--only NAME` reruns one section and keeps the others).",
        "",
    ]
    for name in [*BENCHES, *EXTRA_BENCHES]:
        if name not in results:
            continue
        entry = results[name]
        when = f", {entry['date']}" if "date" in entry else ""
        lines += [f"## {name}", "", f"Command: `{entry['command']}` ({entry['seconds']} s{when})", ""]
        if "error" in entry:
            lines += ["Failed:", "", "```", entry["error"][-1500:], "```", ""]
            continue
        lines += ["| figure | value | goal | baseline (same run) | met |", "|---|---|---|---|---|"]
        lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows_for(name, entry["result"])]
        lines.append("")
    lines += ["## gpu", ""]
    if GPU_RESULT.exists():
        sys.path.insert(0, str(REPO / "bench"))
        from gpu_check import markdown_rows

        gpu = json.loads(GPU_RESULT.read_text())
        lines += [f"Command: `bash bench/gpu_check.sh` on a device machine ({gpu.get('date', '?')}); not part of `make bench`.", ""]
        lines += ["| figure | value | goal | baseline (same run) | met |", "|---|---|---|---|---|"]
        lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in markdown_rows(gpu)]
    else:
        lines += [
            "`bench/gpu_check.sh` (one H200, < 8 min: flash-attn extraction on SmolLM2 and on a Qwen3-8B-shaped "
            "target, a short bf16 drafter training run with MFU, a vllm generate) **has not run on a GPU yet**: "
            "no GPU was lent to this project's sessions. Its plumbing runs on CPU "
            "(`.venv/bin/python bench/gpu_check.py --cpu-smoke`, a slow test). When it runs, copy its "
            "`gpu_check.json` to `bench/results/` and rerun `make bench`.",
        ]
    lines.append("")
    notes = REPO / "bench" / "NOTES.md"
    if notes.exists():
        lines += [notes.read_text()]
    (REPO / "BENCHMARKS.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
