"""The data section, and the conversations stage 1 writes (the default prompts, the regenerated answers).

Reading conversations (ShareGPT, OpenAI chat, prompt/completion; JSONL, JSON arrays, Parquet, Arrow,
`datasets` folders) is `shared/conversation_files.py`, which the export doctor reads them with too.
Every row becomes a `Conversation` (row index in its file, messages in one form). A malformed row,
an unknown role, a row in another format than its file's or an empty conversation raises a
DataError naming the file and row, or is skipped and counted with `data.on_bad_row=skip`. Rows are
never silently dropped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Literal

from shared.config import Section
from shared.conversations import Conversation
from shared.files import atomic_path

# What stage 1 gives apply_chat_template itself: not a template variable a config may set.
TEMPLATE_ARGUMENTS = {"messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
                      "tokenize", "chat_template", "return_dict", "return_assistant_tokens_mask"}


class DataConfig(Section):
    section: ClassVar[str] = "data"
    path: str | None = None
    """Conversations to regenerate and extract. None = the embedded default prompt set, built under run_dir. A .jsonl file, a .json array, a .parquet or .arrow file, a folder of .parquet or .arrow files (of one split: a folder of several is refused naming each), a glob of files in one folder (`<dataset>/data/train_sft-*.parquet`: one split of a Hub dataset), or a dataset saved by `datasets` (save_to_disk)."""
    format: Literal["auto", "sharegpt", "openai", "prompt_completion"] = "auto"
    """The rows' format: auto = each file's own, from its columns or first row; sharegpt (conversations: [{from, value}]), openai (messages: [{role, content}], tool_calls), prompt_completion (prompt, completion: strings, or TRL's lists of messages)."""
    regenerate: bool = True
    """True: extract the target's regenerated answers (run `generate` first), as the recipe does. False: extract data.path as it is (its answers must already come from the target)."""
    max_samples: int | None = None
    """Use only the first N usable rows (a quick run); null = all."""
    on_bad_row: Literal["raise", "skip"] = "raise"
    """A malformed row (bad JSON or UTF-8, unknown role, nothing to supervise): stop naming it, or skip and count it."""
    max_length: int = 3072
    """Tokens per sample, after the chat template; longer samples are truncated or skipped (counted)."""
    on_long: Literal["truncate", "skip"] = "truncate"
    """A row longer than max_length: cut it, or leave it out (both counted in the manifest)."""
    chat_template_kwargs: dict[str, bool | int | float | str] = {}
    """Variables the target's chat template reads, passed to every render as a server's `chat_template_kwargs` passes them: `{enable_thinking: false}` trains a drafter for Qwen3's no-think mode (answers generated and stored as the template renders them then). Serve the drafter with the same ones: a thinking-mode mismatch has cut acceptance from 60% to 25% (z-lab #133). A key the template never reads (a misspelt name) is refused."""
    num_default_prompts: int = 384
    """Size of the embedded default prompt set."""
    default_question_share: float = 0.25
    """Share of the default prompts that are short questions (the rest ask about a documentation
    excerpt, whose prefill costs generation time but is not supervised)."""
    tokenize_workers: int = 0
    """Processes that template and tokenize the rows on the first command (0 = min(16, CPUs)); the result is cached under run_dir/cache/ for every later command and rank."""
    token_cache: bool = True
    """Cache the tokenized rows (memory-mapped by later commands and ranks); false = tokenize every time."""
    cache_dir: str | None = None
    """Where the token cache lives; null = <run_dir>/cache. $VARS are expanded, so a node-local folder
    (`/local/$HOSTNAME/cache`) works: each node's local rank 0 then builds it once for its node."""

    def validate(self) -> None:
        self.require(self.max_samples is None or self.max_samples > 0, "max_samples", "must be > 0")
        self.require(self.max_length >= 16, "max_length", "must be >= 16")
        self.require(self.num_default_prompts > 0, "num_default_prompts", "must be > 0")
        self.require(0.0 <= self.default_question_share <= 1.0, "default_question_share", "must be in [0, 1]")
        self.require(self.tokenize_workers >= 0, "tokenize_workers", "must be >= 0 (0 = one per CPU, at most 16)")
        reserved = sorted(set(self.chat_template_kwargs) & TEMPLATE_ARGUMENTS)
        self.require(not reserved, "chat_template_kwargs", f"sets {', '.join(reserved)}, which stage 1 passes itself")

    def recipe_warnings(self) -> list[str]:
        if self.max_length != 3072:
            return [f"data.max_length={self.max_length} departs from the recipe (3072): longer samples are "
                    f"{'truncated' if self.on_long == 'truncate' else 'skipped'} (data.on_long)"]
        return []


PART_COUNTS_KEY = b"dflash.part_counts"


def part_counts(path: Path) -> dict[str, Any]:
    """The counts `write_conversations_parquet` stored in a file's metadata ({} when none)."""
    import pyarrow.parquet as pq

    raw = (pq.read_schema(path).metadata or {}).get(PART_COUNTS_KEY)
    return json.loads(raw) if raw else {}


def generate_record(path: Path) -> dict[str, Any] | None:
    """What `generate` counted on the way from the user's file to generated.parquet (`path`): the
    user's file (`prompts`), its rows read, bad rows skipped, leading turns dropped, turns kept past
    the context, answers cut and the turns dropped after them. None for a file that is not one
    `generate` merged, or one merged before it recorded them."""
    if path.suffix != ".parquet" or not path.is_file():
        return None
    counts = part_counts(path)
    return counts if "rows_read" in counts else None


def write_conversations_parquet(conversations: list[Conversation], path: Path, counts: dict[str, Any] | None = None) -> None:
    """Atomic Parquet write of `messages` rows, plus `source_row` (the 0-based row of the user's data
    the conversation was made from, so every row can be traced back) and, when the conversations carry
    one, `prompt_hash` (the split key of a regenerated row: `generate.prompt_hash`). Tool calls,
    tool results' ids, reasoning, `weight`, `answer_cut` (per regenerated answer: did
    generate.max_new_tokens cut it; null on the turns kept as the data has them), `stop_id` (the stop token it ended with) and `tools` get their
    columns only when some row has them, so a file of plain chats has the bytes it always had. `counts`
    go into the file's own metadata (`part_counts` reads them): a part carries what was counted while
    it was made, whichever rank or run made it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fields = [("role", pa.string()), ("content", pa.string()), ("token_ids", pa.list_(pa.int32()))]
    if any("answer_cut" in m for c in conversations for m in c.messages):
        fields.append(("answer_cut", pa.bool_()))
    if any("stop_id" in m for c in conversations for m in c.messages):
        fields.append(("stop_id", pa.int32()))
    if any(k in m for c in conversations for m in c.messages for k in ("tool_calls", "tool_call_id", "name")):
        call = pa.struct([("id", pa.string()), ("name", pa.string()), ("arguments", pa.string())])
        fields += [("tool_calls", pa.list_(call)), ("tool_call_id", pa.string()), ("name", pa.string())]
    for name, kind in (("reasoning_content", pa.string()), ("weight", pa.int8())):
        if any(name in m for c in conversations for m in c.messages):
            fields.append((name, kind))
    columns = [("messages", pa.list_(pa.struct(fields))), ("source_row", pa.int64())]
    with_tools = any(c.tools is not None for c in conversations)
    if with_tools:
        columns.append(("tools", pa.string()))
    with_prompts = any(c.prompt_hash is not None for c in conversations)
    if with_prompts:
        columns.append(("prompt_hash", pa.string()))
    rows = [
        {
            "messages": [{name: m.get(name) for name, _ in fields} for m in c.messages],
            "source_row": c.row,
            **({"tools": c.tools} if with_tools else {}),
            **({"prompt_hash": c.prompt_hash} if with_prompts else {}),
        }
        for c in conversations
    ]
    metadata = {PART_COUNTS_KEY: json.dumps(counts)} if counts else None
    table = pa.Table.from_pylist(rows, schema=pa.schema(columns, metadata=metadata))
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
