"""The data room's config section: how the sampler cuts the store into micro-batches and blocks.
No torch here, so `check` and the doctor validate a config without loading it.
"""

from __future__ import annotations

from typing import ClassVar

from shared.config import Section


class SamplerConfig(Section):
    section: ClassVar[str] = "sampler"
    renamed: ClassVar[dict[str, str]] = {"token_budget": "micro_batch_tokens", "grad_accum": "train.grad_accum"}
    micro_batch_tokens: int = 16384
    """Real (unpadded) context tokens per micro-batch per rank (one optimizer step holds world_size x
    train.grad_accum of them). Samples longer than this are an error."""
    micro_batch_blocks: int | None = None
    """Blocks (anchors, each model.block_size rows through the drafter and its LM head) per micro-batch
    per rank: the budget GPU memory is spent in. A sample counts min(its valid anchors,
    max_anchors_per_seq). null: micro_batch_tokens // 2 (at least one sample's blocks), the blocks of
    1,024-token samples with 512 anchors each. `python -m stage2_train plan` traces the densest
    micro-batch the two budgets allow; `plan --search` gives the largest that fits a GPU."""
    max_samples_per_batch: int | None = None
    """Optional cap on samples per micro-batch; None = tokens are the only limit."""
    window_slack: float = 0.05
    """Each step's window over-fills the step by this fraction; the surplus carries to the next step."""
    max_anchors_per_seq: int = 512
    """Anchors (blocks) drawn per sequence per epoch, used by AnchorSampler. DFlash recipe: 512."""

    def validate(self) -> None:
        self.require(self.micro_batch_tokens > 0, "micro_batch_tokens", "must be > 0")
        one_sample = self.one_sample_blocks()
        self.require(
            self.micro_batch_blocks is None or self.micro_batch_blocks >= one_sample,
            "micro_batch_blocks",
            f"must be >= {one_sample} (the most blocks one sample can yield: min(max_anchors_per_seq, "
            f"micro_batch_tokens - 1)) or null",
        )
        self.require(
            self.max_samples_per_batch is None or self.max_samples_per_batch > 0,
            "max_samples_per_batch",
            "must be > 0 or null",
        )
        self.require(0.0 <= self.window_slack <= 1.0, "window_slack", "must be in [0, 1]")
        self.require(self.max_anchors_per_seq >= 1, "max_anchors_per_seq", "must be >= 1")

    def one_sample_blocks(self) -> int:
        """The most blocks one sample can yield: every micro-batch must hold it."""
        return max(1, min(self.max_anchors_per_seq, self.micro_batch_tokens - 1))

    def blocks_budget(self) -> int:
        """sampler.micro_batch_blocks as set, or the rule when null. A function of the config alone, so
        every rank and every resume derive the same plan."""
        if self.micro_batch_blocks is not None:
            return self.micro_batch_blocks
        return max(self.micro_batch_tokens // 2, self.one_sample_blocks())

    def recipe_warnings(self) -> list[str]:
        if self.max_anchors_per_seq != 512:
            return [
                f"sampler.max_anchors_per_seq={self.max_anchors_per_seq} departs from the DFlash recipe (512)"
            ]
        return []
