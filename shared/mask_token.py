"""Whether a mask token id is reserved: the drafter fills its blocks with it, so it must be a token no
text and no chat template produces (else the drafter cannot tell its mask slots from real text).

    why = not_reserved(tokenizer, target_dir, 128002)   # None: reserved; else what the token is
    check_mask_token(cfg.target, target)                # a configured one: ConfigError naming a reserved one

Stage 1 and `train` refuse a `target.mask_token_id` that is not reserved before anything runs (a
preset's id inherited onto another target family lands on one of its ordinary tokens); the export
doctor judges an exported drafter's by the same rule.
"""

from __future__ import annotations

import os
from typing import Any

from shared.errors import ConfigError
from shared.target import TargetConfig, TargetInfo, cached_tokenizer, default_mask_token_id, stop_token_ids


def not_reserved(tokenizer: Any, folder: str | os.PathLike | None, token_id: int) -> str | None:
    """Why `token_id` is a token that text or the chat template produces (None when reserved: an
    embedding row beyond the tokenizer, or a special token nothing emits)."""
    if token_id >= len(tokenizer):
        return None  # an embedding row no text maps to (Qwen3's 151669)
    token = tokenizer.convert_ids_to_tokens(token_id)
    roles = {"eos": tokenizer.eos_token_id, "bos": tokenizer.bos_token_id, "pad": tokenizer.pad_token_id,
             "unk": tokenizer.unk_token_id}
    for role, value in roles.items():
        if value == token_id:
            return f"the tokenizer's {role} token {token!r}"
    if token_id in stop_token_ids(tokenizer, model_dir=folder):
        return f"a stop token ({token!r}) of the target's generation config"
    added = tokenizer.added_tokens_decoder.get(token_id)
    if added is None:
        return f"{token!r}, an ordinary token that text tokenizes to"
    if token_id in template_token_ids(tokenizer):
        return f"{token!r}, which the chat template writes into every conversation"
    if not added.special:
        return f"{token!r}, an added token that text tokenizes to (not special)"
    return None


def template_token_ids(tokenizer: Any) -> set[int]:
    for messages in (
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
        [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
    ):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        except Exception:  # noqa: BLE001 - templates raise what they like (e.g. no system role)
            continue
        return set(tokenizer(text, add_special_tokens=False)["input_ids"])
    return set()


def check_mask_token(cfg: TargetConfig, target: TargetInfo) -> None:
    """Refuse a configured `target.mask_token_id` that is not reserved, naming one that is: the
    target's automatic choice, else its first unused special token, else the first embedding row
    beyond the tokenizer. The automatic choices are reserved by construction."""
    if cfg.mask_token_id is None:
        return
    tokenizer, mask_id, folder = cached_tokenizer(str(target.target_dir))[0], target.mask_token_id, target.target_dir
    why = not_reserved(tokenizer, folder, mask_id)
    if why is None:
        return
    try:
        spare: int | None = default_mask_token_id(cfg.model_copy(update={"mask_token_id": None}), target.arch, tokenizer)
    except ConfigError:
        spare = spare_mask_token(tokenizer, folder, target.arch.vocab_size)
    choice = (f"target.mask_token_id={spare} ({tokenizer.convert_ids_to_tokens(spare) or 'an embedding row no text maps to'})"
              if spare is not None else "target.mask_token_id to an unused special token id of this target")
    raise ConfigError(
        f"target.mask_token_id={mask_id} is {why}: the drafter could not tell its mask slots from real text (and the "
        f"export doctor refuses such a drafter); a preset's id belongs to its own target. Set {choice}"
    )


def spare_mask_token(tokenizer: Any, folder: str | os.PathLike | None, vocab_size: int) -> int | None:
    """A reserved id to offer: the first special token nothing emits, else the first embedding row
    beyond the tokenizer; None when the target has neither."""
    special = sorted(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    spare = next((i for i in special[:64] if not_reserved(tokenizer, folder, i) is None), None)
    return len(tokenizer) if spare is None and vocab_size > len(tokenizer) else spare
