"""Was the drafter's training data rendered the way the target renders conversations today?

    findings, notes = store_findings(reader, target, drafter_layer_ids, data=None)

A store's manifest records the target's weights, tokenizer and chat-template hashes it was made
with; the target's folder may have changed since (a new revision, an edited tokenizer_config.json).
When the conversations the store was extracted from can be read (the manifest's `data.source`, or
`data` given), a few stored samples' prompts (the tokens before their first supervised token) are
compared with what the target's template renders today for the same messages; when they differ and
the template has a thinking switch (Qwen3's `enable_thinking`), each setting is tried, to say which
one the data used (z-lab #133: a thinking-mode mismatch took acceptance from 60% to 25%).

The rows are read and rendered by the code stage 1 tokenized them with (`shared/conversation_files.py`,
`shared/conversations.py`: any format stage 1 reads, numbered as stage 1 numbers them, since a
`sample_id` is the row's index in its file), in the format the manifest records. A row that is not
the one its sample was extracted from (the file edited or reordered since: its opening is not the one
the store recorded) is left out and named, never blamed on the template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared.conversation_files import input_exists, read_rows
from shared.conversations import render
from shared.shard_records import split_hashes
from shared.token_cache import source_fingerprint
from stage2_train.serve.export_view import Finding, TargetSide

THINKING_SWITCH = "enable_thinking"
REEXTRACT = "`python -m stage1_extract reprocess` re-extracts it with the target's current tokenizer and template, then retrain"


def store_findings(
    reader: Any,
    target: TargetSide,
    layer_ids: list[int] | None,
    *,
    data: str | None = None,
    max_samples: int = 8,
) -> tuple[list[Finding], list[str]]:
    """Findings about a store (its target, layers, tokenizer and template) against `target`, and notes."""
    manifest = reader.manifest
    out, notes = [], []
    made_from = (manifest.get("target") or {}).get("weights_sha256")
    if made_from and made_from != target.weights_sha256:
        out.append(
            Finding(
                "error",
                "manifest target.weights_sha256",
                f"the store was extracted from target weights {made_from[:12]}, this target's are {target.weights_sha256[:12]}",
                f"use the target the store was made from, or re-extract: {REEXTRACT}",
            )
        )
    stored = list(manifest.get("layer_ids") or [])
    if layer_ids is not None and stored and stored != list(layer_ids):
        out.append(
            Finding(
                "warning",
                "manifest layer_ids",
                f"the store holds layers {stored}, the drafter reads {list(layer_ids)}: "
                f"it was not trained on this store, or its layer ids were changed",
                "check which layers the drafter was trained on",
            )
        )
    if manifest.get("tokenizer_sha256") not in (None, target.tokenizer_sha256):
        out.append(
            Finding(
                "error",
                "manifest tokenizer_sha256",
                f"the data was tokenized with another vocabulary ({manifest['tokenizer_sha256'][:12]}) "
                f"than the target's tokenizer has now ({target.tokenizer_sha256[:12]})",
                f"serve with the tokenizer the data used, or {REEXTRACT}",
            )
        )
    template_changed = manifest.get("chat_template_sha256") not in (None, target.chat_template_sha256)
    rendered = compare_renders(reader, target, data, max_samples)
    if rendered["status"] != "compared":
        notes.append(rendered["why"])
    if template_changed:
        agree = rendered["status"] == "compared" and not rendered["differ"]
        out.append(
            Finding(
                "warning" if agree else "error",
                "manifest chat_template_sha256",
                f"the data was rendered with another chat template ({manifest['chat_template_sha256'][:12]}) than the target "
                f"has now ({target.chat_template_sha256[:12]})"
                + (
                    f"; the {rendered['num_samples']} samples compared still render the same" if agree else ""
                ),
                f"serve with the template the data used (vLLM / SGLang --chat-template FILE), or {REEXTRACT}",
            )
        )
    if rendered["status"] == "compared":
        out += rendered["differ"]
        if rendered.get("other_rows"):
            notes.append(rendered["other_rows"])
        if rendered.get("mode"):
            notes.append(rendered["mode"])
        if not rendered["differ"]:
            notes.append(
                f"chat template: {rendered['num_samples']} stored prompts equal today's rendering of their messages"
            )
    return out, notes


def compare_renders(reader: Any, target: TargetSide, data: str | None, max_samples: int) -> dict[str, Any]:
    """The stored prompts of up to `max_samples` samples against today's render of their messages."""
    recorded = reader.manifest.get("data") or {}
    source = data or recorded.get("source")
    if not source or not input_exists(Path(source)):
        return {
            "status": "skipped",
            "why": f"chat template: the data the store was made from ({source or 'not recorded'}) is not "
            f"readable here, so only the template hashes were compared (--data PATH gives it)",
        }
    tokenizer = target.tokenizer
    # the template's variables stage 1 rendered with (`data.chat_template_kwargs`), as serving passes them
    variables = reader.manifest.get("chat_template_kwargs")
    indices = list(range(min(len(reader), max_samples)))
    data_format = "auto" if data else recorded.get("format", "auto")
    rows = read_rows(Path(source), {int(reader.sample_ids[i]) for i in indices}, data_format)
    other = other_rows(reader, rows, indices, Path(source))
    differ: list[Finding] = []
    modes: set[str] = set()
    compared = 0
    for index in indices:
        sample_id = int(reader.sample_ids[index])
        conv = rows.get(sample_id)
        if index in other:
            continue
        sample = reader[index]
        mask = sample["loss_mask_T"].bool()
        if conv is None or not mask.any() or "assistant" not in [m["role"] for m in conv.messages]:
            continue
        messages, tools = conv.messages, conv.tools
        first = int(mask.nonzero()[0])
        stored = tokenizer.decode(sample["input_ids_T"][:first].tolist(), skip_special_tokens=False)
        turn = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        answer = messages[turn]["content"]
        today = render(tokenizer, messages[:turn], add_generation_prompt=True, tools=tools, template_kwargs=variables)
        compared += 1
        thinking = (
            {v: render(tokenizer, messages[:turn], add_generation_prompt=True, tools=tools,
                    template_kwargs=variables, **{THINKING_SWITCH: v})
             for v in (False, True)}
            if has_switch(tokenizer)
            else {}
        )
        matching = [v for v, text in thinking.items() if same_prompt(stored, text, answer)]
        if matching and len(set(thinking.values())) > 1:
            modes.add(f"{THINKING_SWITCH}={matching[0]}")
        if same_prompt(stored, today, answer) or differ:
            continue  # one finding says it: the samples share their template
        where = f"sample {index} (input row {sample_id})"
        if matching:
            differ.append(
                Finding(
                    "error",
                    f"chat template ({THINKING_SWITCH})",
                    f"{where}: the stored prompt is what today's template renders with {THINKING_SWITCH}={matching[0]} "
                    f"(ends {stored[-40:]!r}), but its default renders {today[-40:]!r}: the drafter was trained in the other "
                    f"thinking mode than the default serves",
                    f'serve with chat_template_kwargs={{"{THINKING_SWITCH}": {str(matching[0]).lower()}}} (vLLM / SGLang request '
                    f"field), or render the data in the mode you serve and {REEXTRACT}",
                )
            )
        else:
            at = next(
                (i for i, (a, b) in enumerate(zip(stored, today, strict=False)) if a != b),
                min(len(stored), len(today)),
            )
            differ.append(
                Finding(
                    "error",
                    "chat template",
                    f"{where}: the stored prompt and today's rendering of its messages differ at character {at}: stored "
                    f"{stored[max(0, at - 20) : at + 30]!r}, today {today[max(0, at - 20) : at + 30]!r}",
                    f"serve with the template the data was rendered with (--chat-template FILE), or {REEXTRACT}",
                )
            )
    if other and not compared:
        return {"status": "skipped", "why": other_rows_note(source, other, reader)}
    if not compared:
        return {
            "status": "skipped",
            "why": f"chat template: no stored sample could be matched to a row of {source}",
        }
    mode = None
    if modes:
        mode = (
            f"thinking mode: the stored prompts render as {', '.join(sorted(modes))}; serve in the same mode "
            f"(chat_template_kwargs) or acceptance falls"
        )
    out = {"status": "compared", "num_samples": compared, "differ": differ, "mode": mode}
    return {**out, "other_rows": other_rows_note(source, other, reader)} if other else out


def other_rows(reader: Any, rows: dict[int, Any], indices: list[int], source: Path) -> list[int]:
    """The samples among `indices` whose row of `source` is not the row they were extracted from (the
    file edited, reordered or replaced since): rendered, another row's messages would be blamed on the
    chat template. Each row's opening is compared with the one the store recorded; a store that
    predates those is judged by the whole file's sha256."""
    chosen = split_hashes(reader.manifest["shards"])
    if chosen is not None and chosen[0] == "opening_hashes":
        stored = chosen[1]  # each a prefix of the row's opening hash (stage 1's writer keeps 16 characters)
        return [i for i in indices if (conv := rows.get(int(reader.sample_ids[i]))) is not None
                and (opening := conv.opening_hash()) and not opening.startswith(stored[i])]
    recorded = (reader.manifest.get("data") or {}).get("source_sha256")
    return list(indices) if recorded and source_fingerprint(source) != recorded else []


def other_rows_note(source: str, other: list[int], reader: Any) -> str:
    ids = ", ".join(str(int(reader.sample_ids[i])) for i in other[:4]) + (f" and {len(other) - 4} more" if len(other) > 4 else "")
    return (
        f"chat template: {len(other)} stored sample(s) not compared, their rows of {source} (rows {ids}) being other "
        f"rows than they were extracted from ({source} changed since extraction); pass --data with the file as it "
        f"was extracted, or run `python -m stage1_extract reprocess` to extract the file as it is now"
    )


def has_switch(tokenizer: Any) -> bool:
    return THINKING_SWITCH in str(getattr(tokenizer, "chat_template", None) or "")


def same_prompt(stored: str, rendered: str, answer: str) -> bool:
    """Equal, or equal up to a token that straddles the prompt's end and the answer's start (stage 1
    cuts the prompt at the first supervised token)."""
    return stored == rendered or (stored.startswith(rendered) and answer.startswith(stored[len(rendered) :]))
