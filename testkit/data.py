"""Small data files and the overrides of a test store, for tests and benchmarks.

    write_jsonl(tmp / "chat.jsonl", chat_rows(60))                     # conversations of varied length
    stage1_overrides(target_dir, data, run_dir)                        # stage 1 on the tiny target, tiny shards
    train_overrides_for(target_dir, store, run_dir, {"train.max_steps": 4})
"""

from __future__ import annotations

import json
from pathlib import Path


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def chat_rows(count: int, seed: int = 0, answer_words: list[int] | None = None) -> list[dict]:
    """Conversations of varied length (so batching and sharding have something to do); `answer_words`:
    each answer's length in words (about a token each), else 5 to 60."""
    import random

    rng = random.Random(seed)
    words = "the quick brown fox jumps over a lazy dog while python lists and dicts grow".split()
    rows = []
    for i in range(count):
        question = " ".join(rng.choice(words) for _ in range(rng.randint(3, 30)))
        answer = " ".join(rng.choice(words) for _ in range(rng.randint(5, 60) if answer_words is None else answer_words[i]))
        rows.append({"messages": [{"role": "user", "content": f"{i}: {question}"}, {"role": "assistant", "content": answer}]})
    return rows


def stage1_overrides(target_dir: Path, data_path: Path, run_dir: Path, **extra) -> list[str]:
    base = {
        "run_dir": str(run_dir),
        "target.path": str(target_dir),
        "target.num_feature_layers": 3,
        "target.dtype": "fp32",
        "data.path": str(data_path),
        "data.regenerate": False,
        "data.max_length": 256,
        "extract.top_k": 8,
        "extract.batch_tokens": 512,
        "store.shard_mb": 1,
        "extract.window_shards": 1,
    }
    base.update(extra)
    return [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in base.items()]


def store_data(store: Path) -> Path:
    """The data a test store was extracted from: the fixtures write `<root>/chat.jsonl` and extract it
    into `<root>/run/store`."""
    return Path(store).parent.parent / "chat.jsonl"


def train_overrides_for(target_dir: Path, store: Path, run_dir: Path, settings: dict) -> list[str]:
    """A stage-2 run on a test store with ONE config for both stages, as `make` uses it: the stage-1
    settings that made the store (`train` refuses a store its config calls stale), the store's path,
    and the run's own `settings` (dotted keys)."""
    return stage1_overrides(target_dir, store_data(store), run_dir, **{"store.path": str(store), **settings})
