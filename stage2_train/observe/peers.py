"""Other trainers' metric names, mapped onto the detectors' inputs: one flat history row (a wandb
history row, a TensorBoard step, a CSV line) becomes this project's records (`kind` train / eval /
event, canonical field names), so every detector reads every log the same way.

    records, names = translate([{"_step": 10, "_runtime": 31.5, "train/loss": 2.1, "eval/avg_acc": 0.3}])
    # [{"kind": "train", "step": 10, "elapsed_s": 31.5, "loss": 2.1},
    #  {"kind": "eval", "step": 10, "elapsed_s": 31.5, "accuracy": 0.3}]
    # names == {"loss": ["train/loss"], "held-out accuracy": ["eval/avg_acc"], ...}

A row that already has `kind` or `event` (this project's JSONL), or no namespaced name at all (a flat
log such as the failed run's), is kept as it is: `records.normalize` reads its aliases. Otherwise the
row is split by namespace: `eval/`, `val/`, `validation/`, `valid/`, `test/` names make the eval
record, `event/NAME/field` names (this project's own wandb rows) an event record, the rest (with
`train/` stripped) the train record. A record whose metrics are all absent is dropped.

Where the names come from (read in each package's code):
- SpecForge 0.2.0 (`pip download specforge==0.2.0`): specforge/training/tracking.py
  (`training_metric_names`: a train metric gets `train/` unless it starts with train/ or eval/),
  specforge/training/controller.py (`loss`, `acc`, `acc_{i}`, `ploss_{i}`, `grad_norm`, `lr`,
  `perf/optimizer_step_time_s`, `perf/global_samples_per_second`, `perf/data_wait_time_s`; no epoch,
  logged at step = global optimizer step), specforge/eval/evaluator.py (`eval/avg_loss`,
  `eval/avg_acc`, `eval/simulated_acc_len`, `eval/per_position_acc/{i}`; for DFlash, a scalar-accuracy
  strategy, simulated_acc_len is avg_acc itself, so it is read only beside per-position accuracies).
  Its scripts/train_dflash.py before the package (sgl-project/SpecForge at 02011179): `train/loss`,
  `train/accuracy`, `train/lr`, `eval/loss`, `eval/accuracy`.
- speculators 0.9.0 (`pip download speculators==0.9.0`): speculators/train/trainer.py logs
  {"train": metrics, "profile": timings, "epoch", "lr", "global_step"} at step = global_step and, once
  per epoch, {"val": {name + "_epoch"}, "epoch"}, flattened with "/" (speculators/train/logger.py
  `_flatten_dict`; `lr/<optimizer>` with several optimizers); speculators/models/dflash/metrics.py
  names them `loss`, `full_acc`, `position_{i}_acc`, `eal` and one `<term>_loss` per loss term;
  the profile (trainer.py `_StepTimer.profile`) holds `step_ms`, `tokens_per_s`, `fetch_frac`.
- wandb adds `_step`, `_runtime` (seconds since the run began, continued by a resume) and
  `_timestamp`; its CSV export of a chart names columns "<run> - <metric>" beside "Step".
"""

from __future__ import annotations

from typing import Any

from stage2_train.observe.records import number

EVAL_PREFIXES = ("eval/", "val/", "validation/", "valid/", "test/")
STEP_NAMES = ("_step", "Step", "step", "global_step", "iteration", "iter", "train/global_step", "train/step")
CLOCKS = (("_runtime", "elapsed_s"), ("_timestamp", "time"), ("wall_time", "time"))  # peer name -> ours

# Canonical train field -> names (after `train/` is stripped), first present wins.
TRAIN_NAMES: dict[str, tuple[str, ...]] = {
    "loss": ("loss",),
    "accuracy": ("accuracy", "acc", "full_acc"),  # ours / SpecForge / speculators
    "accept_len": ("accept_len", "eal"),  # ours / speculators (per block, bonus included)
    "lr": ("lr", "learning_rate"),
    "grad_norm": ("grad_norm",),
    "noise_std": ("noise_std",),
    "tok_per_s": ("tok_per_s", "profile/tokens_per_s", "tokens_per_s"),
    "samples_per_s": ("samples_per_s", "perf/global_samples_per_second"),
    "data_wait_frac": ("data_wait_frac", "profile/fetch_frac"),
    "epoch": ("epoch",),
    "elapsed_s": ("elapsed_s",),
}
# Canonical eval field -> names (after the eval prefix is stripped).
EVAL_NAMES: dict[str, tuple[str, ...]] = {
    "ce": ("ce", "loss", "avg_loss", "loss_epoch"),
    "accuracy": ("accuracy", "acc", "avg_acc", "full_acc", "full_acc_epoch"),
    "accept_len": ("accept_len", "eal", "eal_epoch"),
    "walk_tau": ("walk_tau",),
    **{f"{m}_se": (f"{m}_se",) for m in ("ce", "accuracy", "accept_len", "walk_tau")},
    "num_samples": ("num_samples",),
    "num_blocks": ("num_blocks",),
    "num_tokens": ("num_tokens",),
    "eval_s": ("eval_s",),
}


def needs_translation(row: dict[str, Any]) -> bool:
    """A row of another trainer's history: no `kind`/`event`, and namespaced or wandb-internal names."""
    if "kind" in row or "event" in row:
        return False
    # "Step" is wandb's chart export's column: a chart of a metric logged without a namespace ("loss")
    # has no other mark, and normalize's step aliases do not hold it (no train rows: nothing diagnosed).
    return any("/" in key or key.startswith("_") or key == "Step" for key in row)


def translate(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """(records in this project's form, canonical field -> the log's own names it was read from;
    held-out fields are named "held-out <field>")."""
    out: list[dict[str, Any]] = []
    names: dict[str, list[str]] = {}
    for row in rows:
        out += split_row(row, names) if needs_translation(row) else [row]
    return out, names


TRAIN_METRICS = ("loss", "accuracy", "accept_len", "lr", "grad_norm", "tok_per_s", "samples_per_s")


def split_row(row: dict[str, Any], names: dict[str, list[str]]) -> list[dict[str, Any]]:
    """One history row -> its train, eval and event records (those that hold a metric)."""
    step = next((number(row[k]) for k in STEP_NAMES if k in row and number(row[k]) is not None), None)
    if step is None:
        return []
    base: dict[str, Any] = {"step": int(step)}
    for peer, ours in CLOCKS:
        if ours not in base and number(row.get(peer)) is not None:
            base[ours] = number(row[peer])
    # name without its namespace -> (the log's own name, value)
    train: dict[str, tuple[str, Any]] = {}
    evals: dict[str, tuple[str, Any]] = {}
    events: dict[str, dict[str, Any]] = {}
    for key, value in row.items():
        prefix = next((p for p in EVAL_PREFIXES if key.startswith(p)), None)
        if prefix is not None:
            evals[key[len(prefix) :]] = (key, value)
        elif key.startswith("event/") and key.count("/") >= 2:
            _, event, field = key.split("/", 2)
            events.setdefault(event, {})[field] = value
        else:
            train[key.removeprefix("train/")] = (key, value)
    lr = next((k for k in train if k.startswith("lr/")), None)
    if "lr" not in train and lr is not None:  # speculators with several optimizers: lr/<optimizer>
        train["lr"] = train[lr]
    wait, took = (train.get(k, (None, None)) for k in ("perf/data_wait_time_s", "perf/optimizer_step_time_s"))
    if "data_wait_frac" not in train and number(wait[1]) is not None and number(took[1]):
        # SpecForge: the loader's wait per optimizer step, over the step's time
        train["data_wait_frac"] = (f"{wait[0]} / {took[0]}", number(wait[1]) / number(took[1]))
    if "simulated_acc_len" in evals:
        simulated = evals.pop("simulated_acc_len")
        if any(k.startswith("per_position_acc") for k in evals):  # else (DFlash) it is avg_acc itself
            evals.setdefault("accept_len", simulated)
    records = []
    record = _mapped(train, TRAIN_NAMES, names, "")
    if any(k in record for k in TRAIN_METRICS):
        records.append({"kind": "train", **base, **record})
    record = _mapped(evals, EVAL_NAMES, names, "held-out ")
    if any(k in record for k in ("ce", "accuracy", "accept_len", "walk_tau")):
        # Ahead of the train record: the row's clock (wandb's _runtime, TensorBoard's latest wall time)
        # is the eval's end, so the gap up to this row holds the eval, which the pace then does not judge.
        records.insert(0, {"kind": "eval", **base, **record})
    for event, fields in events.items():
        own = number(
            fields.pop("step", None)
        )  # MetricsSink logs a late row at the latest step, its own as step
        records.append(
            {
                "kind": "event",
                "event": event,
                **base,
                **fields,
                "step": int(own) if own is not None else base["step"],
            }
        )
    return records


def _mapped(
    fields: dict[str, tuple[str, Any]],
    table: dict[str, tuple[str, ...]],
    names: dict[str, list[str]],
    label: str,
) -> dict[str, Any]:
    """The canonical fields found in `fields` (numbers only), noting the log's names they came from."""
    out: dict[str, Any] = {}
    for canonical, candidates in table.items():
        found = next(
            (fields[c] for c in candidates if c in fields and number(fields[c][1]) is not None), None
        )
        if found is None:
            continue
        out[canonical] = number(found[1])
        seen = names.setdefault(label + canonical, [])
        if found[0] not in seen:
            seen.append(found[0])
    return out
