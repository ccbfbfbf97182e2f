"""One row of a format `shared/conversations.py` describes -> its messages in the one form (that
module's docstring): the readers of each format.

    messages, tools, cut, dropped = parse_row(record, fmt, limits)      # ValueError naming the key

prompt/completion rows come as strings (one user turn and its answer) or as TRL's conversational
format, `{"prompt": [messages], "completion": [messages]}` (lists of OpenAI-style messages, as
TRL's SFTTrainer and many Hub datasets hold them): read as one conversation, the prompt's messages
then the completion's. TRL trains on the completion only, so the prompt's assistant turns are
context (`weight: 0`: not supervised, not regenerated) unless they say `weight: 1`; the
completion's assistant turns are supervised as in every format.
"""

from __future__ import annotations

import json
from typing import Any

from shared.conversations import RowLimits

SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
    "system": "system", "tool": "tool", "observation": "tool", "function_response": "tool",
}
OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool",
                "function": "tool"}
TOOL_CALL = "function_call"  # the ShareGPT turn in which the assistant calls a tool


def parse_row(
    record: Any, fmt: str, limits: RowLimits | None = None
) -> tuple[list[dict[str, Any]], str | None, bool, int]:
    """One raw row of format `fmt` -> (messages in the one form, tools as JSON text or None, whether
    `limits` cut any text or ids, how many turns before the first user turn were dropped). Text and
    ids are cut before anything else reads them. Raises ValueError saying what is wrong (the reader
    adds the file and row)."""
    if isinstance(record, Exception):
        raise record
    if not isinstance(record, dict):
        raise ValueError(f"row must be an object, got {type(record).__name__}")
    cutter = _Cutter(limits)
    system = record.get("system")
    if system is not None and not isinstance(system, str):
        raise ValueError("'system' must be a string")
    messages = [{"role": "system", "content": cutter.text(system)}] if system and system.strip() else []
    if fmt == "openai":
        messages += _openai(record["messages"], cutter)
    elif fmt == "sharegpt":
        messages += _sharegpt(record["conversations"], cutter)
    else:
        messages += _prompt_completion(record["prompt"], record.get("completion"), cutter)
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        raise ValueError("empty conversation (no non-empty user turn)")
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    kept = [m for i, m in enumerate(messages) if i >= first_user or m["role"] == "system"]
    return kept, _tools(record.get("tools")), cutter.cut, len(messages) - len(kept)


class _Cutter:
    def __init__(self, limits: RowLimits | None):
        self.limits, self.cut = limits, False

    def text(self, text: str) -> str:
        if self.limits is not None and len(text) > self.limits.max_chars:
            self.cut = True
            return text[: self.limits.max_chars]
        return text

    def ids(self, ids: list[Any]) -> list[Any]:
        if self.limits is not None and len(ids) > self.limits.max_ids:
            self.cut = True
            return ids[: self.limits.max_ids]
        return ids


def _prompt_completion(prompt: Any, completion: Any, cutter: _Cutter) -> list[dict[str, Any]]:
    """A prompt and its completion: two strings (a user turn and its answer), or TRL's two lists of
    messages (module docstring)."""
    if isinstance(prompt, str) and (completion is None or isinstance(completion, str)):
        texts = [prompt] + ([completion] if completion is not None else [])
        return [{"role": role, "content": cutter.text(t)} for role, t in zip(("user", "assistant"), texts)]
    if isinstance(prompt, list) and (completion is None or isinstance(completion, list)):
        context = [{**m, "weight": 0} if isinstance(m, dict) and m.get("role") == "assistant" and m.get("weight") is None else m
                   for m in prompt]
        return _openai(context, cutter, "prompt") + _openai(completion or [], cutter, "completion")
    kinds = f"'prompt' is {_kind(prompt)} and 'completion' {_kind(completion)}"
    raise ValueError(f"{kinds}: give both as strings (a question and its answer), or both as lists of "
                     f"{{role, content}} messages (TRL's conversational prompt/completion)")


def _kind(value: Any) -> str:
    kinds = {str: "a string", list: "a list of messages", type(None): "absent", dict: "an object", bool: "true/false"}
    return kinds.get(type(value), "a number" if isinstance(value, (int, float)) else f"a {type(value).__name__}")


def _openai(messages: Any, cutter: _Cutter, key: str = "messages") -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise ValueError(f"'{key}' must be a list")
    out = []
    for j, msg in enumerate(messages):
        where = f"{key}[{j}]"
        calls = (msg.get("tool_calls") or ([msg["function_call"]] if msg.get("function_call") else None)) if isinstance(
            msg, dict
        ) else None
        if not isinstance(msg, dict) or "role" not in msg or ("content" not in msg and not calls):
            raise ValueError(f"{where} must have 'role' and 'content'")
        role = OPENAI_ROLES.get(msg["role"]) if isinstance(msg["role"], str) else None
        if role is None:
            raise ValueError(f"{where} has unknown role {msg['role']!r} (known: {', '.join(OPENAI_ROLES)})")
        content = msg.get("content")
        if content is None and role == "assistant" and calls:
            content = ""  # a turn that only calls tools
        message = {"role": role, "content": cutter.text(_text(content, f"{where}.content")), **_name(msg, where)}
        ids = msg.get("token_ids")
        if ids is not None:  # the target's own tokens of a regenerated answer (`generate` writes them)
            ids = cutter.ids(ids) if isinstance(ids, list) else ids
            if role != "assistant" or not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ValueError(f"{where}.token_ids must be a list of token ids on an assistant turn")
            message["token_ids"] = ids
        cut = msg.get("answer_cut")
        if cut is not None:  # whether generate.max_new_tokens cut that answer: it decides its loss mask
            if not isinstance(cut, bool) or ids is None:
                raise ValueError(f"{where}.answer_cut must be true or false, beside token_ids")
            message["answer_cut"] = cut
        stop = msg.get("stop_id")
        if stop is not None:  # the stop token the target ended that answer with: stored in place of the template's
            if not isinstance(stop, int) or isinstance(stop, bool) or stop < 0 or ids is None or cut is True:
                raise ValueError(f"{where}.stop_id must be a token id, beside token_ids of an answer not cut")
            message["stop_id"] = stop
        if calls:
            if role != "assistant":
                raise ValueError(f"{where} has tool_calls but role {msg['role']!r}: only an assistant turn calls tools")
            message["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{k}]", cutter) for k, c in enumerate(calls)]
        if role == "tool":
            message.update(_tool_result_id(msg, where))
        out.append(_assistant_fields(message, msg, where, cutter))
    return out


def _sharegpt(turns: Any, cutter: _Cutter) -> list[dict[str, Any]]:
    if not isinstance(turns, list):
        raise ValueError("'conversations' must be a list")
    out: list[dict[str, Any]] = []
    for j, turn in enumerate(turns):
        where = f"conversations[{j}]"
        # Null is absent: a Parquet table with both spellings has both columns, one null per turn.
        speakers = {k: turn[k] for k in ("from", "role") if turn.get(k) is not None} if isinstance(turn, dict) else {}
        if not speakers or not ("value" in turn or "content" in turn):
            raise ValueError(f"{where} must have 'from' and 'value'")
        if len(speakers) == 2 and _speaker(speakers["from"]) != _speaker(speakers["role"]):
            raise ValueError(f"{where} holds both 'from' ({speakers['from']!r}) and 'role' ({speakers['role']!r}): only one "
                             f"would be read; keep the one that names the speaker")
        speaker = next(iter(speakers.values()))
        texts = {k: turn[k] for k in ("value", "content") if turn.get(k) not in (None, "")}
        if len(texts) == 2 and not _same_text(texts["value"], texts["content"]):
            raise ValueError(f"{where} holds both 'value' and 'content', with different text: only one would be read "
                             f"and the other dropped; keep the one that is the turn's text")
        key = next(iter(texts), "value" if "value" in turn else "content")
        text = turn[key]
        if speaker == TOOL_CALL:
            try:
                calls = json.loads(text) if isinstance(text, str) else text
            except ValueError:
                raise ValueError(f"{where}: a function_call turn's value must be JSON {{name, arguments}}") from None
            calls = calls if isinstance(calls, list) else [calls]
            message = {"role": "assistant", "content": "",
                       "tool_calls": [_tool_call(c, f"{where}.value[{k}]", cutter) for k, c in enumerate(calls)],
                       **_name(turn, where)}
            out.append(_assistant_fields(message, turn, where, cutter))
            continue
        role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            known = ", ".join([*SHAREGPT_ROLES, TOOL_CALL])
            raise ValueError(f"{where} has unknown speaker 'from': {speaker!r} (known: {known})")
        message = {"role": role, "content": cutter.text(_text(text, f"{where}.{key}")), **_name(turn, where)}
        if role == "tool":
            message.update(_tool_result_id(turn, where))
        out.append(_assistant_fields(message, turn, where, cutter))
    return out


def _speaker(name: Any) -> Any:
    """A ShareGPT speaker as the role it stands for (`human` and `user` are one speaker)."""
    return SHAREGPT_ROLES.get(name, OPENAI_ROLES.get(name, name)) if isinstance(name, str) else name


def _same_text(a: Any, b: Any) -> bool:
    """Whether `value` and `content` hold one text (a string, or the same text as a list of text parts)."""
    if a == b:
        return True
    try:
        return _text(a, "") == _text(b, "")
    except ValueError:
        return False


def _assistant_fields(message: dict[str, Any], turn: dict[str, Any], where: str, cutter: _Cutter) -> dict[str, Any]:
    """`message` with the turn's `reasoning_content` and axolotl's `weight` (0: context only), which
    only an assistant turn carries: anywhere else they would be dropped unread, so they are refused."""
    reasoning, weight = turn.get("reasoning_content"), turn.get("weight")
    if weight is not None and weight not in (0, 1):
        raise ValueError(f"{where}.weight must be 0 (not supervised) or 1, got {weight!r}")
    if message["role"] != "assistant":
        if reasoning or weight == 1:
            key = "reasoning_content" if reasoning else "weight=1"
            raise ValueError(f"{where} has {key} but role {message['role']!r}: only assistant turns think and are supervised")
        return message
    if reasoning is not None and not isinstance(reasoning, str):
        raise ValueError(f"{where}.reasoning_content must be a string")
    if reasoning:
        message["reasoning_content"] = cutter.text(reasoning)
    if weight == 0:
        message["weight"] = 0
    return message


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or a list of text parts joined with newlines (as vLLM joins them)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        kinds = sorted({str(p.get("type")) for p in content} - {"text"})
        if kinds or not all(isinstance(p.get("text"), str) for p in content):
            raise ValueError(f"{where} has parts of type {kinds or ['text without text']}: only text is read")
        return "\n".join(p["text"] for p in content)
    raise ValueError(f"{where} must be a string")


def _tool_call(call: Any, where: str, cutter: _Cutter) -> dict[str, Any]:
    """One call in the one form: {"name", "arguments" (JSON text), "id"?}, from OpenAI's
    {"id", "type", "function": {"name", "arguments"}} or a flat {"name", "arguments"}."""
    if not isinstance(call, dict):
        raise ValueError(f"{where} must be an object with a name and arguments")
    function = call.get("function") if isinstance(call.get("function"), dict) else call
    name, arguments = function.get("name"), function.get("arguments", function.get("parameters"))
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where} must name the function it calls")
    if arguments is None:
        arguments = "{}"
    elif not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    out = {"name": name, "arguments": cutter.text(arguments)}
    if call.get("id") is not None:
        out["id"] = str(call["id"])
    return out


def _tool_result_id(msg: dict[str, Any], where: str) -> dict[str, str]:
    value = msg.get("tool_call_id")
    if value is None:
        return {}
    if not isinstance(value, (str, int)) or isinstance(value, bool):  # an int as the call's own `id` is read: str()
        raise ValueError(f"{where}.tool_call_id must be a string (the id of the call it answers)")
    return {"tool_call_id": str(value)}


def _name(msg: dict[str, Any], where: str) -> dict[str, str]:
    """The turn's `name` (OpenAI's participant name; a tool result's function), on any role: a server
    passes it to the chat template, so it is kept for the template to render or not."""
    name = msg.get("name")
    if name is None or name == "":
        return {}
    if not isinstance(name, str):
        raise ValueError(f"{where}.name must be a string (the participant's name), got a {type(name).__name__}")
    return {"name": name}


def _tools(tools: Any) -> str | None:
    """A row's tool definitions (a list, or its JSON text as LLaMA-Factory writes it) as JSON text."""
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise ValueError("'tools' must be a list of tool definitions (or its JSON text)") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError("'tools' must be a list of tool definitions (or its JSON text)")
    return json.dumps(tools, ensure_ascii=False)
