"""The training report: plots of a run with the doctor's events marked, and a Markdown summary.

    python -m stage2_train report runs/default/train_log.jsonl [--out DIR]   # default DIR: <log dir>/doctor

Writes overview.png (every metric stacked) and one PNG per metric the log has (loss, accuracy, accept_len,
lr, noise_std, throughput) against step: events are red/orange/... vertical lines labelled by kind,
with a marker on the curve they concern; checkpoint saves, resumes and epoch boundaries are thin
grey lines. Held-out eval rows are lines with markers beside the training curves, on the panel
whose units they share (held-out ce on the loss panel, accuracy on accuracy, accept_len and walk_tau
on accept_len: tokens per block), with error bars from their `*_se` fields when present; a
generalisation event (held-out turning while training improves) is marked on the held-out accuracy,
its span from the best eval to the confirming one shaded. report.md lists the events with their
likely causes and embeds the PNGs. matplotlib comes with the `report` extra (`pip install -e '.[report]'`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared.errors import ConfigError
from stage2_train.observe.doctor import diagnose, one_rank
from stage2_train.observe.explain import context_points, describe
from stage2_train.observe.records import finite, normalize
from stage2_train.observe.sources import load_log

PANELS = (  # (field, file stem, axis label)
    ("loss", "loss", "loss"),
    ("accuracy", "accuracy", "accuracy"),
    ("accept_len", "accept_len", "accept_len (tokens)"),
    ("lr", "lr", "lr"),
    ("noise_std", "noise_std", "noise_std"),
    ("tok_per_s", "throughput", "tokens / s"),
)
COLORS = {
    "stall": "tab:red",
    "step_gap": "tab:brown",
    "loss_spike": "tab:orange",
    "accuracy_cliff": "tab:purple",
    "nan": "black",
    "throughput_drop": "tab:blue",
    "generalisation": "tab:pink",
    "loss_divergence": "tab:red",
    "grad_norm_growth": "tab:olive",
    "resume_jump": "tab:orange",
    "accuracy_decline": "tab:purple",
    "lr_zero": "tab:gray",
    "input_bound": "tab:cyan",
    "lr_off_schedule": "tab:gray",
    "noise_off_schedule": "tab:green",
    "loss_whiplash": "tab:brown",
    "not_learning": "black",
}
MARKED_ON = {
    "loss_spike": "loss",
    "accuracy_cliff": "accuracy",
    "throughput_drop": "tok_per_s",
    "nan": "loss",
    "stall": "pace",  # seconds per step, in the event zooms only
    "step_gap": "pace",
    "generalisation": "accuracy",  # the held-out accuracy
    "loss_divergence": "loss",
    "grad_norm_growth": "grad_norm",  # in the event zooms only
    "resume_jump": "loss",
    "accuracy_decline": "accuracy",
    "lr_zero": "lr",
    "input_bound": "data_wait_frac",  # in the event zooms only
    "lr_off_schedule": "lr",
    "noise_off_schedule": "noise_std",
    "loss_whiplash": "loss",
    "not_learning": "loss",
}
# Panel field -> the held-out eval fields drawn on it (same units), with their labels and colours.
HELDOUT_ON = {
    "loss": (("ce", "held-out ce", "black"),),
    "accuracy": (("accuracy", "held-out accuracy", "black"),),
    "accept_len": (("accept_len", "held-out accept_len", "black"), ("walk_tau", "held-out walk_tau", "tab:olive")),
}
CONTEXT_STYLE = {"checkpoint": ":", "resume": "-.", "epoch": "--"}


def report(log_path: Path, out_dir: Path | None, schedule: Any = None) -> dict[str, Any]:
    """Write the PNGs and report.md; returns where they are and what the doctor found (`schedule`:
    the doctor's, see `doctor.diagnose`)."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("`python -m stage2_train report` draws with matplotlib, which is not installed: pip install -e '.[report]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = load_log(log_path)
    path, records, unreadable = log.path, log.records, log.unreadable
    out_dir = Path(out_dir) if out_dir is not None else log.home / "doctor"
    out_dir.mkdir(parents=True, exist_ok=True)
    diagnosis = diagnose(records, source=path, schedule=schedule)
    rows = [(normalize(r), r) for r in one_rank(records)[0]]
    train = [r for r, _ in rows if r["kind"] == "train" and r["step"] is not None]
    evals = [r for r, _ in rows if r["kind"] == "eval" and r["step"] is not None]
    context = [p for p in context_points(rows, train) if p["what"] in CONTEXT_STYLE and p["step"] > 0]
    panels = [
        p
        for p in PANELS
        if any(finite(r[p[0]]) for r in train)
        or any(finite(r[f]) for r in evals for f, _, _ in HELDOUT_ON.get(p[0], ()))
    ]
    missing = [p[1] for p in PANELS if p not in panels]

    plots: dict[str, Path] = {}
    fig, axes = plt.subplots(
        len(panels), 1, sharex=True, figsize=(11, 2.1 * len(panels) + 0.8), squeeze=False
    )
    for ax, panel in zip(axes[:, 0], panels):
        draw_panel(ax, panel, train, evals, diagnosis["events"], context)
    axes[-1, 0].set_xlabel("step")
    add_legend(fig, diagnosis["events"], context)
    fig.suptitle(f"{path.parent.name}/{path.name}: {verdict(diagnosis)}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.55 / fig.get_figheight()))
    plots["overview"] = save(fig, out_dir / "overview.png", plt)
    if diagnosis["events"]:
        plots["events"] = draw_zooms(plt, diagnosis["events"], train, evals, context, out_dir / "events.png")
    for panel in panels:
        fig, ax = plt.subplots(figsize=(11, 3.6))
        draw_panel(ax, panel, train, evals, diagnosis["events"], context, labels=True)
        ax.set_xlabel("step")
        add_legend(fig, diagnosis["events"], context)
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
        plots[panel[1]] = save(fig, out_dir / f"{panel[1]}.png", plt)

    summary = out_dir / "report.md"
    summary.write_text(markdown(diagnosis, path, plots, missing, unreadable))
    return {
        "out_dir": str(out_dir),
        "report": str(summary),
        "plots": [str(p) for p in plots.values()],
        "not_in_log": missing,
        "num_events": diagnosis["summary"]["num_events"],
        "healthy": diagnosis["summary"]["healthy"],
    }


def draw_panel(ax, panel, train, evals, events, context, labels: bool = False) -> None:
    field, stem, label = panel
    points = [(r["step"], r[field]) for r in train if r[field] is not None]
    steps = [s for s, _ in points]
    values = [v if finite(v) else float("nan") for _, v in points]
    heldout = [(f, name, color) for f, name, color in HELDOUT_ON.get(field, ()) if any(finite(r[f]) for r in evals)]
    ax.plot(
        steps,
        values,
        lw=0.8,
        color="tab:gray" if field in ("lr", "noise_std") else "tab:green",
        label=f"train {stem}" if heldout else stem,
    )
    span = (max(steps) - min(steps)) if len(steps) > 1 else 1
    for k, (f, name, color) in enumerate(heldout):
        # Two held-out series on one panel (accept_len, walk_tau) sit side by side, not on each other.
        dodge = (k - (len(heldout) - 1) / 2) * 0.006 * span
        draw_heldout(ax, evals, f, name, color, dodge=dodge, marker="os^"[k % 3])
    if heldout:
        ax.legend(fontsize=7, loc="best", frameon=False)
    good = [v for v in values if finite(v)]
    if field == "loss" and good and min(good) > 0:
        ax.set_yscale("log")  # step 1's loss (~80 at a 50K vocab) would flatten the rest of the curve
    ax.set_ylabel(label)
    ax.grid(alpha=0.25)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for p in thinned(context):
        ax.axvline(p["step"], color="0.55", lw=0.6, ls=CONTEXT_STYLE[p["what"]], zorder=0)
    if field in ("lr", "noise_std"):
        ax.set_ylim(bottom=0)
    mark_events(ax, events, dict(points), field, labels, heldout=heldout_points(evals, field))


MAX_EPOCH_LINES = 12


def thinned(context: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The context lines to draw: every save and resume, and the epoch boundaries thinned to at most
    MAX_EPOCH_LINES (a short run of 30 epochs would be all lines)."""
    epochs = [p for p in context if p["what"] == "epoch"]
    every = -(-len(epochs) // MAX_EPOCH_LINES) if epochs else 1
    keep = {id(p) for p in epochs[::every]}
    return [p for p in context if p["what"] != "epoch" or id(p) in keep]


def heldout_points(evals, field: str) -> dict[int, float]:
    return {r["step"]: r[field] for r in evals if finite(r[field])}


def draw_heldout(ax, evals, field: str, label: str, color: str, dodge: float = 0.0, marker: str = "o") -> None:
    """The held-out values as a line with hollow markers (the training curve shows through), shifted
    by `dodge` steps, and error bars where the row has `<field>_se`."""
    points = sorted(heldout_points(evals, field).items())
    if not points:
        return
    steps = [s + dodge for s, _ in points]
    ax.plot(steps, [v for _, v in points], f"{marker}-", ms=4, lw=1.1, color=color, mfc="white", label=label, zorder=4)
    se = {r["step"]: r[f"{field}_se"] for r in evals if finite(r[field]) and finite(r[f"{field}_se"])}
    bars = [(s + dodge, v, se[s]) for s, v in points if s in se]
    if bars:
        s, v, e = zip(*bars)
        ax.errorbar(s, v, yerr=e, fmt="none", ecolor=color, elinewidth=0.8, capsize=2, zorder=4)


def mark_events(ax, events, by_step, field, labels: bool, heldout: dict[int, float] | None = None) -> None:
    """A line per event (dashed for pauses), a marker on the curve it concerns, one label per cluster;
    a generalisation event's marker sits on the held-out curve, its turn shaded."""
    top = ax.get_ylim()[1]
    for ev in events:
        color = COLORS[ev["kind"]]
        ls = "--" if ev["kind"] in ("stall", "step_gap") else "-"
        ax.axvline(ev["step"], color=color, lw=1.1, ls=ls, alpha=0.85)
        if MARKED_ON.get(ev["kind"]) == field:
            if ev["kind"] == "generalisation":
                ax.axvspan(ev["step"], ev["details"]["confirmed_step"], color=color, alpha=0.12, lw=0)
            y = (heldout or {}).get(ev["step"]) if ev["kind"] == "generalisation" else by_step.get(ev["step"])
            if finite(y):
                ax.plot([ev["step"]], [y], "v", color=color, ms=8, mec="white", zorder=5)
    if not labels:
        return
    lo, hi = ax.get_xlim()
    clusters: list[list[dict[str, Any]]] = []
    for ev in sorted(events, key=lambda e: e["step"]):
        if clusters and ev["step"] - clusters[-1][-1]["step"] < 0.02 * (hi - lo):
            clusters[-1].append(ev)
        else:
            clusters.append([ev])
    for group in clusters:
        text = " + ".join(f"{ev['kind']} @{ev['step']}" for ev in group)
        ax.text(
            group[0]["step"],
            top,
            f" {text}",
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            color=COLORS[group[0]["kind"]],
        )


def draw_zooms(plt, events, train, evals, context, path: Path) -> Path:
    """One small panel per event (12 at most): the series it concerns, around it; pace for pauses;
    train and held-out accuracy over a generalisation event's turn."""
    shown = events[:12]
    cols = min(len(shown), 3)
    nrows = -(-len(shown) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.6 * cols, 3.0 * nrows), squeeze=False)
    pace = [
        (b["step"], (b["t"] - a["t"]) / (b["step"] - a["step"]))
        for a, b in zip(train, train[1:])
        if b["step"] > a["step"] and finite(a["t"]) and finite(b["t"])
    ]
    deltas = sorted(b["step"] - a["step"] for a, b in zip(train, train[1:]) if b["step"] > a["step"])
    interval = deltas[len(deltas) // 2] if deltas else 1
    for ax, ev in zip(axes.flat, shown):
        field = MARKED_ON[ev["kind"]]
        if field == "pace":
            series, label = pace, "seconds / step"
        else:
            series = [
                (r["step"], r[field] if finite(r[field]) else float("nan"))
                for r in train
                if r[field] is not None
            ]
            label = field
        start = ev["details"].get("from_step", ev["step"])
        after = ev["details"].get("recovery_steps") or 0
        lo = start - 40 * interval
        hi = max(ev["step"] + 40 * interval, ev["step"] + int(1.3 * after))
        if ev["kind"] == "generalisation":
            span = ev["details"]["confirmed_step"] - ev["step"]
            lo, hi = ev["step"] - 2 * span, ev["details"]["confirmed_step"] + span
        window = [(s, v) for s, v in series if lo <= s <= hi]
        if window:
            ax.plot(*zip(*window), lw=0.9, color="tab:green", marker=".", ms=2)
        heldout = {s: v for s, v in heldout_points(evals, field).items() if lo <= s <= hi}
        if ev["kind"] == "generalisation":
            draw_heldout(ax, [r for r in evals if lo <= r["step"] <= hi], field, f"held-out {field}", "black")
        for p in context:
            if lo <= p["step"] <= hi:
                ax.axvline(p["step"], color="0.55", lw=0.8, ls=CONTEXT_STYLE[p["what"]], zorder=0)
        nearby = [e for e in events if lo <= e["step"] <= hi]
        mark_events(ax, nearby, dict(window), field, labels=False, heldout=heldout)
        ax.set_xlim(lo, hi)
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.25)
        ax.set_title(
            fill(describe(ev)) + "\n" + fill("cause: " + ev["likely_cause"], 2), fontsize=7, loc="left"
        )
    for ax in list(axes.flat)[len(shown) :]:
        ax.axis("off")
    fig.tight_layout()
    return save(fig, path, plt)


def fill(text: str, max_lines: int = 1, width: int = 70) -> str:
    import textwrap

    lines = textwrap.wrap(text, width)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = lines[-1][: width - 3] + "..."
    return "\n".join(lines)


def add_legend(fig, events, context) -> None:
    from matplotlib.lines import Line2D

    kinds = sorted({ev["kind"] for ev in events})
    handles = [Line2D([], [], color=COLORS[k], lw=1.5, label=k) for k in kinds]
    handles += [
        Line2D([], [], color="0.55", lw=0.8, ls=CONTEXT_STYLE[w], label=w)
        for w in sorted({p["what"] for p in context})
    ]
    if handles:
        fig.legend(
            handles=handles,
            loc="upper center",
            ncol=min(len(handles), 8),
            fontsize=8,
            frameon=False,
            bbox_to_anchor=(0.5, 0.975),
        )


def save(fig, path: Path, plt) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def verdict(diagnosis: dict[str, Any]) -> str:
    s = diagnosis["summary"]
    if s["verdict"] == "healthy":
        return "healthy, no events"
    if s["verdict"] == "cannot tell":
        return f"no events, cannot tell {' or '.join(s['undecided'])}"
    return ", ".join(f"{n} {k}" for k, n in s["events_by_kind"].items())


def markdown(
    diagnosis: dict[str, Any], path: Path, plots: dict[str, Path], missing: list[str], unreadable: int
) -> str:
    s = diagnosis["summary"]
    pace = f", {s['sec_per_step']:.3g} s/step" if s["sec_per_step"] is not None else ""
    lines = [
        f"# Training report: `{path}`",
        "",
        f"{s['train_rows']} train rows, steps {s['steps'][0]}-{s['steps'][1]}, logged every "
        f"{s['log_every_steps']} step(s){pace}; {s['event_rows']} event rows, {s['eval_rows']} eval rows"
        + (f", {unreadable} unreadable lines" if unreadable else "")
        + f". **{verdict(diagnosis)}**.",
        "",
        "## Events",
        "",
    ]
    if diagnosis["events"]:
        lines += ["| step | kind | what | likely cause |", "|---:|---|---|---|"]
        for ev in diagnosis["events"]:
            lines.append(f"| {ev['step']} | {ev['kind']} | {describe(ev)} | {ev['likely_cause']} |")
    else:
        lines.append(
            "None: no stall, step gap, loss spike, accuracy cliff, non-finite value, throughput drop, "
            "held-out turn (overfitting), loss divergence, accuracy decline, lr at 0, input-bound loader, "
            "loss whiplash or run not learning."
        )
    if s["cannot_tell"]:
        lines += ["", "## What this log cannot tell", ""] + [f"- {c}" for c in s["cannot_tell"]]
    lines += ["", "## Plots", ""]
    lines += [f"![{name}]({p.name})" for name, p in plots.items()]
    if missing:
        lines += ["", f"Not in this log, so not plotted: {', '.join(missing)}."]
    return "\n".join(lines) + "\n"
