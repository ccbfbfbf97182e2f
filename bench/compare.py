"""Settings compared at equal steps and seed, on one set of prompts, with intervals.

    .venv/bin/python bench/compare.py --name levers --steps 400 \\
        --variant base: --variant dpace:loss.weighting=dpace --variant muon:optim.name=muon,optim.lr=2e-3

How each variant is trained and every drafter evaluated on the same prompts: docs/benchmarks.md, `compare`.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, Row, arguments, emit, existing_store, figure, run_training, yes  # noqa: E402


def unseen_prompts(tokenizer, first: int, count: int) -> list[tuple[str, list[int]]]:
    """(kind, prompt ids) of default prompts `first`..`first + count`: built like the training ones
    from other documentation paragraphs, never answered in any store."""
    from stage1_extract.corpus import default_conversations
    from stage1_extract.template import prompt_ids

    conversations = default_conversations(first + count)[first:]
    return [("question" if c.row % 4 == 3 else "excerpt", prompt_ids(tokenizer, c.messages)) for c in conversations]


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--name", default="compare")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--variant", action="append", default=[], help="NAME:key=value,key=value (first = baseline)")
    parser.add_argument("--heldout", type=int, default=12, help="held-out store conversations to decode")
    parser.add_argument("--unseen", type=int, default=32, help="unseen default prompts to decode")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--skip-train", action="store_true", help="evaluate the runs already there")
    parser.add_argument("--confidence-stop", action="append", default=[], metavar="NAME=VALUE",
                        help="also decode variant NAME (a DSpark drafter) with eval.confidence_stop=VALUE, as NAME@stopVALUE")
    parser.add_argument("--png", default=None, help="default: bench/results/<name>.png")
    parser.add_argument("overrides", nargs="*", help="for every variant")
    args = parser.parse_args()
    png = Path(args.png or REPO / "bench" / "results" / f"{args.name}.png")
    t0 = time.perf_counter()
    import torch

    from shared.config import load_run_config
    from shared.paths import RunPaths
    from shared.target import cached_tokenizer
    from stage2_train.observe.metrics import read_log
    from stage2_train.serve.evaluation import HeldoutSet, evaluate_drafters, one_line

    torch.set_num_threads(1)
    variants = [(v.split(":", 1)[0], [o for o in v.split(":", 1)[1].split(",") if o]) for v in args.variant] or [("base", [])]
    store = existing_store(args.config, args.overrides)
    root = REPO / "runs" / args.name
    runs = {name: RunPaths(root / name) for name, _ in variants}
    train_s = {}
    for name, extra in variants:
        if not args.skip_train:
            shutil.rmtree(runs[name].run_dir, ignore_errors=True)
            runs[name].run_dir.mkdir(parents=True)
            # The data as the config's own run made it: training checks the store against the data it names.
            runs[name].data_dir.symlink_to(RunPaths.of(load_run_config(args.config, args.overrides)).data_dir.resolve(),
                                           target_is_directory=True)
            print(f"== train {name}: {' '.join(extra) or '(the config)'}", flush=True)
            train_s[name] = round(run_training(runs[name].run_dir, [
                f"store.path={store}", f"train.max_steps={args.steps}", "train.epochs=1000", f"checkpoint.every_steps={args.steps}",
                "eval.every_steps=0", *args.overrides, *extra], args.config).seconds, 1)

    # Every drafter as its checkpoint describes it, the target's parts read once; one evaluation.
    cfg0 = load_run_config(args.config, [*args.overrides, f"store.path={store}"])
    heldout = HeldoutSet.open(cfg0)
    loaded = {name: heldout.load(runs[name].checkpoints, cfg0.model) for name, _ in variants}
    drafters = {name: entry.drafter for name, entry in loaded.items()}
    baseline = variants[0][0]
    drafters["untrained"] = heldout.untrained(cfg0, loaded[baseline].description, trained=drafters[baseline])
    stops = dict(s.split("=", 1) for s in args.confidence_stop)  # NAME=VALUE: a second proposer that may stop early
    for name, value in stops.items():
        drafters[f"{name}@stop{value}"] = drafters[name]
    tokenizer, _ = cached_tokenizer(str(heldout.target.target_dir))
    prompts = [("heldout", p) for _, p in heldout.prompts(args.heldout)]
    prompts += unseen_prompts(tokenizer, cfg0.data.num_default_prompts, args.unseen)
    kinds = {kind: [i for i, (k, _) in enumerate(prompts) if k == kind] for kind in ("heldout", "excerpt", "question")}
    started = time.perf_counter()
    report = evaluate_drafters(drafters, heldout, prompts=[p for _, p in prompts], cfg=cfg0, baseline=baseline,
                               offline=[n for n, _ in variants], groups=kinds, max_new_tokens=args.max_new_tokens,
                               confidence_stops={f"{n}@stop{v}": float(v) for n, v in stops.items()})
    eval_s = round(time.perf_counter() - started, 1)
    table = {}
    for name, online in report["online"]["proposers"].items():
        entry = {"exact": online["exact"], **online["groups"], "drafted_per_step": online["drafted_interval"]}
        if name in report["offline"]:
            log = read_log(runs[name].log, "train")
            o, last = report["offline"][name], log[-1]
            entry.update({
                "walk_tau": round(o["walk_tau"], 4), "walk_tau_se": round(o["walk_tau_se"], 4) if o["walk_tau_se"] is not None else None,
                "heldout_accuracy": round(o["accuracy"], 4), "train_loss_last": round(last["loss"], 4),
                "cpu_min": round(last["cpu_s"] / 60, 2), "train_wall_s": train_s.get(name),
                "median_step_s": round(statistics.median(r["step_s"] for r in log), 4), "variant": loaded[name].description.variant,
                "params": sum(p.numel() for p in drafters[name].parameters()),
            })
        table[name] = entry
    result = {
        "config": args.config, "overrides": args.overrides, "steps": args.steps,
        "variants": {n: e for n, e in variants}, "baseline": baseline, "confidence_stop": stops,
        "prompts": {"all": len(prompts), **{k: len(v) for k, v in kinds.items()}}, "max_new_tokens": args.max_new_tokens,
        "online_eval_s": eval_s, "results": table,
    }
    plot(result, png)
    result["png"] = str(png.relative_to(REPO)) if png.is_relative_to(REPO) else str(png)
    (root / "compare.json").write_text(json.dumps(result, indent=1))
    print(one_line(report, trained=baseline).replace(" | ", "\n"), flush=True)  # `make eval`'s summary, a proposer a line
    for note in report["online"]["notes"]:
        print(f"note: {note}", flush=True)
    return emit(result, args.json, t0)


def plot(result: dict, path: Path) -> None:
    """Each drafter's online tau with its 95% interval over prompts, on all prompts and per kind; the
    n-gram drafter's interval as a band. A group of too few prompts for an interval is a bare point."""
    names = list(result["results"])
    with figure(path, (7, 0.45 * len(names) + 1.2)) as ax:
        ngram = result["results"].get("ngram", {}).get("all")
        if ngram and ngram.get("lo") is not None:
            ax.axvspan(ngram["lo"], ngram["hi"], color="0.9", label="n-gram interval")
        for offset, kind, colour in ((-0.2, "all", "k"), (0.0, "excerpt", "tab:orange"), (0.2, "question", "tab:blue")):
            ys, xs, lo, hi = [], [], [], []
            for y, name in enumerate(names):
                entry = result["results"][name].get(kind)
                if entry and entry["tau"] is not None:
                    ys.append(y + offset)
                    xs.append(entry["tau"])
                    lo.append(entry["tau"] - entry["lo"] if entry.get("lo") is not None else 0.0)
                    hi.append(entry["hi"] - entry["tau"] if entry.get("hi") is not None else 0.0)
            ax.errorbar(xs, ys, xerr=[lo, hi], fmt="o", color=colour, ms=4, capsize=2,
                        label=f"{kind} ({result['prompts'].get(kind, 0)} prompts)")
        ax.set_yticks(range(len(names)), names)
        ax.invert_yaxis()
        ax.set_xlabel(f"online tau, {result['max_new_tokens']} new tokens per prompt (95% bootstrap interval over prompts)")
        ax.set_title(f"{Path(result['config']).stem}, {result['steps']} steps, same seed", fontsize=10)
        ax.legend(fontsize=7, loc="lower right")


def rows(r: dict) -> list[Row]:
    """The benchmark table's rows. Intervals missing (too few prompts, `serve/online_eval.py`) print
    as such, and a rule that needs one is not met."""
    from stage2_train.serve.online_eval import interval_text

    out: list[Row] = []
    if "fp4" in r["results"]:  # the fp4 store's decision rule (fp4_compare)
        a = r["results"]["fp4"]["all"]
        holds = a.get("diff_lo") is not None and a["diff_lo"] <= 0 <= a["diff_hi"]
        out.append(("decision rule: fp4 - fp8 paired online tau interval contains 0", interval_text(a, "diff", "+.3f"),
                    "contains 0", "", yes(holds)))
    base = r["baseline"]
    p = r["prompts"]
    out.append((f"prompts decoded ({r['max_new_tokens']} new tokens each, every output equal to the target's greedy one)",
                f"{p['all']}: {p['heldout']} held-out, {p['excerpt']} excerpt, {p['question']} question", "", "", ""))
    for variant, v in r["results"].items():
        a = v["all"]
        paired = "" if variant == base or "diff" not in a else interval_text(a, "diff", "+.3f")
        if paired and a.get("diff_texts_differ"):
            paired += f" (different texts on {a['diff_texts_differ']} prompts)"
        extra = f"; walk_tau {v['walk_tau']} +- {v['walk_tau_se']}" if "walk_tau" in v else ""
        extra += f"; {v['cpu_min']} CPU min of training" if "cpu_min" in v else ""
        if "params" in v:  # results since the drafter variants: the run's size and step time
            extra += f"; `{v['variant']}`, {v['params'] / 1e6:.2f} M trained parameters, {v['median_step_s']} s/step (median)"
        kinds = [k for k in ("heldout", "excerpt", "question") if k in v]
        drafted, d = ("drafted tokens per step [interval] / ", v["drafted_per_step"]) if "drafted_per_step" in v else ("", None)
        out.append((f"online tau `{variant}` (95% interval over prompts) / {drafted}" + " / ".join(kinds),
                    f"{interval_text(a)} / "
                    + (f"{interval_text(d, 'drafted_per_step', '.2f')} / " if d else "")
                    + " / ".join(interval_text({"tau": v[k]["tau"]}) for k in kinds),
                    "", (f"paired vs `{base}`: {paired}" if paired else f"the baseline `{base}`") + extra,
                    "" if v.get("exact", True) else "**outputs differ**"))
    if "ngram" in r["results"] and r["results"].get(base):
        best = max((k for k in r["results"] if k not in ("ngram", "untrained")), key=lambda k: r["results"][k]["all"]["tau"] or 0.0)
        b, g = r["results"][best]["all"], r["results"]["ngram"]["all"]
        out.append((f"best drafter `{best}` against the n-gram drafter (same prompts)",
                    f"{interval_text({'tau': b['tau']})} vs {interval_text({'tau': g['tau']})}",
                    "above, interval clear", f"n-gram {interval_text(g)}", yes(b.get("lo") is not None and b["lo"] > g["tau"])))
    if r.get("png"):
        out.append(("plot", f"![{Path(r['png']).stem}]({r['png']})", "", "", ""))
    return out


if __name__ == "__main__":
    sys.exit(main())
