"""Chat templates and loss masks.

The tokenizer's own chat template renders the conversation. The loss mask marks the tokens of
assistant turns (their content and the end-of-turn marker the template closes them with), found
by rendering each prefix: the text added between `messages[:i]` + generation prompt and
`messages[:i+1]` is what assistant turn i wrote. This works for any template without
`{% generation %}` markers, and fails loudly if a template is not prefix-stable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class TokenizedSample:
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # bool [T]
    truncated: bool


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_char_spans(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the [start, end) character span of every assistant turn in it."""
    full = _render(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (upto.startswith(prefix) and full.startswith(upto)):
            raise ValueError(
                f"chat template is not prefix-stable at assistant turn {i}: rendering the conversation "
                f"up to that turn does not extend the prompt render (use single-turn data or a template "
                f"with {{% generation %}} markers)"
            )
        spans.append((len(prefix), len(upto)))
    return full, spans


def tokenize_conversation(tokenizer: Any, messages: list[dict[str, str]], max_length: int) -> TokenizedSample:
    text, spans = assistant_char_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(ids), dtype=bool)
    for start, end in spans:
        # A token is supervised when it starts inside the assistant's text.
        mask |= (offsets[:, 0] >= start) & (offsets[:, 0] < end) & (offsets[:, 1] > offsets[:, 0])
    truncated = len(ids) > max_length
    return TokenizedSample(input_ids=ids[:max_length], loss_mask=mask[:max_length], truncated=truncated)


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation rendered up to a new assistant turn (for generation)."""
    text = _render(tokenizer, messages, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
