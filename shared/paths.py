"""The run folder, spelled once: every path a command of either stage (or a benchmark) reads or writes.

    paths = RunPaths.of(cfg)
    paths.generated          # run_dir/data/generated.parquet   (stage 1 generate -> extract)
    paths.store              # store.path, or run_dir/store
    paths.token_cache        # data.cache_dir ($VARS expanded), or run_dir/cache
    paths.checkpoints        # checkpoint.dir, or run_dir/checkpoints; paths.step(500) = .../step_000500
    paths.log                # run_dir/train_log.jsonl, the record of truth
    paths.eval_dir, paths.export, paths.train_config, paths.preempted

`of` reads the sections it needs whether this process validated them or keeps them as given (another
stage's), so both stages and bench agree on every location.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEP_FORMAT = "step_{:06d}"


@dataclass(frozen=True)
class RunPaths:
    run_dir: Path
    store_url: str | None = None  # store.path; None = run_dir/store
    cache_dir: str | None = None  # data.cache_dir; None = run_dir/cache
    checkpoint_dir: str | None = None  # checkpoint.dir; None = run_dir/checkpoints

    @classmethod
    def of(cls, cfg: Any) -> RunPaths:
        return cls(
            Path(cfg.run_dir),
            store_url=cfg.value("store.path"),
            cache_dir=cfg.value("data.cache_dir"),
            checkpoint_dir=cfg.value("checkpoint.dir"),
        )

    # ---- stage 1 ----
    @property
    def data_dir(self) -> Path:
        return self.run_dir / "data"

    @property
    def generated(self) -> Path:
        """The target's regenerated conversations (`generate`), what `extract` reads by default."""
        return self.data_dir / "generated.parquet"

    @property
    def generated_parts(self) -> Path:
        return self.data_dir / "generated.parts"

    @property
    def generated_provenance(self) -> Path:
        """What the generated conversations were made from (input hash, target, sampling settings)."""
        return self.data_dir / "generated.provenance.json"

    def default_prompts(self, count: int, question_share: float) -> Path:
        suffix = "" if question_share == 0.25 else f"_questions{question_share:g}"  # 0.25: the name earlier runs made
        return self.data_dir / f"default_prompts_{count}{suffix}.parquet"

    @property
    def store(self) -> str:
        return self.store_url or str(self.run_dir / "store")

    @property
    def token_cache(self) -> Path:
        return Path(os.path.expandvars(self.cache_dir)) if self.cache_dir else self.run_dir / "cache"

    # ---- stage 2 ----
    @property
    def checkpoints(self) -> Path:
        return Path(self.checkpoint_dir) if self.checkpoint_dir is not None else self.run_dir / "checkpoints"

    def step(self, step: int) -> Path:
        return self.checkpoints / STEP_FORMAT.format(step)

    @property
    def log(self) -> Path:
        return self.run_dir / "train_log.jsonl"

    @property
    def train_config(self) -> Path:
        return self.run_dir / "train_config.yaml"

    @property
    def preempted(self) -> Path:
        return self.run_dir / "preempted.json"

    @property
    def eval_dir(self) -> Path:
        return self.run_dir / "eval"

    @property
    def export(self) -> Path:
        return self.run_dir / "export"


def relative_note(setting: str, path: str | os.PathLike) -> str:
    """What a "not found" adds for a relative path setting: it was looked for under the working
    directory, not beside the config file (docs/config.md, "Paths"); "" for an absolute path or a URL."""
    if Path(path).is_absolute() or "://" in str(path):
        return ""
    return f" ({setting}={path} is relative: resolved against the working directory {os.getcwd()}, not the config file's folder)"
