"""What a store's manifest records about the target, so that a changed target is seen whatever its
path: the weights' sha256 (cached per folder by size, mtime, inode and ctime), config.json's without
the keys that only say who wrote it, the tokenizer's vocabulary, chat template and behaviour, and the
config fields that transform the logits."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from shared.embedded import cache_dir
from shared.errors import InputFileError
from shared.files import file_sha256, write_atomic
from shared.hub import fetch_rest
from shared.lock import waiting_flock


def weights_fingerprint(model_dir: str | os.PathLike, *, deep: bool = False) -> str:
    """sha256 over the sorted weight files' own hashes (safetensors / bin): the target's identity is
    its content, never its path. Cached in the pipeline's cache folder (never in the target's folder,
    which may be shared or read-only), keyed by each file's size, mtime, inode and ctime: a user can
    restore a file's size and mtime after editing it (`touch -d`), but not its ctime, which the
    kernel sets on every write. `deep` rehashes every file whatever the cache says
    (`stage1_extract status --deep`)."""
    model_dir = Path(model_dir)
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin"))
    if not files:
        raise InputFileError(f"no weight files (*.safetensors, *.bin) in {model_dir}; " + fetch_rest(model_dir, "the model's weights"))
    key = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:16]
    cache_path = cache_dir() / "fingerprints" / f"{key}.json"
    stats = [(p, p.stat()) for p in files]
    stamp = [[p.name, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns] for p, st in stats]
    if not deep and (cached := _cached_fingerprint(cache_path, stamp)):
        return cached
    # The ranks of a node starting together wait for the first to hash (8 reads of a 16 GB target
    # otherwise) and then read its cache; where the cache cannot be locked, each hashes on its own.
    with waiting_flock(cache_path.with_suffix(".lock")):
        if not deep and (cached := _cached_fingerprint(cache_path, stamp)):
            return cached
        digest = hashlib.sha256()
        for p in files:
            digest.update(p.name.encode() + b"\0" + file_sha256(p).encode())
        value = digest.hexdigest()
        try:
            write_atomic(cache_path, json.dumps({"folder": str(model_dir.resolve()), "stamp": stamp, "sha256": value}))
        except OSError:
            pass  # a read-only cache: hash again next time
    return value


def _cached_fingerprint(cache_path: Path, stamp: list) -> str | None:
    try:
        cached = json.loads(cache_path.read_text())
        return cached["sha256"] if cached.get("stamp") == stamp else None
    except (OSError, ValueError, KeyError):
        return None


# Keys of config.json that say who wrote it or how to load it, not what the target computes: a
# re-save by another transformers version must not make every store of the target stale.
CONFIG_PROVENANCE_KEYS = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache",
                          "_attn_implementation_autoset", "output_attentions", "output_hidden_states", "return_dict")

# Text the tokenizer's behaviour is fingerprinted on: words after spaces (BPE merges such as " the"),
# runs of whitespace, digits, punctuation, code, accents and several scripts.
TOKENIZER_PROBE = (
    "The quick brown fox jumps over the lazy dog; the THE tHe. Don't stop-- it's 3.14159, 1,000,000 and 2026-12-02!\n"
    "  two  spaces\tand a tab\r\n\n\ndef f(x):\n    return x ** 2  # squared\n{\"key\": [1, 2.5e-3, null]}\n"
    "naïve café Straße Ελληνικά русский 中文 日本語 한국어 العربية हिन्दी 🙂👍 ~`@#$%^&*()_+=<>?/|\\"
)


# Config fields by which transformers' forward transforms the LM head's output into the logits it
# returns (Gemma 2/3 cap them with tanh, Granite divides, Cohere multiplies): stage 1 applies them
# before the top-k, and a target that has one records it in its identity, so a store extracted
# before they were applied is stale (a target without one keeps the identity it had).
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logits_scaling", "logit_scale")


def logit_transform(target_dir: Path) -> dict[str, Any]:
    """The target's LOGIT_TRANSFORMS fields that are set (its text config's, for a multimodal one)."""
    config = json.loads((Path(target_dir) / "config.json").read_text())
    out = {}
    for section in (config, config.get("text_config") or {}):
        out.update({k: section[k] for k in LOGIT_TRANSFORMS if section.get(k) is not None})
    return out


def config_fingerprint(target_dir: Path) -> str:
    """sha256 of the target's config.json without CONFIG_PROVENANCE_KEYS: a config-only update of
    a model repository (rope_theta, an attention window, a norm epsilon) changes what the same weights
    compute."""
    config = json.loads((Path(target_dir) / "config.json").read_text())
    kept = {k: v for k, v in config.items() if k not in CONFIG_PROVENANCE_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def tokenizer_fingerprints(tokenizer: Any) -> dict[str, str]:
    """Hashes of the vocabulary, of the chat template and of the tokenizer's behaviour (its ids for
    TOKENIZER_PROBE and its special tokens): merges, normalizer and pre-tokenizer can change with the
    vocabulary unchanged, and only the ids show it, whatever version serialises the tokenizer."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    template = getattr(tokenizer, "chat_template", None) or ""
    probe = TOKENIZER_PROBE + " ".join(sorted(map(str, tokenizer.all_special_tokens)))
    ids = [tokenizer(probe, add_special_tokens=False)["input_ids"], tokenizer("Hi", add_special_tokens=True)["input_ids"]]
    return {
        "tokenizer_sha256": hashlib.sha256(vocab.encode()).hexdigest(),
        "chat_template_sha256": hashlib.sha256(str(template).encode()).hexdigest(),
        "tokenizer_probe_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
    }
