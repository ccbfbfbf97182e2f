"""A store's identity: what made it, computed the same way by stage 1 (`status`, `extract`,
`reprocess`) and stage 2 (`train` refuses a store `status` would call stale), neither importing the other.

    header = store_header(cfg, target, plan["extraction"], plan["identity_version"])   # the settings that shape the bytes
    key = header_key(header)        # every shard record carries the key of the settings that made it ...
    rows_sha256(row_hashes)         # ... and a hash of its input rows (the token cache holds each row's hash)

The header holds the target's content (weights, config.json, the tokenizer's vocabulary and behaviour,
the chat template, never its folder: a target that only moved is the same target), the layer ids, top_k, the storage settings, max_length
and on_long, and how the target ran (`extraction_settings`: compute dtype, attention, packing, a
tensor-parallel size above 1; not the batch shape, which each shard's part record holds as
provenance). Settings left `auto` (the compute dtype,
the attention kernel, packing) are resolved once, by the first extraction, and read back from the
store afterwards: a store's identity never depends on the machine a command runs on (a CPU login node
calls a GPU-made store current, and `reprocess` there keeps the GPU's settings or refuses).

Stage-1 settings are keys of stage 1's sections, which stage 2 keeps as given (it never imports stage
1); `STAGE1_DEFAULTS` holds the defaults that apply when a key is not set (tests/test_identity.py checks
they are stage 1's own), and `stage1_value(cfg, "extract.top_k")` reads a value as stage 1 would.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shared.config import RunConfig, dotted_differences
from shared.conversation_files import input_exists
from shared.errors import ConfigError, InputFileError
from shared.paths import RunPaths, relative_note
from shared.store import SCHEMA_VERSION
from shared.target import TargetInfo
from shared.target_model import pick_attn_implementation, resolve_device, resolve_dtype

log = logging.getLogger(__name__)

# 2: the target by content (no path), auto settings read back from the store; 3: the batch shape out
# of the identity (`BATCH_SETTINGS`, recorded per shard instead); 4: the target's config.json and the
# tokenizer's behaviour in (`target.config_sha256`, `tokenizer_probe_sha256`); 5: a regenerated
# row's held-out split key is its prompt (`prompt_hashes` in the part records), not its tokens, which
# differ between copies given different answers; 6: every row's split key is its opening (its turns
# through the first user turn, `opening_hashes`), so rows that share a first question never straddle the
# split (online eval decodes from it); 7: an opening is generic (its rows keyed on their prompt or
# tokens) past a fixed number of rows, not past a share of the store, so rows appended to a store never
# move others across the split (`shared/reader.py` generic_threshold). A store keeps the version it was
# made at, and its keys: a version-2 header carries the batch shape it pinned, a store made before 4 is
# not judged by fields it never recorded, one made before 5 (6) keeps its split on tokens (prompts) when
# resumed or re-extracted, and one made before 7 its generic openings by share.
IDENTITY_VERSION = 7
PROMPT_KEYS_VERSION = 5
OPENING_KEYS_VERSION = 6
BATCH_SETTINGS = ("batch_tokens", "max_samples_per_batch", "window_shards", "lm_head_chunk_tokens")

# Stage 1's defaults for every setting a store's identity reads (tests/test_identity.py: equal to the
# defaults of stage 1's own sections).
STAGE1_DEFAULTS: dict[str, Any] = {
    "data.path": None,
    "data.format": "auto",
    "data.regenerate": True,
    "data.max_samples": None,
    "data.on_bad_row": "raise",
    "data.max_length": 3072,
    "data.on_long": "truncate",
    "data.chat_template_kwargs": {},
    "data.num_default_prompts": 384,
    "data.default_question_share": 0.25,
    "data.token_cache": True,
    "extract.top_k": 64,
    "extract.batch_tokens": 8192,
    "extract.max_samples_per_batch": 64,
    "extract.window_shards": 4,
    "extract.lm_head_chunk_tokens": 2048,
    "extract.device": "auto",
    "extract.packed": "auto",
    "extract.tensor_parallel_size": 1,
    "generate.backend": "auto",
    "generate.temperature": 0.7,
    "generate.top_p": 0.8,
    "generate.max_new_tokens": 512,
    "generate.rows_per_part": 128,
    "generate.seed": 0,
}


def stage1_value(cfg: RunConfig, key: str) -> Any:
    """A stage-1 setting as stage 1 resolves it: its validated value, the value given, or its default."""
    return cfg.value(key, STAGE1_DEFAULTS[key])


# ---------------------------------------------------------------------------------------------
# The header


def extraction_settings(cfg: RunConfig, pinned: dict[str, Any] | None = None) -> dict[str, Any]:
    """How the target runs. `auto` settings resolve from the device of this machine for a new store,
    and are read back from the store's `pinned` settings for an existing one: the same store has the
    same identity on a GPU node and on a CPU login node.

    The batch shape (`BATCH_SETTINGS`) is not part of it: another batch changes a stored value in its
    last bits at most (each shard's part record says which it was made with), and an extraction that ran out of
    memory must continue with a smaller batch. A store made before that (identity version 2) keeps
    the batch shape it pinned in its header, so its keys stay what they were."""
    pinned = pinned or {}
    target = cfg.target
    device = resolve_device(stage1_value(cfg, "extract.device"))
    dtype = target.dtype
    if dtype == "auto":
        dtype = pinned.get("compute_dtype") or resolve_dtype("auto", device)
    attn = target.attn_implementation
    if attn == "auto":
        attn = pinned.get("attn_implementation") or pick_attn_implementation("auto", device, dtype)
    packed = stage1_value(cfg, "extract.packed")
    if packed == "auto":
        packed = pinned["packed"] if "packed" in pinned else attn == "flash_attention_2"
    settings = {"compute_dtype": dtype, "attn_implementation": attn, "packed": packed is True or packed == "on"}
    if all(k in pinned for k in BATCH_SETTINGS):  # a version-2 store: judged by what it recorded
        settings.update({k: pinned[k] for k in BATCH_SETTINGS})
    # A tensor-parallel forward sums each row-parallel matmul across its group in another order: the
    # bytes differ in their last bits, as with another batch shape, so the TP size is not identity
    # either (each part record says which made its shard). Were it, `train` with the config file alone
    # (the size given on extract's command line) would call a TP store stale and send its user to
    # re-extract a 70B target on one GPU. A store pinned while it was identity keeps it.
    if "tensor_parallel_size" in pinned:
        settings["tensor_parallel_size"] = pinned["tensor_parallel_size"]
    return settings


AUTO_SETTINGS = {"compute_dtype": "target.dtype", "attn_implementation": "target.attn_implementation", "packed": "extract.packed"}


def storage_settings(store: Any) -> dict[str, Any]:
    return store.identity()  # the codec and what it keeps (shared/store.py StoreConfig.identity)


def store_header(cfg: RunConfig, target: TargetInfo, pinned: dict[str, Any] | None = None,
                 version: int | None = None) -> dict[str, Any]:
    """Everything that determines the stored bytes: the identity section of the manifest (and of
    plan.json). `pinned`, `version`: the extraction settings and identity version the store was made
    with, if it exists."""
    extraction = extraction_settings(cfg, pinned)
    version = 2 if "batch_tokens" in extraction else int(version or IDENTITY_VERSION)
    probe = {"tokenizer_probe_sha256": target.tokenizer_probe_sha256} if version >= 4 else {}
    return {
        "schema_version": SCHEMA_VERSION,
        "identity_version": version,
        **probe,
        "target": target.identity(with_config=version >= 4),
        "tokenizer_sha256": target.tokenizer_sha256,
        "chat_template_sha256": target.chat_template_sha256,
        "layer_ids": list(target.layer_ids),
        "top_k": stage1_value(cfg, "extract.top_k"),
        "storage": storage_settings(cfg.store),
        "max_length": stage1_value(cfg, "data.max_length"),
        "on_long": stage1_value(cfg, "data.on_long"),
        # only when set, so every store made without keeps its key
        **({"chat_template_kwargs": dict(kwargs)} if (kwargs := stage1_value(cfg, "data.chat_template_kwargs")) else {}),
        "extraction": extraction,
    }


# Header fields present only when set (`store_header`): a store made with one and a config without it differ.
OPTIONAL_HEADER_FIELDS = ("chat_template_kwargs",)


def header_key(header: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(header, sort_keys=True).encode()).hexdigest()


def header_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]]:
    """Dotted name -> [old value, new value] of each identity field that differs; `old` may hold more
    (a manifest), and an optional field it alone holds differs (None in `new`)."""
    keys = [*new, *(k for k in OPTIONAL_HEADER_FIELDS if k in old and k not in new)]
    return dotted_differences({k: old.get(k) for k in keys}, {k: new.get(k) for k in keys})


def header_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Dotted names of the identity fields that differ ('target.weights_sha256', 'top_k', ...)."""
    return list(header_changes(old, new))


def rows_sha256(row_hashes: Iterable[str]) -> str:
    """The identity of a shard's input rows (each row's hash, in order)."""
    return hashlib.sha256("".join(row_hashes).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# What extraction reads, and what the generated answers were made from


def prompts_path(cfg: RunConfig) -> Path:
    """The conversations `generate` reads: data.path, or the embedded default prompt set."""
    path = stage1_value(cfg, "data.path")
    if path is not None:
        return Path(path)
    count, share = stage1_value(cfg, "data.num_default_prompts"), stage1_value(cfg, "data.default_question_share")
    return RunPaths.of(cfg).default_prompts(count, share)


def source_path(cfg: RunConfig) -> Path:
    """What extraction reads, whether it exists here or not: the target's regenerated conversations
    (the recipe), or data.path as is."""
    if stage1_value(cfg, "data.regenerate"):
        return RunPaths.of(cfg).generated
    given = stage1_value(cfg, "data.path")
    if given is None:
        raise ConfigError("data.regenerate=false needs data.path: the default prompts have no answers")
    return Path(given)


def extraction_source(cfg: RunConfig) -> Path:
    """`source_path`, refused by name when it does not exist."""
    path = source_path(cfg)
    if input_exists(path):
        return path
    if stage1_value(cfg, "data.regenerate"):
        raise InputFileError(
            f"{path} does not exist: run `python -m stage1_extract generate` first "
            f"(or set data.regenerate=false to extract data.path as it is)"
        )
    raise InputFileError(
        f"data.path={path} does not exist{relative_note('data.path', path)} (data.regenerate=false reads it as it is): "
        f"check the path, or build it first (`make generate CONFIG=...` writes a preset's answers to run_dir/data)"
    )


def generate_settings(cfg: RunConfig, weights_sha256: str, template: dict[str, str], config_sha256: str) -> dict[str, Any]:
    """What makes an answer: the sampling settings, the target (its weights, and its config.json,
    `config_fingerprint`: the same weights under another rope_theta or window are another model, whose
    store is stale and whose answers these are not), the prompt it answered as the tokenizer and chat
    template rendered it (`prompt_template`), generate.seed (never the run's seed, which training
    changes freely) and the part size (rows are keyed per part, so appending or editing rows
    regenerates only the parts they fall in)."""
    return {
        "generate": {k: stage1_value(cfg, f"generate.{k}") for k in ("backend", "temperature", "top_p", "max_new_tokens")},
        "rows_per_part": stage1_value(cfg, "generate.rows_per_part"),
        # the prompts render with them (only when set: answers generated before keep their key)
        **({"chat_template_kwargs": dict(kw)} if (kw := stage1_value(cfg, "data.chat_template_kwargs")) else {}),
        "target": weights_sha256,
        "target_config": config_sha256,
        "template": dict(template),
        "seed": stage1_value(cfg, "generate.seed"),  # "seed": the key answers generated before it existed carry
    }


def prompt_template(hashes: dict[str, str]) -> dict[str, str]:
    """What rendered the prompts the answers were sampled after, from a tokenizer's fingerprints
    (`TargetInfo.tokenizer_hashes`, `tokenizer_fingerprints`): another chat template (an edited one, or
    a Hub revision that changed only it), or a tokenizer that splits text otherwise under the same
    vocabulary (its merges), gives other prompt ids, whose answers these are not."""
    return {k: hashes[k] for k in ("tokenizer_sha256", "chat_template_sha256", "tokenizer_probe_sha256")}


# Settings answers generated before they were recorded lack (dotted: a key inside one): taken as
# today's, with a warning naming them.
UNRECORDED_SETTINGS = {
    "template": "the chat template they answered: they are used as answers to prompts rendered by today's template",
    "template.tokenizer_probe_sha256": "the tokenizer's behaviour: they are used as answers to prompts as today's tokenizer splits them",
    "target_config": "the target's config.json: they are used as answers of the target as its config.json is today",
}


def with_unrecorded_of(made: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """`made` (settings recorded with answers) with `settings`' value of each UNRECORDED_SETTINGS it
    records none of: answers generated before it was recorded are taken as made with today's (a
    warning says so)."""
    out = dict(made)
    for key, what in UNRECORDED_SETTINGS.items():
        outer, _, inner = key.partition(".")
        if outer not in settings:
            continue
        if not inner and outer not in out:
            out[outer] = settings[outer]
        elif inner and isinstance(out.get(outer), dict) and inner not in out[outer]:
            out[outer] = {**out[outer], inner: settings[outer][inner]}
        else:
            continue
        log.warning("the generated answers were made before generate recorded %s (if it changed since, delete "
                    "run_dir/data/generated.parts and run generate again)", what)
    return out


def generate_settings_key(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:24]


def generation_inputs(
    cfg: RunConfig, weights_sha256: str, prompts_sha256: str, template: dict[str, str], config_sha256: str
) -> dict[str, Any]:
    """What the generated conversations must have been made from to belong to this config: the
    prompts by content (a prompts file that only moved is the same input)."""
    data_format = stage1_value(cfg, "data.format")
    return {
        "prompts_sha256": prompts_sha256,
        "max_samples": stage1_value(cfg, "data.max_samples"),
        "on_bad_row": stage1_value(cfg, "data.on_bad_row"),
        # only when set: answers generated before data.format existed were read as `auto` reads them
        **({"format": data_format} if data_format != "auto" else {}),
        "settings": generate_settings(cfg, weights_sha256, template, config_sha256),
    }


def generated_problem(cfg: RunConfig, weights_sha256: str, template: dict[str, str], config_sha256: str) -> str | None:
    """Why the generated conversations do not belong to this config (other prompts, another target,
    other sampling settings), naming both sides and the fix; None when they do (or data.regenerate
    is off). Read from the provenance `generate` writes beside them."""
    from shared.token_cache import source_fingerprint

    if not stage1_value(cfg, "data.regenerate"):
        return None
    paths = RunPaths.of(cfg)
    if not paths.generated.exists():
        return None  # extraction_source names it
    fix = "run `python -m stage1_extract generate` (it regenerates only what differs), then `python -m stage1_extract reprocess`"
    try:
        made = json.loads(paths.generated_provenance.read_text())
    except (OSError, ValueError):
        return f"{paths.generated} does not say what it was made from ({paths.generated_provenance.name} missing or damaged); {fix}"
    prompts = prompts_path(cfg)
    if not input_exists(prompts):
        return (
            f"{paths.generated} answers {made.get('prompts')}, but the config's prompts {prompts} do not exist"
            + (relative_note("data.path", prompts) if stage1_value(cfg, "data.path") is not None else "")
        )
    now = generation_inputs(cfg, weights_sha256, source_fingerprint(prompts), template, config_sha256)
    inputs = made.get("inputs", {})
    if isinstance(inputs.get("settings"), dict):
        inputs = {**inputs, "settings": with_unrecorded_of(inputs["settings"], now["settings"])}
    changed = dotted_differences(inputs, now)
    if not changed:
        return None
    names = {
        "prompts_sha256": f"the prompts' content ({prompts})", "settings.target": "the target's weights",
        "settings.target_config": "the target's config.json",
        "max_samples": "data.max_samples", "on_bad_row": "data.on_bad_row", "format": "data.format", "settings.seed": "generate.seed",
        "settings.template.chat_template_sha256": "the chat template", "settings.template.tokenizer_sha256": "the tokenizer",
        "settings.template.tokenizer_probe_sha256": "the tokenizer's behaviour",
    }
    what = ", ".join(
        f"{names.get(k, k.replace('settings.', ''))} ({_short(v[0])} -> {_short(v[1])})" for k, v in changed.items()
    )
    if set(changed) == {"settings.seed"}:
        # answers generated before generate.seed existed carry the run's seed: setting it back is free
        fix = f"set generate.seed={changed['settings.seed'][0]} to use them as they are, or {fix}"
    return f"{paths.generated} was generated from {made.get('prompts')} with other inputs than the config gives: {what}; {fix}"


def _short(value: Any) -> str:
    text = str(value)
    return text[:12] if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else text
