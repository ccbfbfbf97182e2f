"""The GPU memory of one training step at its worst, from real steps traced with fake tensors.

    python -m stage2_train plan --config qwen3-8b                 # the densest micro-batch on 80/141 GB
    python -m stage2_train plan --config qwen3-8b --search        # + the largest budgets that fit each GPU

The drafter of the config, at the target's shape, runs real optimizer steps the way the trainer
runs them (below) on CPU under torch's FakeTensorMode, so no byte is allocated, while torch's
MemTracker follows every tensor's storage: weights, gradients, optimizer state, the micro-batch on
the device, activations and temporaries, and the peak. Attention runs as "memory"
(`model/attention.py`): what compiled flex allocates and keeps for backward, without its arithmetic.

The micro-batch is the densest the sampler can form under its two budgets (`data/sampler.py`):
`sampler.micro_batch_tokens` of context and min(`sampler.micro_batch_blocks`, the most blocks those
tokens can yield) blocks, every slot scored. Memory follows tokens and blocks, not how they split
into samples (the attention keeps per-token and per-row tensors; the loss per scored row), so no
data the sampler accepts can exceed it.

The step as `train/trainer.py` runs it: one micro-batch of 1 (the first step makes the optimizer
state), then min(grad_accum, 2) (from the second micro-batch on, the gradients are whole while the
next one's activations build up). Three costs the trainer no longer pays are traced by putting each
back (`LEGACY_COSTS`, `removed_costs_gib`), so each removal is measured, not assumed.

What the trace cannot see is added by formula and said so: DDP's gradient buckets (a second copy of
the gradients, fp32), and the CUDA context, NCCL buffers and allocator slack (`RESERVE_GB`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from shared.target import TargetArch
from stage2_train.data.batch import IGNORE, DrafterBatch, scored_index
from stage2_train.data.config import SamplerConfig
from stage2_train.model.config import DrafterConfig, LossConfig
from stage2_train.model.drafter import drafter_class
from stage2_train.model.loss import dflash_loss
from stage2_train.train.config import NoiseConfig, OptimConfig
from stage2_train.train.schedules import NoiseSchedule, Optimizers, noise_generator

TOP_K = 64  # the recipe's stored top-k (stage 2 reads K from the manifest; planning assumes this)
RESERVE_GB = 4.0  # CUDA context (~0.5-1 GB), NCCL buffers, allocator fragmentation: a margin, not a trace
# What torch reports as a card's total memory, GiB (an "80 GB" H100 holds 79.6 GiB, an H200 140.4).
GPUS = {"H100/A100 80 GB": 79.6, "H200 141 GB": 140.4}
SEARCH_BLOCKS = 256  # the search's step in micro_batch_blocks

# Published shapes, for planning on a machine that has only the preset (no weights).
KNOWN_TARGETS = {
    "qwen3-8b": TargetArch("qwen3", 4096, 12288, 36, 32, 8, 128, 151936, 1e-6, 1e6, 40960, False),
    "llama-3.1-8b": TargetArch("llama", 4096, 14336, 32, 32, 8, 128, 128256, 1e-5, 5e5, 131072, False),
}

# Costs of earlier versions of the step, each traced by putting it back (`traced_step(legacy=...)`).
LEGACY_COSTS = {
    "fp32_output_cast": "Accelerate's prepare() wraps forward in convert_outputs_to_fp32, an fp32 copy of the "
    "drafter's [N, B, H] output; trainer.py removes the wrapper and runs the forward inside accelerator.autocast()",
    "all_micro_batches_on_device": "all grad_accum micro-batches moved to the GPU at the step's start; trainer.py "
    "moves each one inside the loop and drops it after its backward",
    "noisy_copy": "the noise added out of place (a noisy copy of the context beside the clean one, and an fp32 "
    "noise tensor of its size); NoiseSchedule.apply_ adds it in place, 4,096 rows at a time",
}


@dataclass(frozen=True)
class StepShape:
    """A micro-batch: `tokens` of context in `samples` samples yielding `blocks` blocks."""

    tokens: int
    blocks: int
    samples: int
    block_size: int

    @property
    def block_rows(self) -> int:
        return self.blocks * self.block_size

    def sample_tokens(self) -> list[int]:
        base, extra = divmod(self.tokens, self.samples)
        return [base + (i < extra) for i in range(self.samples)]

    def sample_blocks(self) -> list[int]:
        base, extra = divmod(self.blocks, self.samples)
        return [base + (i < extra) for i in range(self.samples)]


def densest_micro_batch(tokens: int, blocks_budget: int, max_anchors: int, block_size: int) -> StepShape:
    """The micro-batch with the most blocks (and tokens) both budgets allow. A sample of S tokens
    yields at most min(S - 1, max_anchors) blocks, so tokens yield the most blocks in samples of
    max_anchors + 1 tokens; the blocks are the fewer of that and the budget, in as few samples as
    can hold them (the split does not change the memory)."""
    full, rest = divmod(tokens, max_anchors + 1)
    from_tokens = full * max_anchors + max(rest - 1, 0)
    blocks = max(1, min(blocks_budget, from_tokens))
    samples = max(1, math.ceil(blocks / max_anchors))
    blocks = min(blocks, tokens - samples)  # each sample keeps one token that anchors nothing
    return StepShape(tokens, blocks, samples, block_size)


def _micro_batch(shape: StepShape, vocab_size: int, label_shift: int = 0) -> DrafterBatch:
    """The micro-batch's index tensors as the loader leaves them on the host, every slot scored (from
    slot 1; a DSpark block, `label_shift` 1, from slot 0); built outside fake mode (the scored index
    needs real values). The context and top-k come in fake mode."""
    N, B = shape.blocks, shape.block_size
    lengths, blocks = shape.sample_tokens(), shape.sample_blocks()
    anchors = [torch.linspace(0, max(S - 2, 0), a).long() for S, a in zip(lengths, blocks)]
    labels_NB = torch.randint(0, vocab_size, (N, B))
    labels_NB[:, : 1 - label_shift] = IGNORE
    scored_M, per_slot = scored_index(labels_NB)
    return DrafterBatch(
        context_TF=torch.empty(0),
        context_pos_T=torch.cat([torch.arange(S) for S in lengths]),
        context_seq_T=torch.repeat_interleave(torch.arange(shape.samples), torch.tensor(lengths)),
        block_ids_NB=torch.zeros(N, B, dtype=torch.long),
        block_seq_N=torch.repeat_interleave(torch.arange(shape.samples), torch.tensor(blocks)),
        anchor_pos_N=torch.cat(anchors),
        labels_NB=labels_NB,
        num_samples=shape.samples,
        num_tokens=shape.tokens,
        scored_M=scored_M,
        scored_per_slot=per_slot,
        label_shift=label_shift,
        prev_ids_NB=torch.zeros(N, B, dtype=torch.long),
    )


def _to_device(host: DrafterBatch) -> DrafterBatch:
    """The host-to-device copy (`DrafterBatch.to` in the trainer): under fake tensors on CPU a copy is
    what allocates, so every tensor is cloned."""
    return replace(host, **{f.name: getattr(host, f.name).clone() for f in fields(host) if isinstance(getattr(host, f.name), torch.Tensor)})


def traced_step(
    model_cfg: DrafterConfig,
    loss_cfg: LossConfig,
    arch: TargetArch,
    num_feature_layers: int,
    shape: StepShape,
    *,
    grad_accum: int = 1,
    noise_cfg: NoiseConfig | None = None,
    optim_cfg: OptimConfig | None = None,
    bf16: bool = True,
    legacy: frozenset[str] = frozenset(),
    eval_shape: StepShape | None = None,
) -> dict[str, float]:
    """GiB by kind (Parameter, Buffer, Gradient, Activation, Temp, Optstate, Other) at the peak of
    the traced steps, and its Total. `legacy`: LEGACY_COSTS put back, to measure what each cost.
    `eval_shape`: then the held-out eval's densest pack scored as `train/evaluate.py` scores it (no
    gradients, the optimizer state still resident); "step_total" is the peak before it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    unknown = set(legacy) - set(LEGACY_COSTS)
    if unknown:
        raise ValueError(f"unknown legacy costs {sorted(unknown)}; known: {list(LEGACY_COSTS)}")
    noise = NoiseSchedule(noise_cfg or NoiseConfig())
    dtype = torch.bfloat16 if bf16 else torch.float32
    # The resident micro-batches only show with every one of them; otherwise two show the pattern.
    micro_batches = grad_accum if "all_micro_batches_on_device" in legacy else min(grad_accum, 2)
    indices = _micro_batch(shape, arch.vocab_size, model_cfg.label_shift)
    eval_indices = None if eval_shape is None else _micro_batch(eval_shape, arch.vocab_size, model_cfg.label_shift)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = drafter_class(model_cfg.variant)(model_cfg, arch, num_feature_layers, min(arch.vocab_size - 1, 151669))
        model.attention_backend = "memory"
        embed = torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype)
        head = embed if arch.tie_word_embeddings else torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype)
        model.set_frozen_parts(embed, head)
        model.train()
        optimizers = Optimizers(model, optim_cfg or OptimConfig(), total_steps=2)
        N, B = shape.blocks, shape.block_size
        host = replace(indices, context_TF=torch.empty(shape.tokens, num_feature_layers * arch.hidden_size, dtype=dtype))
        if loss_cfg.needs_topk or model_cfg.reads_topk:  # the stored top-k the KL term, candidate softmax or a head reads (K = TOP_K)
            host = replace(host, topk_logprobs_NBK=torch.empty(N, B, TOP_K), topk_ids_NBK=torch.zeros(N, B, TOP_K, dtype=torch.long))
        tracker = MemTracker()
        tracker.track_external(model, *optimizers.all())
        with tracker:
            for step, count in enumerate((1, micro_batches)):
                resident = [_to_device(host) for _ in range(count)] if "all_micro_batches_on_device" in legacy else []
                for micro in range(count):
                    batch = resident[micro] if resident else _to_device(host)
                    generator = noise_generator(0, step, micro)
                    if "noisy_copy" in legacy:
                        clean = batch  # the step's list kept the clean micro-batch alive beside the noisy one
                        batch = replace(batch, context_TF=_noisy_copy(batch.context_TF, noise.std_at(10**9)))
                    else:
                        noise.apply_(batch.context_TF, 10**9, generator)  # past any warmup: noise on
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        hidden_NBH = model(batch)
                        if "fp32_output_cast" in legacy:
                            hidden_NBH = hidden_NBH.float()
                        loss, _ = dflash_loss(hidden_NBH, model.lm_head_VH, batch, loss_cfg, None, variant=model)
                    loss.backward()
                    del batch, hidden_NBH, loss
                    if "noisy_copy" in legacy:
                        del clean
                    tracker.reset_mod_stats()  # per-module stats, one forward each; the peak stays
                del resident
                optimizers.step()
                optimizers.zero_grad()
            (_, step_kinds), *_ = tracker.get_tracker_snapshot("peak").items()
            if eval_indices is not None:
                _trace_eval(model, eval_indices, num_feature_layers * arch.hidden_size, model_cfg, loss_cfg, dtype, bf16)
        peak = tracker.get_tracker_snapshot("peak")

    def gib(by_kind: dict[Any, int]) -> dict[str, float]:
        return {str(getattr(k, "value", k)): round(v / 2**30, 3) for k, v in by_kind.items()}

    (_, by_kind), *_ = peak.items()
    return {**gib(by_kind), "step_total": gib(step_kinds)["Total"]}


def _trace_eval(model: Any, indices: DrafterBatch, features: int, model_cfg: DrafterConfig, loss_cfg: LossConfig,
                dtype: torch.dtype, bf16: bool) -> None:
    """The held-out eval's densest pack (`indices`, built outside fake mode: every anchor of
    `eval.offline_batch_tokens` tokens scored, the final eval's case, more block rows than a training
    micro-batch holds) through `score_blocks`, as `HeldoutEvaluator` runs it between steps: no
    gradients, under the step's autocast."""
    from stage2_train.train.evaluate import score_blocks

    (N, B), T = indices.labels_NB.shape, indices.num_tokens
    host = replace(indices, context_TF=torch.empty(T, features, dtype=dtype))
    if model_cfg.reads_topk:
        host = replace(host, topk_logprobs_NBK=torch.empty(N, B, TOP_K), topk_ids_NBK=torch.zeros(N, B, TOP_K, dtype=torch.long))
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        scored = score_blocks(model, _to_device(host), loss_cfg.gamma)
    del scored
    model.train()


def _noisy_copy(context_TF: torch.Tensor, std: float) -> torch.Tensor:
    """The earlier NoiseSchedule.apply: context + noise, out of place (for LEGACY_COSTS only)."""
    noise = torch.rand(context_TF.shape, dtype=torch.float32).mul_(2.0 * std * math.sqrt(3.0)).sub_(std * math.sqrt(3.0))
    return context_TF + noise.to(context_TF.dtype)


def formula(model_cfg: DrafterConfig, arch: TargetArch, num_feature_layers: int, world_size: int) -> dict[str, float]:
    """GiB of what does not depend on the batch: fp32 weights, gradients and DDP's bucket copy of
    them, AdamW's two moments, the frozen embedding and LM head in bf16."""
    H, inner, L = arch.hidden_size, model_cfg.intermediate_size or arch.intermediate_size, model_cfg.num_layers
    attn = H * arch.num_attention_heads * arch.head_dim * 2 + H * arch.num_key_value_heads * arch.head_dim * 2
    params = L * (attn + 3 * H * inner + 2 * H + 2 * arch.head_dim) + num_feature_layers * H * H + 2 * H
    params += variant_params(model_cfg, arch)
    gib = 2**30
    frozen = arch.vocab_size * H * 2 * (1 if arch.tie_word_embeddings else 2)
    return {
        "params": round(params / 1e9, 3),  # billions
        "weights_fp32": round(4 * params / gib, 2),
        "grads_fp32": round(4 * params / gib, 2),
        "ddp_buckets_fp32": round(4 * params / gib, 2) if world_size > 1 else 0.0,
        "adamw_state_fp32": round(8 * params / gib, 2),
        "frozen_embed_and_head_bf16": round(frozen / gib, 2),
    }


def variant_params(model_cfg: DrafterConfig, arch: TargetArch) -> int:
    """What a variant adds to the drafter's trained parameters (model/dspark.py, model/dflash2.py). At
    Qwen3-8B (V 151,936, H 4096, r 256): DSpark's two [V, r] Markov matrices are 77.8 M (+4,353 for the
    confidence head); DFlash2's codebooks 77.8 M + 1.0 M, and its convolutions 2 x (2 taps x 2 sides x H/16
    x H + 2 x 2 x H) per layer, 8.4 M (42 M over 5 layers). Their activations are traced: the Markov
    bias is added inside each LM-head chunk, the selector's scores are [rows, K]."""
    V, H = arch.vocab_size, arch.hidden_size
    c = model_cfg
    if c.variant == "dspark":
        r = c.markov_rank
        heads = {"vanilla": 0, "gated": (H + r) * r + r, "rnn": (2 * r + H) * 3 * r + 3 * r}[c.markov_head]
        return 2 * V * r + heads + ((H + r + 1) if c.confidence_head else 0)
    if c.variant == "dflash2":
        conv = 2 * (2 * c.conv_kernel_size * (H // c.conv_group_size) * H + 2 * c.conv_kernel_size * H)
        return 2 * V * c.selector_rank + c.selector_rank * H + c.num_layers * conv
    return 0


@dataclass
class PlanInputs:
    """Everything of a run config the plan reads."""

    model: DrafterConfig
    loss: LossConfig
    sampler: SamplerConfig
    noise: NoiseConfig
    optim: OptimConfig
    grad_accum: int
    arch: TargetArch
    num_feature_layers: int
    bf16: bool = True  # the trainer's compute dtype on a GPU (train.mixed_precision; fp32 doubles every activation)
    eval_tokens: int | None = None  # the held-out eval's largest pack (None: the run holds nothing out, no eval)

    def trace(self, shape: StepShape, model: DrafterConfig | None = None, legacy: frozenset[str] = frozenset(),
              with_eval: bool = True) -> dict[str, float]:
        return traced_step(
            model or self.model, self.loss, self.arch, self.num_feature_layers, shape,
            grad_accum=self.grad_accum, noise_cfg=self.noise, optim_cfg=self.optim, bf16=self.bf16, legacy=legacy,
            eval_shape=self.eval_shape() if with_eval else None,
        )

    def eval_shape(self) -> StepShape | None:
        """The final eval's densest pack: one sample of `eval_tokens`, every token but the last an anchor."""
        if self.eval_tokens is None:
            return None
        return densest_micro_batch(self.eval_tokens, self.eval_tokens, self.eval_tokens, self.model.block_size)

    def shape(self, tokens: int, blocks: int) -> StepShape:
        return densest_micro_batch(tokens, blocks, self.sampler.max_anchors_per_seq, self.model.block_size)


def plan(inputs: PlanInputs, world_size: int = 8, search: bool = False, removed_costs: bool = True) -> dict[str, Any]:
    """The plan `python -m stage2_train plan` prints: the traced peak of the densest micro-batch the
    config's budgets allow, with and without activation checkpointing, what each removed cost would
    add back, the formula's fixed parts, whether it fits each GPU, and (with `search`) the largest
    budgets, at the config's ratio of tokens to blocks, that fit each."""
    sampler = inputs.sampler
    shape = inputs.shape(sampler.micro_batch_tokens, sampler.blocks_budget())
    fixed = formula(inputs.model, inputs.arch, inputs.num_feature_layers, world_size)
    untraced = fixed["ddp_buckets_fp32"] + RESERVE_GB
    out: dict[str, Any] = {
        "target_shape": {k: getattr(inputs.arch, k) for k in ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads", "num_key_value_heads")},
        "budgets": {
            "micro_batch_tokens": sampler.micro_batch_tokens, "micro_batch_blocks": sampler.blocks_budget(),
            "micro_batch_blocks_from": "the config" if sampler.micro_batch_blocks is not None else "null: micro_batch_tokens // 2",
            "max_anchors_per_seq": sampler.max_anchors_per_seq, "grad_accum": inputs.grad_accum,
        },
        "micro_batch": {"tokens": shape.tokens, "blocks": shape.blocks, "samples": shape.samples, "block_rows": shape.block_rows},
        "eval_pack": None if (ev := inputs.eval_shape()) is None else {
            "tokens": ev.tokens, "blocks": ev.blocks, "block_rows": ev.block_rows,
            "what": "the final held-out eval's densest pack (eval.offline_batch_tokens, or the longest sample, every anchor "
                    "scored), traced after the steps without gradients; the peak is the larger of the two"},
        "attention": "compiled flex (model.attention auto or flex, on CUDA): what it allocates and keeps for backward",
        "assumption": "the densest micro-batch both budgets allow (every slot scored); its split into samples does not change the memory",
        "step": "one micro-batch on the device at a time, noise added in place, the forward's output in the compute dtype",
        "compute_dtype": "bf16 autocast" if inputs.bf16 else "fp32 (train.mixed_precision=fp32)",
        "formula_gib": fixed,
        "untraced_gib": {"ddp_buckets": fixed["ddp_buckets_fp32"], "cuda_context_nccl_fragmentation": RESERVE_GB},
        "gpus_gib": GPUS,
    }
    traces = {}
    for checkpointing in (True, False):
        cfg = inputs.model.model_copy(update={"activation_checkpointing": checkpointing})
        traced = inputs.trace(shape, model=cfg)
        traces["with_checkpointing" if checkpointing else "without_checkpointing"] = {**traced, "peak_with_untraced": round(traced["Total"] + untraced, 2)}
    out["traced_peak_gib"] = traces
    configured = traces["with_checkpointing" if inputs.model.activation_checkpointing else "without_checkpointing"]
    out["peak_gib"] = configured["peak_with_untraced"]
    out["fits"] = {name: out["peak_gib"] <= gib for name, gib in GPUS.items()}
    if removed_costs:
        out["removed_costs_gib"] = {
            # The steps alone: where the eval's pack sets the peak, a step's cost would not show in it.
            name: {"would_add": round(inputs.trace(shape, legacy=frozenset({name}), with_eval=False)["step_total"] - configured["step_total"], 2),
                   "what": what}
            for name, what in LEGACY_COSTS.items()
        }
    if search:
        out["largest_budgets"] = {name: largest_fitting(inputs, gib - untraced) for name, gib in GPUS.items()}
    return out


def largest_fitting(inputs: PlanInputs, budget_gib: float) -> dict[str, Any]:
    """The largest budgets whose densest micro-batch's traced peak fits `budget_gib`: micro_batch_blocks
    in steps of SEARCH_BLOCKS (doubling or halving from the config's, then bisection), and
    micro_batch_tokens in the config's ratio to it."""
    sampler = inputs.sampler
    ratio = sampler.micro_batch_tokens / sampler.blocks_budget()
    smallest = max(1, math.ceil(sampler.one_sample_blocks() / SEARCH_BLOCKS))
    peaks: dict[int, float] = {}

    def budgets(units: int) -> tuple[int, int]:
        blocks = units * SEARCH_BLOCKS
        return max(int(blocks * ratio), blocks + 1), blocks

    def fits(units: int) -> bool:
        if units not in peaks:
            peaks[units] = inputs.trace(inputs.shape(*budgets(units)))["Total"]
        return peaks[units] <= budget_gib

    start = max(smallest, sampler.blocks_budget() // SEARCH_BLOCKS)
    if fits(start):  # lo fits, hi does not
        lo, hi = start, start * 2
        while fits(hi) and hi * SEARCH_BLOCKS < 2**20:
            lo, hi = hi, hi * 2
    elif fits(smallest):
        lo, hi = smallest, start
    else:
        return {"micro_batch_tokens": None, "micro_batch_blocks": None, "traced_peak_gib": round(peaks[smallest], 2)}
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    tokens, blocks = budgets(lo)
    return {"micro_batch_tokens": tokens, "micro_batch_blocks": blocks, "traced_peak_gib": round(peaks[lo], 2)}
