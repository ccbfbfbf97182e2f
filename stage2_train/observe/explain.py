"""Why an event happened: what the log says happened near it (a checkpoint save, a resume, an eval, an
epoch boundary, a stall, a non-finite loss, an lr or noise schedule change, a starved data loader),
and one line describing each event. Used by the doctor and the report.

    points = context_points(rows, train)        # everything that may explain an event, by step
    cause, near = explain(ev, points, events, info)
    describe(ev)                                # "loss spike at step 2004: 0.78 -> 13 (x17), back in 190 steps"

A generalisation event (held-out quality turning while training improves) gets the advice against
memorising, and the epoch boundaries near the turn. A loss whiplash gets homogeneous batches, with the
logged batch lengths; a run not learning, what keeps weights from learning. A level (a slow loss divergence or accuracy
decline, lr at 0, an input-bound loader) gets what usually causes it and the setting to change, with
what the log says happened between the best level and the rise. A log without event rows has its
stalls taken for probable checkpoint saves.
"""

from __future__ import annotations

from typing import Any

from stage2_train.observe.levels import UNTRAINED_ACCURACY
from stage2_train.observe.records import finite
from stage2_train.observe.schedule_check import describe_off_schedule, schedule_cause

# Strongest explanation first, by kind of event; `stall` covers stall and step_gap found by the detectors.
CAUSES_OF_PAUSE = ("checkpoint", "eval", "resume", "epoch")
CAUSES_OF_CHANGE = ("nan", "checkpoint", "resume", "stall", "epoch", "lr", "noise", "data")
CAUSES_OF_SLOWDOWN = ("data", "checkpoint", "resume", "stall", "epoch", "eval")
LEVELS = ("loss_divergence", "grad_norm_growth", "accuracy_decline", "lr_zero", "input_bound")


# ---- what the log says happened ------------------------------------------------------------------
def context_points(rows: list[dict[str, Any]], train: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Everything that may explain an event, each {"what", "step", "text", ...}, sorted by step."""
    points, saves, epochs = event_points(rows)
    for save in saves.values():
        timing = [f"{k.removesuffix('_s')} {seconds(save[k])} s" for k in ("blocked_s", "write_s") if k in save]
        mode = [save["mode"]] if "mode" in save else []
        extra = f" ({', '.join(timing + mode)})" if timing or mode else ""
        points.append({**save, "text": f"checkpoint save at step {save['step']}{extra}"})
    for prev, cur in zip(train, train[1:]):  # epoch boundaries from the epoch field, when no event said so
        if prev["epoch"] is not None and cur["epoch"] is not None and cur["epoch"] > prev["epoch"]:
            if cur["epoch"] not in epochs:
                epochs.add(cur["epoch"])
                points.append(epoch_point(cur["epoch"], cur["step"]))
    points += schedule_points(train, "lr") + schedule_points(train, "noise_std")
    return sorted(points, key=lambda p: p["step"])


def epoch_point(epoch: int, step: int) -> dict[str, Any]:
    return {"what": "epoch", "step": step, "epoch": epoch, "text": f"epoch {epoch} began at step {step}"}


def event_points(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]], set[int]]:
    """(eval, resume and epoch points, checkpoint saves by step, epochs whose start an event gave)."""
    points: list[dict[str, Any]] = []
    saves: dict[int, dict[str, Any]] = {}
    epochs: set[int] = set()
    seen_start = False
    has_epoch_starts = any(x["event"] == "epoch_start" for x, _ in rows)
    for r, raw in rows:
        step = r["step"]
        if r["kind"] == "eval" and step is not None:
            took = f" ({r['eval_s']:.1f} s)" if finite(r["eval_s"]) else ""
            points.append({"what": "eval", "step": step, "text": f"eval at step {step}{took}"})
        if r["kind"] != "event" or step is None:
            continue
        name = str(r["event"])
        if "checkpoint" in name or "save" in name:
            save = saves.setdefault(step, {"what": "checkpoint", "step": step})
            save.update({k: r[k] for k in ("blocked_s", "write_s") if finite(r[k])})
            if raw.get("mode"):
                save["mode"] = raw["mode"]
        elif name == "resume":
            where = f" from {raw['path']}" if raw.get("path") else ""
            points.append({"what": "resume", "step": step, "text": f"resume at step {step}{where}"})
        elif name == "run_start":
            if seen_start or step > 0:
                points.append({"what": "resume", "step": step, "text": f"restart at step {step}"})
            seen_start = True
        elif name in ("epoch_start", "epoch_end") and r["epoch"] is not None:
            if name == "epoch_end" and has_epoch_starts:
                continue  # the last epoch_end is not followed by an epoch
            epoch = r["epoch"] + (1 if name == "epoch_end" else 0)
            if epoch not in epochs:
                epochs.add(epoch)
                points.append(epoch_point(epoch, step))
    return points, saves, epochs


def seconds(value: float) -> str:
    return f"{value:.1f}" if value >= 1 else f"{value:.2g}"


def schedule_points(train: list[dict[str, Any]], field: str) -> list[dict[str, Any]]:
    """Where a schedule's warmup ended (the value first reached its peak) and where it jumped."""
    series = [(r["step"], r[field]) for r in train if finite(r[field])]
    if len(series) < 2:
        return []
    what = "lr" if field == "lr" else "noise"
    peak = max(v for _, v in series)
    at_peak = next(i for i, (_, v) in enumerate(series) if v >= 0.999 * peak)
    points = []
    if at_peak > 0 and series[0][1] < 0.9 * peak:
        step = series[at_peak][0]
        points.append(
            {"what": what, "step": step, "text": f"{field} warmup ended at step {step} ({field} {peak:.3g})"}
        )
    for (_, a), (step, b) in zip(series[at_peak:], series[at_peak + 1 :]):
        if max(a, b) > 0 and abs(a - b) / max(a, b) > 0.2:
            points.append(
                {"what": what, "step": step, "text": f"{field} jumped {a:.3g} -> {b:.3g} at step {step}"}
            )
    return points


def round_step_note(step: int, interval: int) -> str:
    for every in (10000, 5000, 2000, 1000, 500, 250, 100):
        nearest = round(step / every) * every
        if nearest > 0 and abs(step - nearest) <= max(interval, 1):
            return f", near step {nearest} (a multiple of {every})"
    return ""


# ---- explaining one event ------------------------------------------------------------------------
def explain(
    ev: dict[str, Any], points: list[dict[str, Any]], events: list[dict[str, Any]], info: dict[str, Any]
) -> tuple[str, list[dict[str, Any]]]:
    """(likely cause, everything found near the event): the strongest explanation by the event's
    kind (a pause, a change of the loss or accuracy, a slowdown), else what the log cannot tell."""
    interval = info["interval"]
    if ev["kind"].endswith("_off_schedule"):
        near = nearby(ev, points, events, info, ev["step"] - interval, ev["details"]["to_step"], pause=False)
        return schedule_cause(ev), near
    if ev["kind"] == "generalisation":
        lo, hi = ev["step"] - (ev["details"]["confirmed_step"] - ev["step"]), ev["details"]["confirmed_step"]
        near = nearby(ev, points, events, info, lo, hi, pause=False)
        return memorising_cause(ev, near, points), near
    if ev["kind"] == "resume_jump":
        d = ev["details"]
        near = nearby(ev, points, events, info, d["resumed_at"] or ev["step"], d["confirmed_step"], pause=False)
        return resume_cause(ev, near), near
    if ev["kind"] in ("loss_whiplash", "not_learning"):
        d = ev["details"]
        near = nearby(ev, points, events, info, ev["step"], d["confirmed_step"], pause=False)
        cause = whiplash_cause(ev) if ev["kind"] == "loss_whiplash" else not_learning_cause(ev, info)
        return cause, near
    if ev["kind"] in LEVELS:
        d = ev["details"]
        lo = d.get("best_step", ev["step"] - max(10 * interval, 10))
        near = nearby(ev, points, events, info, lo, d["confirmed_step"], pause=False)
        return level_cause(ev, near, info), near
    pause = ev["kind"] in ("stall", "step_gap")
    start = ev["details"].get("from_step", ev["step"])
    if pause:
        lo, hi = start - interval, ev["step"]
        order = CAUSES_OF_PAUSE
    else:
        lo, hi = ev["step"] - max(10 * interval, 10), ev["step"] + interval
        order = CAUSES_OF_SLOWDOWN if ev["kind"] == "throughput_drop" else CAUSES_OF_CHANGE
    near = nearby(ev, points, events, info, lo, hi, pause)
    found = [p for what in order for p in near if p["what"] == what]
    if found:
        return cause_from(found, pause, info), near
    return no_logged_cause(ev, info, lo, hi, start, pause), near


def nearby(ev, points, events, info, lo: int, hi: int, pause: bool) -> list[dict[str, Any]]:
    """Points and other events in [lo, hi] (a pause is not explained by another pause)."""
    near = [p for p in points if lo <= p["step"] <= hi]
    for other in events:
        if other is not ev and lo <= other["step"] <= hi and not (pause and other["kind"] in ("stall", "step_gap")):
            what = "stall" if other["kind"] in ("stall", "step_gap") else other["kind"]
            near.append({"what": what, "step": other["step"], "text": describe(other, info)})
    if ev["kind"] == "throughput_drop" and info["data_wait"].get(ev["step"]):
        near.append({"what": "data", "step": ev["step"], "text": info["data_wait"][ev["step"]]})
    return sorted(near, key=lambda p: p["step"])


def cause_from(found: list[dict[str, Any]], pause: bool, info: dict[str, Any]) -> str:
    primary = found[0]
    cause = primary["text"]
    if primary["what"] == "stall" and not pause:
        cause = "follows the " + cause
        if not info["has_events"]:
            cause += " (likely a checkpoint save: no event rows in this log)"
    elif primary["what"] == "checkpoint" and not pause:
        cause = "follows the " + cause + ": a save must leave training state unchanged"
    elif primary["what"] == "resume" and not pause:
        cause = "follows the " + cause + ": check that the resume is exact"
    others = sorted({p["what"] for p in found} - {primary["what"]})
    if others:
        cause += f" (also near: {', '.join(others)})"
    return cause


def memorising_cause(ev: dict[str, Any], near: list[dict[str, Any]], points: list[dict[str, Any]]) -> str:
    """The advice for a held-out turn, with the checkpoint to keep and the epochs near the turn."""
    d = ev["details"]
    tau = d.get("best_tau")
    keep = f"best held-out {tau['metric']} (step {tau['step']}" if tau else f"best evaluation (step {ev['step']}"
    best_step = tau["step"] if tau else ev["step"]
    saves = [p["step"] for p in points if p["what"] == "checkpoint"]
    if saves and best_step not in saves:
        keep += f"; nearest checkpoint save: step {min(saves, key=lambda s: (abs(s - best_step), -s))}"
    cause = (
        "the drafter is memorising its training samples: more data, fewer epochs (train.epochs), "
        f"the checkpoint with the {keep}; checkpoint.keep_best=true keeps it), distilling on more positions "
        "(loss.distill_positions=all)"
    )
    if (d.get("train_now") or {}).get("comparable") is False:
        cause += (
            "; or, as the train rows score drafts past loss.full_vocab_slots among the target's top-k only, the "
            "full-vocabulary quality of those slots falling while the candidate objective improves "
            "(loss.full_vocab_slots=null tells the two apart)"
        )
    epochs = [p for p in near if p["what"] == "epoch"]
    current = [p["epoch"] for p in points if p["what"] == "epoch" and p["step"] <= d["confirmed_step"]]
    if epochs:
        first, last = epochs[0], epochs[-1]
        began = (
            first["text"]
            if len(epochs) == 1
            else f"epochs {first['epoch']}-{last['epoch']} began in steps {first['step']}-{last['step']}"
        )
        cause += (
            f" ({began}, near the turn; training was in epoch {max(current)}: "
            "many epochs over little data is the usual cause)"
        )
    return cause


def resume_cause(ev: dict[str, Any], near: list[dict[str, Any]]) -> str:
    """A resume must continue the run where it stopped: what usually is not restored."""
    seen = [p["text"] for p in near if p["what"] in ("lr", "noise", "epoch")]
    return (
        f"the run does not continue where it stopped at step {ev['details']['resumed_at']}: a resume must restore "
        "the optimizer's moments, the lr and noise schedules' positions and the sampler's position exactly; compare "
        "the resumed state with the saved one"
        + (f"; near the resume: {'; '.join(seen[:3])}" if seen else "")
    )


def level_cause(ev: dict[str, Any], near: list[dict[str, Any]], info: dict[str, Any]) -> str:
    """What usually puts a run at such a level and what to change; for a divergence or decline, what the
    log says happened between the best level and the rise."""
    kind, d = ev["kind"], ev["details"]
    if kind == "input_bound":
        return (
            f"the loader cannot keep up: the steps wait for data {100 * d['mean']:.0f}% of their time; more loader "
            "threads (train.num_data_threads), a deeper prefetch (train.prefetch_micro_batches), a local copy "
            "of a remote store (store.local_cache_dir); another trainer: its DataLoader's num_workers, prefetch_factor"
        )
    if kind == "lr_zero":
        schedule = info.get("schedule") or {}
        lr, warmup, total = (schedule.get(k) for k in ("optim.lr", "warmup_steps", "total_steps"))
        if d.get("decay_rows") is not None:
            why = (
                f"the lr decayed from {d['peak_before']:.3g} to 0 over {d['decay_rows']} rows and stayed there for longer "
                "than its decay took: the schedule ended long before the run (its total steps fewer than the run's: "
                "train.max_steps or train.epochs against the schedule's total_steps, or a resume that kept a finished schedule)"
            )
        elif d.get("peak_before"):
            why = f"the lr fell from {d['peak_before']:.3g} to 0 in one row, not by a decay: a scheduler or optimizer reset"
        elif lr == 0:
            why = "optim.lr is 0 in the run's config (run_start)"
        elif lr is not None:
            why = (
                f"run_start records optim.lr {lr:.3g}, warmup {warmup} of {total} steps, so the logged lr is not "
                "the schedule's: a scheduler never stepped, or a param group with lr 0"
            )
        else:
            why = "an lr of 0 in the config, a warmup longer than the run, or a scheduler never stepped"
        return f"the optimizer applies no update at lr 0, the weights do not change: {why}"
    if kind == "grad_norm_growth":
        cause = (
            f"the gradient norm left its lowest level (steps up to {d['best_step']}) x{ev['size']:.0f} and stayed there: "
            "exploding gradients, which end in a NaN or a diverging loss; lower optim.lr, a longer optim.warmup_ratio, "
            "optim.grad_clip on, AdamW betas (0.9, 0.999) (0.98 has been reported to NaN)"
        )
        seen = [p["text"] for p in near if p["what"] in ("lr", "noise", "epoch", "resume", "nan", "loss_spike")]
        return cause + (f"; between the lowest level and the rise: {'; '.join(seen[:4])}" if seen else "")
    what = "loss" if kind == "loss_divergence" else "accuracy"
    cause = (
        f"the training {what} left its best level (steps up to {d['best_step']}) and stayed there: usually an lr "
        "too high once warmup ends (lower optim.lr, a longer optim.warmup_ratio, optim.grad_clip on) or training "
        "data that changed"
    )
    seen = [p["text"] for p in near if p["what"] in ("lr", "noise", "epoch", "resume", "nan", "loss_spike")]
    if seen:
        cause += f"; between the best level and the rise: {'; '.join(seen[:4])}" + (" ..." if len(seen) > 4 else "")
    return cause


def whiplash_cause(ev: dict[str, Any]) -> str:
    """Homogeneous batches, with what the logged batch lengths say about them."""
    d = ev["details"]
    cause = (
        f"the loss jumps between levels from one row to the next (a quarter of the swings x{ev['size']:.2f} or more; "
        f"10th-90th percentile {d['loss_p10']:.3g}-{d['loss_p90']:.3g} around {d['loss_median']:.3g}): the mark of "
        "homogeneous batches, each step drawn from one length range (length-bucketed or length-grouped sampling), "
        "so every step's gradient pulls another way"
    )
    rho, lo, hi = d.get("len_loss_rho"), d.get("mean_len_p10"), d.get("mean_len_p90")
    if lo is not None and hi is not None:
        cause += f"; the steps' mean sample length (tokens / samples) spans {lo:.0f}-{hi:.0f}"
        if rho is not None and abs(rho) < 0.3:  # swings the lengths do not explain: noise of small steps
            cause += (f" but the loss does not follow it (rank correlation {rho:+.2f}): more likely steps so small that "
                      "each one's loss is mostly noise (raise sampler.micro_batch_tokens or train.grad_accum)")
        elif rho is not None:
            cause += f" and the loss follows it (rank correlation {rho:+.2f})"
    return cause + (
        ": every optimizer step must mix lengths as the data set does (this trainer's sampler does: check "
        "sampler.max_samples_per_batch and sampler.window_slack; another trainer: turn off group_by_length or "
        "length bucketing, or draw each step across buckets); else too few samples per step, or an lr so high "
        "the loss bounces (optim.lr)"
    )


def not_learning_cause(ev: dict[str, Any], info: dict[str, Any]) -> str:
    """A loss that never fell: what keeps the weights from learning."""
    d = ev["details"]
    lr = (info.get("schedule") or {}).get("optim.lr")
    acc = (
        f", accuracy {d['first_accuracy']:.3g} at best {d['best_accuracy']:.3g}"
        if d.get("first_accuracy") is not None and d.get("best_accuracy") is not None else ""
    )
    at_lr = f" at lr up to {d['peak_lr']:.3g}" if d.get("peak_lr") else ""
    return (
        f"in {d['rows']} rows{at_lr} the loss never fell {100 * d['min_drop']:.0f}% below its first level "
        f"({d['first_loss']:.3g}, lowest {d['best_loss']:.3g}{acc}): the weights are not learning. An lr far too low "
        f"(optim.lr{f' {lr:.3g} in run_start' if lr is not None else ''}; a warmup longer than the run), parameters "
        "frozen or left out of the optimizer (requires_grad, param groups; a grad_norm near 0 says so), or targets "
        "that cannot be learned (labels shifted by a position, a wrong loss mask, another target's features)"
        + (f". This run starts from model.init_from {start}, yet its accuracy began untrained (under "
           f"{UNTRAINED_ACCURACY:.0%}): those weights are no trained drafter for this data (another target's or "
           "data's), so it had to learn as from scratch"
           if (start := d["init_from"] if "init_from" in d else (info.get("schedule") or {}).get("init_from")) else "")
    )


def no_logged_cause(ev: dict[str, Any], info: dict[str, Any], lo: int, hi: int, start: int, pause: bool) -> str:
    if pause and not info["has_events"]:
        gap_s = ev["size"] if ev["kind"] == "stall" else ev["details"].get("gap_s")
        if gap_s is not None and gap_s >= 600:
            return f"likely a restart or preemption ({gap_s / 60:.0f} min away; no event rows in this log)"
        return "likely checkpoint save (no event rows in this log)" + round_step_note(start, info["interval"])
    relevant = ("epoch boundaries", "checkpoint saves and resumes", "lr schedule changes", "noise schedule changes")
    if ev["kind"] == "throughput_drop":
        relevant += ("data-loader starvation",)
    blind = [c.split(":")[0] for c in info["cannot_tell"] if c.split(":")[0] in relevant]
    unseen = f"; this log cannot tell {', '.join(blind)}" if blind else ""
    if pause:
        return f"no logged cause in steps {lo}-{hi} (no checkpoint, eval, resume or epoch boundary): look at the host{unseen}"
    return f"no logged cause in steps {lo}-{hi} (no save, resume, stall, epoch boundary or schedule change){unseen}"


def describe(ev: dict[str, Any], info: dict[str, Any] | None = None) -> str:
    d, kind, size = ev["details"], ev["kind"], ev["size"]
    if kind == "stall":
        return f"stall at step {ev['step']}: {size:.1f} s since step {d['from_step']} (expected {d['expected_s']:.1f} s)"
    if kind == "step_gap":
        took = f" in {d['gap_s']:.1f} s" if d.get("gap_s") is not None else ""
        return f"step gap at step {ev['step']}: {d['from_step']} -> {ev['step']}{took} (usually {d['usual_delta']} steps)"
    if kind == "loss_spike":
        back = d["recovery_steps"]
        rec = f"back in {back} steps" if back is not None else "never back"
        return f"loss spike at step {ev['step']}: {d['before']:.3g} -> {d['loss']:.3g} (x{size:.1f}), {rec}"
    if kind == "accuracy_cliff":
        back = d["recovery_steps"]
        rec = f"back in {back} steps" if back is not None else "never back"
        return f"accuracy cliff at step {ev['step']}: {d['before']:.3g} -> {d['after']:.3g}, {rec}"
    if kind == "throughput_drop":
        unit = d.get("unit", "tok/s")
        return f"throughput drop at step {ev['step']}: {d['before']:.0f} -> {d['after']:.0f} {unit} (-{100 * size:.0f}%)"
    if kind == "nan":
        return f"non-finite {', '.join(f'{k}={v}' for k, v in d['fields'].items())} at step {ev['step']}"
    if kind == "generalisation":
        turned = ", ".join(f"{name} {m['best']:.3g} -> {m['now']:.3g}" for name, m in d["metrics"].items())
        gaps = [
            f"{what} gap {d['gap_then'][key]:.3g} -> {d['gap_now'][key]:.3g}"
            for key, what in (("accuracy", "train - held-out accuracy"), ("loss", "held-out ce - train loss"))
            if key in d["gap_then"] and key in d["gap_now"]
        ]
        return (
            f"held-out quality turned at step {ev['step']} (confirmed at step {d['confirmed_step']}): {turned}, "
            f"while training improved" + (f"; {', '.join(gaps)}" if gaps else "")
        )
    if kind in ("loss_divergence", "grad_norm_growth", "accuracy_decline"):
        what = {"loss_divergence": "loss diverging", "grad_norm_growth": "grad_norm growing"}.get(kind, "accuracy declining")
        rec = f"back in {d['recovery_steps']} steps" if d["recovery_steps"] is not None else "never back"
        ratio = f" (x{size:.2f})" if kind != "accuracy_decline" else ""
        last = f", {d['last']:.3g} at step {d['last_step']}" if d["last_step"] != d["confirmed_step"] else ""
        return (
            f"{what} from step {ev['step']}: median of {d['window_rows']} rows {d['best']:.3g} at best (step "
            f"{d['best_step']}) -> {d['now']:.3g}{ratio} at step {d['confirmed_step']}{last}, {rec}"
        )
    if kind.endswith("_off_schedule"):
        return describe_off_schedule(ev)
    if kind == "loss_whiplash":
        rec = f"back in {d['recovery_steps']} steps" if d["recovery_steps"] is not None else "never back"
        last = f", {d['last']:.2f} at step {d['last_step']}" if d["last_step"] != d["confirmed_step"] else ""
        return (
            f"loss whiplash from step {ev['step']}: the loss swings x{size:.2f} row to row (upper quartile of |log-ratio - "
            f"its median| {d['swing']:.2f} over {d['window_rows']} rows, bound {d['bound']:.2g}) at step {d['confirmed_step']}{last}, {rec}"
        )
    if kind == "not_learning":
        rec = f", learning from {d['recovery_steps']} steps on" if d["recovery_steps"] is not None else ""
        return (
            f"not learning from step {ev['step']}: the loss's median of {d['window_rows']} rows {d['first_loss']:.3g} at first, "
            f"{d['best_loss']:.3g} at its lowest, after {d['rows']} rows (to step {d['confirmed_step']}){rec}"
        )
    if kind == "resume_jump":
        return (
            f"loss jump after the resume at step {d['resumed_at']}: {d['before']:.3g} before -> {d['after']:.3g} "
            f"(x{size:.2f}) over its first {d['rows']} rows (steps {ev['step']}-{d['confirmed_step']})"
        )
    if kind == "lr_zero":
        return f"lr 0 at steps {ev['step']}-{d['to_step']}: no update applied"
    if kind == "input_bound":
        rec = f"back in {d['recovery_steps']} steps" if d["recovery_steps"] is not None else "never back"
        return (
            f"input-bound from step {ev['step']}: mean data_wait_frac {d['mean']:.2f} over {d['rows']} rows to step "
            f"{d['confirmed_step']} (at least {d['threshold']:.2g}), {d['last_mean']:.2f} at step {d['to_step']}, {rec}"
        )
    return f"{kind} at step {ev['step']}"
