"""What the benchmark scripts share: their command line and results, running the pipeline's commands
as `make` does, the stage-1 pure forward, the documentation chats, plots and the report's rows
(`Row`: each benchmark's `rows(result)` gives its lines of BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STARTED = time.perf_counter()  # the benchmark's start: it imports this module first
Row = tuple[str, str, str, str, str]  # (figure, value, goal, baseline measured in the same run, met?)


def arguments(doc: str) -> argparse.ArgumentParser:
    """A benchmark's command line: its docstring's first paragraph, and --json (run_all.py passes it)."""
    out = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    out.add_argument("--json", help="write the results here too")
    return out


def emit(results: dict[str, Any], json_path: str | os.PathLike | None, started: float = STARTED) -> int:
    """Add the total time, print the results as JSON and write them to `json_path` when given."""
    results["total_s"] = round(time.perf_counter() - started, 1)
    text = json.dumps(results, indent=1)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")
    return 0


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def evict(folder: Path) -> int:
    """Drop every file under `folder` from the page cache (a cold read); returns the bytes evicted."""
    total = 0
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            total += path.stat().st_size
    return total


def relative_error(approx: Any, exact: Any, eps: float = 1e-6) -> Any:
    """||approx - exact|| / ||exact|| over the last dimension (per token, or per token and layer), fp32."""
    exact = exact.float()
    return (approx.float() - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(eps)


def calls_per_s(fns: dict[str, Any], rounds: int = 5, min_s: float = 0.2) -> dict[str, float]:
    """Calls per second of each function: the best of `rounds` rounds taken in turn, so a burst of
    load from other processes on a shared machine falls on every function alike and is then dropped."""
    best = dict.fromkeys(fns, 0.0)
    for _ in range(rounds):
        for name, fn in fns.items():
            started, runs = time.perf_counter(), 0
            while time.perf_counter() - started < min_s:
                fn()
                runs += 1
            best[name] = max(best[name], runs / (time.perf_counter() - started))
    return best


@contextlib.contextmanager
def figure(path: Path, size: tuple[float, float]) -> Any:
    """A matplotlib axis (Agg) whose figure is laid out and written to `path` as a PNG at the end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    yield ax
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The pipeline's commands, each in its own process


@dataclass
class Done:
    launched: float  # unix time the process started
    seconds: float  # its wall time
    peak_rss_mib: int  # its own peak memory (wait4)
    stdout: str

    @property
    def summary(self) -> dict[str, Any]:
        """The last JSON object the command printed (`--json`), {} when none."""
        lines = self.stdout.splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("{")]
        return json.loads("\n".join(lines[starts[-1]:])) if starts else {}


class CommandFailed(RuntimeError):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def run_cli(args: list[str], log: Path, env: dict[str, str] | None = None, timeout: float | None = None) -> Done:
    """`python <args>` from the repository root with the repository importable and W&B off; stderr
    to `log`, stdout to `log`.out. A failure raises CommandFailed (a RuntimeError with the exit code
    and the end of the log); a run past `timeout` seconds is killed, with every process it started
    (torchrun's ranks), and raises subprocess.TimeoutExpired, as an interrupt of this one does."""
    log.parent.mkdir(parents=True, exist_ok=True)
    out_path = log.with_name(log.name + ".out")
    paths = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": paths, **(env or {})}
    launched, started = time.time(), time.perf_counter()
    killed = threading.Event()
    with out_path.open("w") as out, log.open("w") as err:
        proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True)

        def kill() -> None:  # the child's whole group: killing torchrun alone would leave its ranks running
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        killer = threading.Timer(max(timeout, 1), lambda: (killed.set(), kill())) if timeout else None
        if killer:
            killer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # wait4: this child's own peak memory
        except BaseException:  # an interrupt, or the GPU check's SIGTERM: no process outlives it
            kill()
            raise
        finally:
            if killer:
                killer.cancel()
    seconds, code = time.perf_counter() - started, os.waitstatus_to_exitcode(status)
    if killed.is_set():
        raise subprocess.TimeoutExpired(args, timeout)
    if code != 0:
        raise CommandFailed(f"python {' '.join(args[:4])} ... failed (exit {code}); the end of {log}:\n{log.read_text()[-3000:]}", code)
    return Done(launched, seconds, usage.ru_maxrss // 1024, out_path.read_text())  # Linux reports KiB


@dataclass
class Training(Done):
    paths: Any = None  # shared.paths.RunPaths of the run

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The run's train rows (train_log.jsonl)."""
        from stage2_train.observe.metrics import read_log

        return read_log(self.paths.log, "train")


def run_training(run_dir: Path, overrides: list[str], config: str = "configs/default.yaml", nproc: int = 1,
                 env: dict[str, str] | None = None) -> Training:
    """`stage2_train train` as `make train` runs it, a fresh run in `run_dir` (never resumed, W&B off),
    in its own process (`nproc` > 1: torchrun on this machine); its output to <run_dir>.log."""
    from shared.paths import RunPaths

    launcher = ["-m", "stage2_train"]
    if nproc > 1:
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *launcher]
    command = [*launcher, "train", "--json", "--no-progress", "--config", config, *overrides, f"run_dir={run_dir}",
               "train.resume=never", "log.wandb=disabled"]
    done = run_cli(command, Path(f"{run_dir}.log"), env)
    return Training(**vars(done), paths=RunPaths(Path(run_dir)))


def existing_store(config: str, overrides: list[str]) -> str:
    """The store `config` names, refused by name when it was never extracted."""
    import stage1_extract  # noqa: F401 - both stages' config sections
    import stage2_train  # noqa: F401
    from shared.config import load_run_config
    from shared.paths import RunPaths

    store = RunPaths.of(load_run_config(config, overrides)).store
    if not (Path(store) / "manifest.json").is_file():
        raise SystemExit(f"{store}: no store; run `make extract CONFIG={config}` (`make train` for the default) first")
    return store


def steady(rows: list[dict[str, Any]], skip: int = 2) -> list[dict[str, Any]]:
    """The logged steps after the first `skip` (start-up, compilation), or all when too few."""
    return rows[skip:] if len(rows) > skip + 1 else rows


def step_figures(rows: list[dict[str, Any]], skip: int = 2) -> dict[str, Any]:
    """A run's train rows (train_log.jsonl) over its steady steps: medians of the rates, means of the
    per-step times and the data-wait fraction, and the first and last loss."""
    measured = steady(rows, skip)
    return {
        "steps_measured": len(measured),
        "step_s_median": round(statistics.median(r["step_s"] for r in measured), 4),
        "tok_per_s": round(statistics.median(r["tokens"] / r["step_s"] for r in measured), 1),
        "blocks_per_s": round(statistics.median(r["blocks"] / r["step_s"] for r in measured), 2),
        "data_wait_frac": round(statistics.mean(r["data_wait_frac"] for r in measured), 4),
        "split_s": {k: round(statistics.mean(r[k] for r in measured), 4) for k in ("data_s", "forward_s", "backward_s", "optim_s")},
        "loss_first_last": [round(rows[0]["loss"], 4), round(rows[-1]["loss"], 4)],
    }


# ---------------------------------------------------------------------------------------------
# Stage 1


def documentation_chats(path: Path, count: int, answer_chars: int = 0, seed: int = 1) -> Path:
    """The default prompts (stage1_extract.corpus) answered with documentation paragraphs, joined up to
    `answer_chars` characters (0: one paragraph): real text, no generate run, as a Parquet file."""
    import random
    from pydoc_data.topics import topics

    from shared.conversations import Conversation
    from stage1_extract.corpus import default_conversations
    from stage1_extract.data import write_conversations_parquet

    paragraphs = [p.strip() for t in sorted(topics) for p in topics[t].split("\n\n") if 300 < len(p.strip()) < 1500]
    rng = random.Random(seed)
    conversations = []
    for i, conv in enumerate(default_conversations(count)):
        answer = rng.choice(paragraphs)
        while len(answer) < answer_chars:
            answer += "\n\n" + rng.choice(paragraphs)
        conversations.append(Conversation(row=i, messages=[*conv.messages, {"role": "assistant", "content": answer}]))
    write_conversations_parquet(conversations, path)
    return path


def short_answers(path: Path, count: int, answer_chars: int, seed: int = 2) -> Path:
    """Conversations that are nearly all answer: an empty system turn, a two-word question and a
    documentation paragraph cut to `answer_chars` at a word boundary (~4 characters a token), so
    nearly every token is supervised: the most anchor blocks per token, the memory plan's worst case."""
    import random
    from pydoc_data.topics import topics

    from shared.conversations import Conversation
    from stage1_extract.data import write_conversations_parquet

    text = " ".join(p.strip() for t in sorted(topics) for p in topics[t].split("\n\n") if len(p.strip()) > 200).split()
    rng = random.Random(seed)
    conversations = []
    for i in range(count):
        start = rng.randrange(len(text) - answer_chars)
        words, size = [], 0
        for word in text[start:]:
            if size + len(word) + 1 > answer_chars:
                break
            words.append(word)
            size += len(word) + 1
        messages = [{"role": "system", "content": ""}, {"role": "user", "content": "Go on."},
                    {"role": "assistant", "content": " ".join(words)}]
        conversations.append(Conversation(row=i, messages=messages))
    write_conversations_parquet(conversations, path)
    return path


def pure_forward(model: Any, cfg: Any, prepared: Any, keep: bool = False) -> tuple[dict[str, Any], list[Any]]:
    """The target's forward over exactly the batches extraction forms (`forward_batches`, one rank),
    after a one-row warm-up, timed by the wall clock with the device synchronised after every batch;
    nothing written. The features are kept (as SampleFeatures, on the model's device) when `keep`."""
    import torch

    from shared.codecs import SampleFeatures
    from stage1_extract.batching import windows_for_rank
    from stage1_extract.extract import forward_batches
    from stage1_extract.prepare import planned_shards

    windows = windows_for_rank(planned_shards(prepared, cfg.store), cfg.extract.window_shards, 0, 1)
    packed = prepared.header["extraction"]["packed"]  # what extraction runs with: the store's header
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    first = windows[0][0]
    for _ in forward_batches(model, [[replace(first, rows=first.kept[:1])]], cfg.extract, prepared.layer_ids, packed):
        sync()
    features, tokens, padded, batches = [], 0, 0, 0
    started = time.perf_counter()
    for batch, outputs in forward_batches(model, windows, cfg.extract, prepared.layer_ids, packed):
        sync()
        tokens += sum(len(r.input_ids) for r in batch)
        padded += len(batch) * max(len(r.input_ids) for r in batch)
        batches += 1
        if keep:
            features += [SampleFeatures(r.sample_id, r.input_ids, r.loss_mask, *out) for r, out in zip(batch, outputs)]
    seconds = time.perf_counter() - started
    figures = {"seconds": round(seconds, 3), "tokens": tokens, "padded_tokens": padded, "batches": batches,
               "tok_per_s": round(tokens / seconds, 1), "attn_implementation": model.config._attn_implementation, "packed": packed}
    return figures, features
