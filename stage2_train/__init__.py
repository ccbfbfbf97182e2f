"""Stage 2: train, evaluate and export the drafter from the feature store (`python -m stage2_train`).

Importing the stage makes its config sections known to the shared loader (the rooms' torch-free
`config` modules, and observe's); stage 1's sections in the same file are kept as given and
validated by stage 1's entry point.
"""

from shared.config import RunConfig, register_rules, register_sections
from stage2_train.data.config import SamplerConfig
from stage2_train.model.config import DrafterConfig, LossConfig
from stage2_train.observe.config import DetectorConfig, LogConfig
from stage2_train.train.config import CheckpointConfig, EvalConfig, NoiseConfig, OptimConfig, TrainConfig

register_sections(
    SamplerConfig, NoiseConfig, DrafterConfig, LossConfig, OptimConfig, TrainConfig, CheckpointConfig, EvalConfig,
    LogConfig, DetectorConfig,
)


def _gamma_for_block_size(cfg: RunConfig) -> list[str]:
    """The recipe's gamma depends on the block size: a rule across the loss and model sections."""
    return cfg.loss.gamma_warnings(cfg.model.block_size)


def _global_batch(cfg: RunConfig) -> list[str]:
    """What one optimizer step holds: the knob a user sets is per rank per micro-batch, the recipe
    speaks of the global batch."""
    tokens, accum, blocks = cfg.sampler.micro_batch_tokens, cfg.train.grad_accum, cfg.sampler.blocks_budget()
    derived = " (sampler.micro_batch_blocks null: micro_batch_tokens // 2)" if cfg.sampler.micro_batch_blocks is None else ""
    return [
        f"global batch: ranks x {accum} micro-batches x at most {tokens} tokens and {blocks} blocks{derived} = up to "
        f"{tokens * accum} tokens per rank per optimizer step ({8 * tokens * accum} on 8 ranks); the run_start event gives "
        f"the figure for the ranks it runs on, `python -m stage2_train plan` the GPU memory of the densest micro-batch"
    ]


def _confidence_slots(cfg: RunConfig) -> list[str]:
    """DSpark's confidence target needs the drafter's full softmax: slots scored over candidates
    (loss.full_vocab_slots) train no confidence, so a stop rule past them is untrained."""
    if cfg.model.variant != "dspark" or not cfg.model.confidence_head or cfg.loss.full_vocab_slots is None:
        return []
    return [
        f"DSpark's confidence head trains on the first {cfg.loss.full_vocab_slots} slot(s) only: the others are scored "
        f"over candidates (loss.full_vocab_slots), where no acceptance target exists; set loss.full_vocab_slots=null "
        f"before relying on eval.confidence_stop"
    ]


def _inert_settings(cfg: RunConfig) -> list[str]:
    """Settings given a value other than their default that nothing reads under the rest of the config:
    said at `check` and at the start of training, so a sweep over one of them is not a sweep over nothing."""
    from stage2_train.model.config import VARIANT_FIELDS, VARIANT_LOSS_FIELDS

    def changed(section: str, names: tuple[str, ...] | list[str]) -> list[str]:
        value = getattr(cfg, section)
        return [f"{section}.{n}={getattr(value, n)}" for n in names if getattr(value, n) != type(value).model_fields[n].default]

    model, out = cfg.model, []
    sliding = model.layer_types is not None and "sliding_attention" in model.layer_types
    if not sliding:
        out += [f"{s} does nothing: no layer of model.layer_types is sliding_attention" for s in changed("model", ["sliding_window"])]
    if model.feature_projection == "none":
        out += [f"{s} does nothing: model.feature_projection=none"
                for s in changed("model", ["projection_dim", "projection_scale", "projection_fit_tokens"])]
    if cfg.noise.std == 0:
        # std 0 adds no noise at any step: a warmup of it is the failed run's no-op warmup.
        out += [f"{s} does nothing: noise.std=0" for s in changed("noise", ["warmup_steps", "kind"])]
    if cfg.eval.every_steps == 0 and not cfg.checkpoint.keep_best:
        # Only evals during training (and keep_best's final comparison) sample anchors; the final eval scores every one.
        out += [f"{s} does nothing: eval.every_steps=0 (the final eval scores every anchor)"
                for s in changed("eval", ["offline_max_anchors_per_seq"])]
    for variant in ("dspark", "dflash2"):
        if model.variant != variant:
            out += [f"{s} does nothing: it is a {variant} setting and model.variant={model.variant}"
                    for s in [*changed("model", VARIANT_FIELDS[variant]), *changed("loss", VARIANT_LOSS_FIELDS[variant])]]
    if cfg.optim.name != "muon":
        muon = [n for n in type(cfg.optim).model_fields if n.startswith("muon_")]
        out += [f"{s} does nothing: optim.name={cfg.optim.name}" for s in changed("optim", muon)]
    if model.variant == "dspark" and not model.confidence_head:
        # Without the head DSpark trains no BCE term (eval.confidence_stop: `_confidence_stop_scope`).
        out += [f"{s} does nothing: model.confidence_head=false" for s in changed("loss", ["confidence_weight"])]
    if model.init_from:
        # The trainer starts from model.init_from's weights and never reads model.init then.
        out += [f"{s} does nothing: model.init_from gives the starting weights" for s in changed("model", ["init"])]
    if cfg.loss.weighting != "dpace":
        out += [f"{s} does nothing: loss.weighting={cfg.loss.weighting}" for s in changed("loss", ["dpace_alpha"])]
    return out


def _confidence_stop_scope(cfg: RunConfig) -> list[str]:
    """eval.confidence_stop stops the drafter `eval` loads, as its own description says (a checkpoint,
    an export), whatever this config's model section: with a drafter that cannot stop early here it is
    not inert, and calling it so sent a DSpark checkpoint's eval to drop it."""
    stop, model = cfg.eval.confidence_stop, cfg.model
    if stop is None or (model.variant == "dspark" and model.confidence_head):
        return []
    why = f"model.variant={model.variant}" if model.variant != "dspark" else "model.confidence_head=false"
    return [f"eval.confidence_stop={stop} stops no block of this run's drafter ({why}: it drafts whole blocks); `python -m stage2_train eval` "
            f"applies it to a DSpark drafter with a confidence head that it loads (--checkpoint of a DSpark run, or a "
            f"DSpark export)"]


def _warnings(cfg: RunConfig) -> list[str]:
    return _gamma_for_block_size(cfg) + _inert_settings(cfg)


def _notes(cfg: RunConfig) -> list[str]:
    return _global_batch(cfg) + _confidence_slots(cfg) + _confidence_stop_scope(cfg)


register_rules(warnings=_warnings, notes=_notes)
