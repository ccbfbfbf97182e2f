"""What a drafter is, written beside its weights: everything needed to rebuild it.

    description = describe(cfg.model, target)          # a new drafter for this config and target
    description.to_dict()                               # -> checkpoint drafter.json, export config.json
    DrafterDescription.from_dict(json.load(...))        # -> build_drafter(description, parts, weights=...)

A checkpoint and an export carry their drafter's description (variant, architecture, block size,
attention layout, target layer ids, mask token, feature projection, and the target it was trained
against), so `eval`, `export`, `model.init_from`, a resume and the benchmarks rebuild the drafter
that was trained, never the one today's command line describes: a value given on the command line
that contradicts it is refused by name (`contradictions`). No torch here.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from shared.errors import CheckpointError
from shared.target import TargetArch, TargetInfo
from stage2_train.model.config import VARIANT_FIELDS, VARIANTS, DrafterConfig

DESCRIPTION_VERSION = 1
# What each variant adds to the DFlash description (its own modules' sizes); None for the others.


@dataclass(frozen=True)
class DrafterDescription:
    variant: str
    block_size: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    is_causal: bool | None
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    mask_token_id: int
    feature_projection: str = "none"
    projection_dim: int | None = None
    target_model_type: str = "unknown"
    target_weights_sha256: str | None = None  # None for a published drafter that does not say
    # dspark
    markov_rank: int | None = None
    markov_head: str | None = None
    confidence_head: bool | None = None
    # dflash2
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    version: int = DESCRIPTION_VERSION

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise CheckpointError(f"drafter variant {self.variant!r} is not one this pipeline builds ({', '.join(VARIANTS)})")
        for variant, names in VARIANT_FIELDS.items():
            for name in names:
                given = getattr(self, name) is not None
                if given != (variant == self.variant):
                    raise CheckpointError(
                        f"a {self.variant} drafter's description {'gives' if given else 'lacks'} {name} "
                        f"(a field of {variant} drafters)"
                    )
        # A hand-edited or foreign config.json: a string, a float or a 0 here would build a drafter that drafts
        # nothing (block_size 1), reads a negative layer index (the target's last layer), or crash in arithmetic.
        for name, least in (("block_size", 2), ("num_layers", 1), ("hidden_size", 1), ("intermediate_size", 1), ("head_dim", 1),
                            ("num_attention_heads", 1), ("num_key_value_heads", 1), ("vocab_size", 1), ("num_target_layers", 1),
                            ("mask_token_id", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise CheckpointError(f"the drafter's {name} is {value!r}: it must be an integer >= {least}")
        ids = self.target_layer_ids
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise CheckpointError(f"the drafter's target_layer_ids {list(ids)!r} must be target layer indices (integers >= 0)")
        if self.variant == "dflash2" and self.hidden_size % self.conv_group_size:
            raise CheckpointError(
                f"the drafter's conv_group_size {self.conv_group_size} does not divide its hidden size {self.hidden_size} "
                f"(model.conv_group_size)"
            )
        if self.variant == "dflash2" and self.selector_top_k > self.vocab_size:
            raise CheckpointError(f"the drafter's selector_top_k {self.selector_top_k} exceeds its vocabulary {self.vocab_size}")
        if len(self.layer_types) != self.num_layers:
            raise CheckpointError(f"the drafter lists {len(self.layer_types)} layer types for {self.num_layers} layers")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise CheckpointError(f"the drafter's mask_token_id {self.mask_token_id} is outside its vocabulary [0, {self.vocab_size})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"the drafter's num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads "
                f"{self.num_key_value_heads}"
            )

    @property
    def label_shift(self) -> int:
        """0: slot k predicts the token at anchor + k; 1 (dspark): anchor + k + 1."""
        return 1 if self.variant == "dspark" else 0

    @property
    def max_draft(self) -> int:
        """Tokens drafted per step: B - 1 (the anchor's slot is known), B for DSpark (every slot drafts)."""
        return self.block_size - 1 + self.label_shift

    # ---- serialisation ----
    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["layer_types"], out["target_layer_ids"] = list(self.layer_types), list(self.target_layer_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "drafter description") -> DrafterDescription:
        if not isinstance(data, dict):
            raise CheckpointError(f"{where}: expected an object, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise CheckpointError(f"{where}: unknown fields {unknown} (written by a newer version?)")
        version = data.get("version", DESCRIPTION_VERSION)
        if version > DESCRIPTION_VERSION:
            raise CheckpointError(f"{where}: version {version}, this code reads up to {DESCRIPTION_VERSION}")
        missing = sorted(f.name for f in fields(cls) if f.name not in data and f.default is MISSING)
        if missing:
            raise CheckpointError(f"{where}: missing fields {missing}")
        values = dict(data)
        values["layer_types"] = tuple(values["layer_types"])
        values["target_layer_ids"] = tuple(values["target_layer_ids"])
        return cls(**values)

    # ---- what the modules are built from ----
    def arch(self) -> TargetArch:
        """The dimensions the drafter's modules take (those of its target, for DFlash)."""
        return TargetArch(
            model_type=self.target_model_type,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_target_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=False,
        )

    def model_config(self, runtime: DrafterConfig | None = None) -> DrafterConfig:
        """The architecture of this description with `runtime`'s options for running it (attention
        backend and chunking, activation checkpointing, init scale), which the description leaves open."""
        runtime = runtime or DrafterConfig()
        sliding = "sliding_attention" in self.layer_types
        variant = {name: getattr(self, name) for name in VARIANT_FIELDS[self.variant]}
        return runtime.model_copy(
            update={
                **variant,
                "variant": self.variant,
                "num_layers": self.num_layers,
                "block_size": self.block_size,
                "intermediate_size": self.intermediate_size,
                "layer_types": self.layer_types if sliding else None,
                "sliding_window": self.sliding_window if sliding else None,
                "is_causal": self.is_causal,
                "feature_projection": self.feature_projection,
                "projection_dim": self.projection_dim,
            }
        )

    # ---- checks ----
    def contradictions(self, cfg: DrafterConfig, given: set[str] | frozenset[str]) -> list[str]:
        """Settings in `given` (dotted `model.*` keys set on the command line) whose value differs from
        this description, as 'model.key: the drafter has X, the command line gives Y'."""
        ours = describe_model(cfg, self.hidden_size, self.intermediate_size_default(cfg))
        ours.update({name: getattr(cfg, name) for name in VARIANT_FIELDS[self.variant]})  # this drafter's own heads
        # A window or a projection size given alone is compared as given: describe_model reads it only beside
        # the command line's own layer_types / feature_projection (unset there: None, which the drafter's 6 is not).
        if "sliding_attention" in self.layer_types:
            ours["sliding_window"] = cfg.sliding_window
        shown = dict(ours)  # what the line names: the value as given (null, not the width it stands for)
        if self.feature_projection == "pca":
            ours["projection_dim"], shown["projection_dim"] = cfg.projection_dim or self.hidden_size, cfg.projection_dim
        out = []
        for key, value in ours.items():
            if key == "is_causal" and self._same_attention(value):
                continue  # is_causal unset and false are one rule for full layers
            if f"model.{key}" in given and value != getattr(self, key):
                out.append(f"model.{key}: the drafter has {_plain(getattr(self, key))}, the command line gives {_plain(shown[key])}")
        # A value this drafter never reads is no contradiction to compare, but the user meant it to change something.
        unread = {"sliding_window": "no layer is sliding_attention" if "sliding_attention" not in self.layer_types else None,
                  "projection_dim": "its feature_projection is none" if self.feature_projection != "pca" else None,
                  **{n: f"it is a {v} setting, the drafter is {self.variant}" for v, names in VARIANT_FIELDS.items()
                     if v != self.variant for n in names}}
        named = {line.split(":")[0] for line in out}
        for key, why in unread.items():
            # A default never set is no one's intent (the config file's whole section is passed as given).
            meant = getattr(cfg, key) != type(cfg).model_fields[key].default
            if why and meant and f"model.{key}" in given and f"model.{key}" not in named:
                out.append(f"model.{key}: the drafter does not read it ({why}), the command line gives {_plain(getattr(cfg, key))}")
        return out

    def _same_attention(self, is_causal: bool | None) -> bool:
        """Whether `is_causal` gives each of this drafter's layers the rule it has (`attention.layer_kinds`:
        a sliding layer is causal in the block unless is_causal says, a full one bidirectional unless true)."""
        def causal(rule: bool | None) -> list[bool]:
            return [t == "sliding_attention" if rule is None else bool(rule) for t in self.layer_types]

        return causal(is_causal) == causal(self.is_causal)

    def intermediate_size_default(self, cfg: DrafterConfig) -> int:
        return cfg.intermediate_size if cfg.intermediate_size is not None else self.intermediate_size

    def check_target(self, target: TargetInfo, where: str, *, allow_other_target: bool = False) -> None:
        """Refuse a target this drafter cannot run with, naming the field: its width, its vocabulary,
        layers it does not have, and (unless `allow_other_target`) other weights than it was trained
        against: another model or revision of the same shape (Qwen3-8B-Base for Qwen3-8B) gives other
        features, and an export would name the wrong target."""
        checks = [
            ("hidden_size", self.hidden_size, target.arch.hidden_size),
            ("vocab_size", self.vocab_size, target.arch.vocab_size),
        ]
        for name, ours, theirs in checks:
            if ours != theirs:
                raise CheckpointError(f"{where}: the drafter was made for a target with {name}={ours}, this target has {theirs}")
        if max(self.target_layer_ids) >= target.arch.num_hidden_layers:
            raise CheckpointError(f"{where}: target_layer_ids {list(self.target_layer_ids)} exceed the target's layers")
        trained, given = self.target_weights_sha256, target.weights_sha256
        if trained and given and trained != given and not allow_other_target:
            raise CheckpointError(
                f"{where}: the drafter was trained against target weights {trained[:12]}, target.path={target.path!r} has "
                f"{given[:12]} (another model or revision); set target.path to the target it was trained on, or "
                f"model.allow_other_target=true to use it with this one"
            )


def describe_model(cfg: DrafterConfig, hidden_size: int, intermediate_size: int) -> dict[str, Any]:
    """The architecture fields a model config gives (what `contradictions` compares)."""
    return {
        "variant": cfg.variant,
        **{name: getattr(cfg, name) for name in VARIANT_FIELDS[cfg.variant]},
        "num_layers": cfg.num_layers,
        "block_size": cfg.block_size,
        "intermediate_size": intermediate_size,
        "layer_types": tuple(cfg.layer_types or ("full_attention",) * cfg.num_layers),
        "sliding_window": cfg.sliding_window if cfg.layer_types and "sliding_attention" in cfg.layer_types else None,
        "is_causal": cfg.is_causal,
        "feature_projection": cfg.feature_projection,
        "projection_dim": (cfg.projection_dim or hidden_size) if cfg.feature_projection == "pca" else None,
    }


def describe(cfg: DrafterConfig, target: TargetInfo) -> DrafterDescription:
    """The description of a new drafter for this model config and target."""
    return describe_parts(cfg, target.arch, target.layer_ids, target.mask_token_id, target.weights_sha256 or None)


def describe_parts(
    cfg: DrafterConfig, arch: TargetArch, layer_ids: list[int] | tuple[int, ...], mask_token_id: int,
    target_weights_sha256: str | None = None,
) -> DrafterDescription:
    """The description from its pieces: a model config, the target's dimensions, layer ids and mask."""
    return DrafterDescription(
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        rms_norm_eps=arch.rms_norm_eps,
        rope_theta=arch.rope_theta,
        max_position_embeddings=arch.max_position_embeddings,
        vocab_size=arch.vocab_size,
        target_layer_ids=tuple(layer_ids),
        num_target_layers=arch.num_hidden_layers,
        mask_token_id=mask_token_id,
        target_model_type=arch.model_type,
        target_weights_sha256=target_weights_sha256,
        **describe_model(cfg, arch.hidden_size, cfg.intermediate_size or arch.intermediate_size),
    )


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
