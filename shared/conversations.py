"""Conversations as people have them, parsed into the one form both stages read (stage 1 to template
and tokenize them, the export doctor to render a stored sample's prompt again), and rendered by the
target's chat template.

    fmt = detect_format(record)                          # "sharegpt" | "openai" | "prompt_completion" | None
    messages, tools, cut, dropped = parse_row(record, fmt, limits)     # shared/row_formats.py: each format's reader
    text = render(tokenizer, messages, tools=tools, add_generation_prompt=True)

The formats (`data.format`; `auto` reads each file's format from its columns or its first row):
- **ShareGPT**: `{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}], "system"?, "tools"?}`.
  `from` is human/user, gpt/assistant, system, tool/observation/function_response (a tool's result) or
  function_call (the assistant calls a tool: `value` is JSON `{"name", "arguments"}` or a list of them);
  each turn's text is `value` or `content` (a turn holding both with different text is refused: one
  would be dropped), and `role` may stand for `from`.
- **OpenAI chat**: `{"messages": [{"role", "content"}, ...], "system"?, "tools"?}` with roles system (or
  developer), user, assistant and tool (or the older function); an assistant turn may carry `tool_calls`
  (`[{"id", "type": "function", "function": {"name", "arguments"}}]`, content then may be null) and a
  tool turn `tool_call_id`; content may be a list of text parts (joined with newlines, as vLLM does).
- **prompt/completion**: `{"prompt": "...", "completion"?: "...", "system"?}`, one user turn and its answer;
  or TRL's conversational form, `{"prompt": [messages], "completion"?: [messages]}` (OpenAI-style
  messages): the prompt's messages then the completion's, the prompt's assistant turns context
  (`weight: 0` unless they say otherwise: TRL trains on the completion), the completion's supervised.

In every format a row's `system` text opens the conversation as a system turn, any turn may carry
`name` (OpenAI's participant name, a string), and an assistant turn may carry `reasoning_content`
(its thinking, as Qwen3 and vLLM's reasoning parsers write it) and axolotl's `weight` (0: the turn
is context, not supervised and not regenerated; 1: the default). A row holding both `messages` and
`conversations` is refused under data.format=auto: they may be different chats, and reading one
would drop the other.

One form: `{"role", "content"}` per message, plus `token_ids` on an answer the target regenerated
and beside them `answer_cut` (true: `generate.max_new_tokens` cut the answer, the target had not
ended it; false: the target ended it; absent in files written before it was recorded: read as
ended, and counted as `answers_cut_unknown`), and `stop_id` (the stop token the target ended it with,
when it did), `tool_calls` (`[{"name", "arguments" (JSON text),
"id"?}]`) on an assistant turn that calls tools, `reasoning_content` and `weight: 0` on an assistant
turn, `tool_call_id` on a tool's result, `name` on any turn. Keys appear only when they hold something
(`weight: 1` is left out), so a row's hash (`Conversation.row_hash`) is the same for the same
conversation in any format.

A conversation starts at its first user turn: the assistant (and tool) turns before it, as in a
ShareGPT chunk cut from a longer chat, answer nothing in the row, so regenerating one would answer an
empty prompt and supervising it would teach text conditioned on nothing. They are dropped (system
turns stay) and counted (`ReadStats.leading_turns_dropped`: generate's summary, the manifest's data).

Tool calls are the assistant's own tokens, so they are supervised like its text; tool results are
not. A chat template that knows tool calls (it mentions `tool_calls`: Qwen3, Llama 3.1) gets them as
structured fields, the way a server renders them; a template that does not (SmolLM2) would drop them,
so they are written into the assistant's text in the Hermes form Qwen uses
(`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`). A row's `tools` (the functions it
offers) go to a template that takes `tools`, and are not rendered by one that does not. Reasoning
likewise: a template that reads `reasoning_content` (Qwen3) gets the field, one that does not gets it
written before the answer as `<think>\\n...\\n</think>\\n\\n`, the form Qwen3 and DeepSeek-R1 emit.
A turn's `name` goes to the template as a field, as vLLM and apply_chat_template pass it when serving;
a template that reads no message's name (SmolLM2, Qwen3, Llama 3.1) does not render it, warned once.

A template that prints today's date (`strftime_now`: Llama 3.1's "Today Date: ...") renders
TEMPLATE_DATE at every stage instead, so the same rows give the same tokens on any day.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
FORMATS = ("sharegpt", "openai", "prompt_completion")
FORMAT_NAMES = {
    "sharegpt": "ShareGPT (conversations: [{from, value}])",
    "openai": "OpenAI chat (messages: [{role, content}])",
    "prompt_completion": "prompt/completion (prompt, completion)",
}
FORMAT_KEYS = {"openai": "messages", "sharegpt": "conversations", "prompt_completion": "prompt"}  # in detection order


@dataclass
class Conversation:
    row: int  # index of the row in its file (stable id of the sample)
    messages: list[dict[str, Any]]  # the one form (module docstring)
    source: str = ""
    tools: str | None = None  # the row's tool definitions, as JSON text
    cut: bool = False  # a message's text or ids were cut to RowLimits when read
    # A conversation `generate` wrote (its Parquet columns): the 0-based row of the user's data it was
    # made from, and the hash of that row's prompt, which the held-out split keeps copies together by.
    source_row: int | None = None
    prompt_hash: str | None = None

    def row_hash(self) -> str:
        """Identity of the input row: re-extraction is needed exactly when this changes."""
        value: Any = self.messages if self.tools is None else {"messages": self.messages, "tools": self.tools}
        text = json.dumps(value, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def opening_hash(self) -> str:
        """The row's opening: its turns up to and including its first user turn, and its tools, which is
        what online evaluation decodes from for most rows. The held-out split keys a row on it
        (`shared/shard_records.split_hashes`): rows that open alike (copies of a prompt, conversations
        that share a first question and part later) fall on one side, so a held-out prompt's answer was
        never trained on from another row. "" for a row without a user turn (its tokens key it)."""
        first_user = next((i for i, m in enumerate(self.messages) if m.get("role") == "user"), None)
        if first_user is None:
            return ""
        return Conversation(row=self.row, messages=self.messages[: first_user + 1], tools=self.tools).row_hash()


@dataclass(frozen=True)
class RowLimits:
    """What one row may bring to tokenizing (`stage1_extract.prepare.row_limits`): each message's text
    is cut to `max_chars` characters and a token_ids list to `max_ids` ids, bounds that still give
    more tokens than data.max_length keeps (so truncation and data.on_long decide as on the whole
    row), while one 200 MB row costs its parse, not gigabytes of tokenizer offsets."""

    max_chars: int
    max_ids: int


@dataclass
class ReadStats:
    rows: int = 0
    bad_rows: int = 0
    bad_examples: list[str] = field(default_factory=list)
    leading_turns_dropped: int = 0  # assistant / tool turns before a row's first user turn (module docstring)
    answers_cut: int = 0  # regenerated answers cut at generate.max_new_tokens (`answer_cut`)
    answers_cut_unknown: int = 0  # regenerated answers from files that do not record `answer_cut` (read as ended)
    # Set when tokenizing (stage1_extract/template.py): assistant turns kept as unsupervised context
    # (the template renders them otherwise once a user turn follows), answers whose ids could not be placed.
    context_turns: int = 0
    ids_fallbacks: int = 0


def answer_cuts(messages: list[dict[str, Any]]) -> tuple[int, int]:
    """(regenerated answers cut, those from files that do not record it) among a row's messages."""
    return (sum(m.get("answer_cut") is True for m in messages),
            sum("token_ids" in m and "answer_cut" not in m for m in messages))


# ---------------------------------------------------------------------------------------------
# Which format a row or a file is in


def detect_format(record: Any) -> str | None:
    """The format whose key the row holds (messages, conversations, prompt: in that order), or None."""
    if not isinstance(record, dict):
        return None
    return next((fmt for fmt, key in FORMAT_KEYS.items() if record.get(key) is not None), None)


def detect_columns(columns: list[str]) -> str | None:
    """The format a table's columns (Parquet, Arrow) hold, or None."""
    return next((fmt for fmt, key in FORMAT_KEYS.items() if key in columns), None)


def fits(record: Any, fmt: str) -> bool:
    return isinstance(record, dict) and record.get(FORMAT_KEYS[fmt]) is not None


def found(record: Any) -> str:
    """What a row that fits no format holds, for the refusal."""
    if isinstance(record, dict):
        return f"keys {sorted(record)}" + (
            f" ({', '.join(k for k in FORMAT_KEYS.values() if k in record and record[k] is None)} null)"
            if any(k in record and record[k] is None for k in FORMAT_KEYS.values())
            else ""
        )
    return f"a JSON {type(record).__name__}" if not isinstance(record, Exception) else str(record)


def both_formats(record: Any) -> ValueError | None:
    """The refusal of a row holding both `messages` and `conversations` (data.format=auto): they may be
    different chats, and detection would read `messages` and drop the other."""
    if isinstance(record, dict) and record.get("messages") is not None and record.get("conversations") is not None:
        return ValueError(
            "holds both 'messages' (OpenAI chat) and 'conversations' (ShareGPT), and only one is read: remove one, or "
            "set data.format=openai (reads messages) or data.format=sharegpt (reads conversations)"
        )
    return None


def mismatch(fmt: str | None, record: Any, why: str) -> ValueError:
    if fmt is None:
        names = list(FORMAT_NAMES.values())
        known = ", ".join(names[:-1]) + " or " + names[-1]
        from shared.json_shapes import rows_fix  # here: that module reads this one

        nested = rows_fix(record, None) if isinstance(record, dict) else ""
        return ValueError(f"fits no known format (expected {known}), found {found(record)}; {nested or 'data.format names one'}")
    return ValueError(f"expected {FORMAT_NAMES[fmt]} {why}, found {found(record)}")


# ---------------------------------------------------------------------------------------------
# Rendering by the target's chat template


def template_text(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "chat_template", None) or "")


def template_messages(
    messages: list[dict[str, Any]], structured_tools: bool, structured_reasoning: bool
) -> list[dict[str, Any]]:
    """What apply_chat_template receives: role, content and `name`, and tool calls and reasoning as
    structured fields (a template that knows them) or as text in the assistant's content (one that does
    not)."""
    out = []
    for m in messages:
        message: dict[str, Any] = {"role": m["role"], "content": m["content"]}
        if "name" in m:  # on every template, as a server passes it: the template decides whether it shows
            message["name"] = m["name"]
        reasoning = m.get("reasoning_content")
        if reasoning is not None and structured_reasoning:
            message["reasoning_content"] = reasoning
        elif reasoning is not None:
            message["content"] = f"<think>\n{reasoning}\n</think>\n\n{m['content']}"
        calls = m.get("tool_calls")
        if calls and structured_tools:
            message["tool_calls"] = [
                {**({"id": c["id"]} if "id" in c else {}), "type": "function",
                 "function": {"name": c["name"], "arguments": _arguments_value(c["arguments"])}}
                for c in calls
            ]
        elif calls:
            text = "\n".join(f'<tool_call>\n{{"name": {json.dumps(c["name"], ensure_ascii=False)}, "arguments": '
                             f'{c["arguments"]}}}\n</tool_call>' for c in calls)
            message["content"] = f"{message['content']}\n{text}" if message["content"] else text
        if m["role"] == "tool" and structured_tools and "tool_call_id" in m:
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _arguments_value(arguments: str) -> Any:
    """The arguments as templates expect them (an object, which they print with tojson); text that is
    not a JSON object stays text."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


_WARNED: set[tuple[str, str]] = set()  # (what, template): each warning once per template
# A message's name as a template reads it: `message.name`, `message['name']`, `message.get('name')`, for the
# variable its loop binds (or `messages[i]`). Not any "name": templates print tool names and "named SmolLM".
_MESSAGE_LOOP = re.compile(r"\bfor\s+(\w+)\s+in\s+\w*messages\b")


@functools.lru_cache(maxsize=16)  # asked per named row: once per template
def reads_message_name(template: str) -> bool:
    """Whether the chat template reads a message's `name` (which it may then render)."""
    bound = sorted({"message", *_MESSAGE_LOOP.findall(template)})
    owner = rf"(?:\b(?:{'|'.join(bound)})|\bmessages\s*\[[^\]]*\])"
    field = r"(?:\.name\b|\[\s*['\"]name['\"]\s*\]|\.get\(\s*['\"]name['\"])"
    return re.search(owner + r"\s*" + field, template) is not None


# Rendered with the day's date, the same rows tokenized otherwise every day: a store read as "tokens
# changed" (every shard stale) the day after extraction once its token cache was rebuilt, and
# reprocess mixed dates. Llama 3.1's own fallback date, so its template renders as without strftime_now.
TEMPLATE_DATE = datetime.datetime(2024, 7, 26)


def pin_template_date(tokenizer: Any) -> None:
    """Make the target's chat template(s) see TEMPLATE_DATE through `strftime_now` (a transformers
    global the render's keyword arguments cannot replace: they reach the template as plain data)."""
    templates = getattr(tokenizer, "chat_template", None) or ""
    for template in templates.values() if isinstance(templates, dict) else [templates]:
        if "strftime_now" not in str(template):
            continue
        from transformers.utils.chat_template_utils import _compile_jinja_template  # the render's own, cached

        compiled = _compile_jinja_template(template)
        if compiled.globals.get("strftime_now") != TEMPLATE_DATE.strftime:
            compiled.globals["strftime_now"] = TEMPLATE_DATE.strftime  # this template's globals only


def render(
    tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool, tools: str | None = None,
    template_kwargs: dict[str, Any] | None = None, **kwargs: Any,
) -> str:
    """The conversation as the target's chat template renders it (text, not tokens), with the
    template's own variables `template_kwargs` (`data.chat_template_kwargs`: Qwen3's enable_thinking),
    as a server's `chat_template_kwargs` passes them; `kwargs` given here win over them."""
    kwargs = {**(template_kwargs or {}), **kwargs}
    template = template_text(tokenizer)
    if tools is not None:
        if "tools" in template:
            kwargs["tools"] = json.loads(tools)
        elif ("tools", template) not in _WARNED:
            _WARNED.add(("tools", template))
            log.warning("the target's chat template takes no tool list: the rows' `tools` are not rendered")
    if ("name", template) not in _WARNED and any("name" in m for m in messages) and not reads_message_name(template):
        _WARNED.add(("name", template))
        log.warning("the target's chat template reads no message's `name`: the rows' turn names are passed to it, as a "
                    "server passes them, and not rendered")
    pin_template_date(tokenizer)  # each time: the compiled template may have left transformers' cache
    return tokenizer.apply_chat_template(
        template_messages(messages, "tool_calls" in template, "reasoning_content" in template), tokenize=False,
        add_generation_prompt=add_generation_prompt, **kwargs,
    )


ANSWER_MARK = "\x00\x01dflash-answer\x01\x00"  # stands for an answer's text while locating it in a render


def mark_answer(
    tokenizer: Any, history: list[dict[str, Any]], message: dict[str, Any], tools: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, bool, str]:
    """`history` + `message` as the last turn, rendered with a mark for the message's text and split
    there: (the render before its text, whether the template wrote the text at all, what the template
    writes after it: the turn's closing, an end-of-turn marker)."""
    text = render(tokenizer, [*history, {**message, "content": ANSWER_MARK}], add_generation_prompt=False, tools=tools,
                  template_kwargs=template_kwargs)
    before, found, after = text.partition(ANSWER_MARK)
    return before, bool(found), after
