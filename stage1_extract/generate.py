"""Regenerate the assistant turns with the target, as the DFlash recipe does.

    python -m stage1_extract generate --config configs/default.yaml
    torchrun --nproc_per_node 8 -m stage1_extract generate --config my-qwen3.yaml   # one vLLM engine per GPU

A drafter learns to predict the target's own continuations, so every assistant turn is rewritten
by the target (temperature 0.7, top-p 0.8 by default). A turn that calls tools is kept as the data
has it: the tool results after it answer that call, which a rewritten turn might not make. So is a turn
the data marks `weight: 0`: context, never supervised, so a rewrite would cost generation and teach
nothing. Backends
(`backends.py`): vllm on GPU, transformers (batched, left-padded) on CPU. Work is cut into parts of
`generate.rows_per_part` conversations, each written as its own Parquet part the moment its last
answer lands; the engine is kept fed across parts (the next part's requests go in while the current
part's longest answers still decode). A rerun skips finished parts, so a killed run resumes. The
parts are merged into `run_dir/data/generated.parquet` at the end.

An answer cut at `generate.max_new_tokens` is kept (its tokens are the target's) and marked
(`answer_cut`), so extraction leaves the end-of-turn marker the template closes it with unsupervised:
the target did not end its answer there. Its row stops at the cut answer: the row's later turns are
dropped (counted, `turns_dropped_after_cut`), because the data's next user turn answers the data's
own, whole answer, and the target's next answer would be conditioned on a cut answer closed as if
finished, a context it never meets when serving. The summary counts cut answers (`answers_cut`);
parts written before answers recorded it count theirs as ended (`answers_cut_unknown`).

A prompt is sent only while it fits a sample (`context`: the tokens a sample may hold, min of
data.max_length and the target's max_position_embeddings, less one for the answer) and the engine's
own context (vLLM's max_model_len): a longer one would be cut away by extraction anyway, and on the
transformers backend it pads its whole batch to its length. That turn and the row's later ones stay
as the data has them, counted (`long_prompt_turns_kept`); a part keeps the limit it was made under,
and one that kept turns under a smaller limit than the config's now is generated again.

Each row of generated.parquet keeps the 0-based row of the user's data it was made from
(`source_row`) and the hash of that row's prompt (`prompt_hash`: the row with the turns generate
rewrites left out), so every copy of a prompt shares its split key whatever answers were sampled for
each. Its metadata (`generate_record`) counts the rows read and dropped on the way from the user's
file, which extraction carries into the manifest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from shared.config import Section, dotted_differences
from shared.conversation_files import read_conversations
from shared.conversations import Conversation, ReadStats
from shared.errors import DataError
from shared.files import full_disk, write_atomic
from shared.identity import generate_settings_key, with_unrecorded_of
from stage1_extract.backends import Answer, Engine, Request, RequestRefused, request_seed
from stage1_extract.data import part_counts, write_conversations_parquet
from stage1_extract.template import prompt_ids

log = logging.getLogger(__name__)


class GenerateConfig(Section):
    section: ClassVar[str] = "generate"
    renamed: ClassVar[dict[str, str]] = {"device": "extract.device", "chunk_size": "rows_per_part"}
    backend: Literal["auto", "transformers", "vllm"] = "auto"
    """auto: vllm on GPU when it is installed, else transformers (batched, left-padded)."""
    temperature: float = 0.7
    """Sampling temperature of the regenerated answers (recipe: 0.7); 0 = greedy."""
    top_p: float = 0.8
    """Nucleus sampling (recipe: 0.8)."""
    max_new_tokens: int = 512
    """Longest regenerated answer, in tokens. An answer cut here is kept with its end-of-turn marker
    unsupervised and its row's later turns dropped; the summary counts them (`answers_cut`)."""
    batch_size: int = 32
    """Sequences per transformers generate call."""
    rows_per_part: int = 128
    """Conversations per resumable Parquet part."""
    seed: int = 0
    """Seeds the sampled answers (each rank's engine, or with per_request_seeds each row and turn). Not
    the run's `seed`: training with another seed keeps these answers and the store made from them."""
    tensor_parallel_size: int = 1
    """vllm: GPUs per engine. Under torchrun each rank (or group of ranks) runs its own engine on its
    own GPU(s) over its share of the parts (data parallel)."""
    per_request_seeds: bool = False
    """vllm: seed every request from its row and turn instead of one engine seed per rank. Off, vLLM
    samples on its fast path; on, every decode step of a request goes through vLLM's per-request
    seeded sampler (slower). Neither makes a GPU run reproducible (vLLM is not batch-invariant: an
    answer's logits move in their last bits with the rest of the batch, see docs/store.md); on, only
    the random draws are fixed. Not part of the answers' settings: either way an answer is a sample of
    the target at the same temperature and top-p, and finished parts are kept."""

    def validate(self) -> None:
        self.require(self.temperature >= 0, "temperature", "must be >= 0")
        self.require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        self.require(self.max_new_tokens > 0, "max_new_tokens", "must be > 0")
        self.require(self.batch_size > 0, "batch_size", "must be > 0")
        self.require(self.rows_per_part > 0, "rows_per_part", "must be > 0")
        self.require(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")

    def recipe_warnings(self) -> list[str]:
        """Departures in what the answers are (sampling and length); rows_per_part and batch_size set
        only the speed and the resumable unit."""
        out = []
        if (self.temperature, self.top_p) != (0.7, 0.8):
            out.append(
                f"generate: temperature={self.temperature}, top_p={self.top_p} differ from the DFlash recipe "
                f"(0.7, 0.8, SpecForge PR #578)"
            )
        if self.max_new_tokens != 2048:
            out.append(
                f"generate.max_new_tokens={self.max_new_tokens} departs from the recipe (2048): a longer answer is cut "
                f"there (kept with its end-of-turn marker unsupervised, its row's later turns dropped)"
            )
        return out


def prompt_hash(conversation: Conversation) -> str:
    """A row's prompt, as the data gives it: its turns with the ones `generate` rewrites left out, and
    its tools. Copies of a row share it whatever answers the target samples for each, so the held-out
    split keeps them on one side (`shared/shard_records.split_hashes`)."""
    rewritten = set(assistant_slots(conversation.messages))
    kept = [m for i, m in enumerate(conversation.messages) if i not in rewritten]
    return Conversation(row=conversation.row, messages=kept, tools=conversation.tools).row_hash()


def assistant_slots(messages: list[dict[str, Any]]) -> list[int]:
    """Indices of the turns to (re)write: every assistant turn that calls no tool and is supervised
    (not `weight: 0`), plus one after a trailing user (or tool) turn."""
    slots = [i for i, m in enumerate(messages)
             if m["role"] == "assistant" and not m.get("tool_calls") and m.get("weight") != 0]
    if messages[-1]["role"] != "assistant":
        slots.append(len(messages))
    return slots


class PartRewrite:
    """One part's conversations, their assistant turns rewritten in order: turn r of every
    conversation that has one is round r; a round's requests go out together, the next round's once
    all its answers are back (each prompt holds the answers before it). Each new turn keeps the
    target's own token ids (`token_ids`, what extraction stores) beside their decoded text (for
    people and for other tools) and whether generate.max_new_tokens cut it (`answer_cut`); a cut answer
    ends its conversation (module docstring)."""

    def __init__(
        self, number: int, conversations: list[Conversation], tokenizer: Any, seed: int,
        template_kwargs: dict[str, Any] | None = None,
    ):
        self.number, self.source, self.tokenizer, self.seed = number, conversations, tokenizer, seed
        self.template_kwargs = template_kwargs  # data.chat_template_kwargs: the prompts render as extraction renders them
        self.current = [list(c.messages) for c in conversations]
        self.slots = [assistant_slots(c.messages) for c in conversations]
        self.round = -1
        self.awaited = 0
        self.past_context: dict[int, int] = {}  # conversation -> its turns kept as the data has them
        self.cut_at: dict[int, int] = {}  # conversation -> its turns dropped after its cut answer

    def next_round(self, max_prompt: tuple[int, str] | None = None) -> list[tuple[Hashable, Request]]:
        """The next round's requests, keyed (part, conversation); none when the part is done. A prompt
        longer than `max_prompt` (tokens, and what sets them: `prompt_limit`) is not sent: that turn
        and the conversation's later ones (longer still) stay as the data has them."""
        self.round += 1
        requests: list[tuple[Hashable, Request]] = []
        for i, slots in enumerate(self.slots):
            if self.round >= len(slots) or i in self.past_context or i in self.cut_at:
                continue
            ids = prompt_ids(self.tokenizer, self.current[i][: slots[self.round]], self.source[i].tools, self.template_kwargs)
            if max_prompt is not None and len(ids) > max_prompt[0]:
                self.past_context[i] = len(slots) - self.round
                log.warning(
                    "row %d of %s: the prompt of its assistant turn %d is %d tokens, past the %d sent (%s): that turn "
                    "and the %d after it are kept as the data has them (counted as long_prompt_turns_kept)",
                    self.source[i].row, self.source[i].source, self.round, len(ids), max_prompt[0], max_prompt[1],
                    len(slots) - self.round - 1,
                )
                continue
            requests.append(((self.number, i), Request(ids, request_seed(self.seed, self.source[i].row, self.round))))
        self.awaited = len(requests)
        return requests

    def answer(self, i: int, answer: Answer) -> bool:
        """Put conversation i's answer of this round in place (a cut one ends the conversation); True
        when the round is complete."""
        # The whole turn is the target's, the data's `name` of it included: the generation prompt that
        # produced it named no one, and a template that shows names would otherwise render another prompt.
        reply = {
            "role": "assistant", "content": self.tokenizer.decode(answer.ids, skip_special_tokens=True),
            "token_ids": list(answer.ids), "answer_cut": answer.cut, **({} if answer.stop is None else {"stop_id": answer.stop}),
        }
        at = self.slots[i][self.round]
        later = self.current[i][at + 1 :]
        if answer.cut:
            self.cut_at[i] = len(later)
            later = []
        self.current[i] = self.current[i][:at] + [reply] + later
        self.awaited -= 1
        return self.awaited == 0

    def conversations(self) -> list[Conversation]:
        return [Conversation(row=c.row, messages=m, source=c.source, tools=c.tools) for c, m in zip(self.source, self.current)]


@dataclass
class GenerateResult:
    path: Path
    num_conversations: int
    num_generated_tokens: int
    seconds: float
    parts_reused: int
    tool_call_turns_kept: int = 0  # assistant turns that call tools, kept as the data has them
    start_seconds: float = 0.0  # starting the backend (model load, vllm engine), apart from generating
    generate_seconds: float = 0.0  # answering the parts: the backend's generate calls and their templates
    long_prompt_turns_kept: int = 0  # turns whose prompt passed the engine's context, kept as the data has them
    in_flight_limit: int = 0  # requests fed before the engine is left to decode: its max_num_seqs, at least a part
    answers: int = 0  # regenerated answers in the merged output
    answers_cut: int = 0  # of those, cut at generate.max_new_tokens
    answers_cut_unknown: int = 0  # of those, from parts written before cuts were recorded (read as ended)
    turns_dropped_after_cut: int = 0  # turns of the data after a cut answer, dropped with it
    prompt_limit: int | None = None  # the longest prompt sent (tokens), None: no limit known
    prompt_limit_why: str = ""  # what sets it


def prompt_limit(engine_max: int | None, context: tuple[int, str] | None) -> tuple[int, str] | None:
    """The longest prompt sent and what sets it: one token under `context` (the tokens a sample may
    hold: extraction cuts an answer past it away, so generating it is wasted, and a transformers batch
    pads to its longest prompt), or the engine's own limit (vLLM's max_model_len, less one) where
    that is tighter."""
    limits = []
    if context is not None:
        limits.append((context[0] - 1, f"{context[1]}, less one token for the answer"))
    if engine_max is not None:
        limits.append((engine_max, f"the engine's context, max_model_len={engine_max + 1}, less one token for the answer"))
    return min(limits) if limits else None


def part_name(number: int, chunk: list[Conversation]) -> str:
    rows = hashlib.sha256("".join(c.row_hash() for c in chunk).encode()).hexdigest()[:12]
    return f"part-{number:06d}-{rows}.parquet"


def generate_all(
    conversations: list[Conversation],
    tokenizer: Any,
    make_engine: Callable[[], Engine],
    out_path: Path,
    cfg: GenerateConfig,
    settings: dict[str, Any],
    seed: int,
    progress: bool = True,
    rank: int = 0,
    world: int = 1,
    context: tuple[int, str] | None = None,
    read_counts: dict[str, Any] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> GenerateResult:
    """Every part of the conversations written once (resumable); with several ranks (torchrun, one
    engine per GPU) rank r writes parts r, r + W, ..., and rank 0 waits until every part exists (or
    a rank reports a failure) and merges them into `out_path`. A rank's parts are fed to its engine
    while it decodes: a part enters while fewer requests than the engine decodes at once (vLLM's
    max_num_seqs, at least `rows_per_part`) are in flight, so its batch stays full, and is written
    the moment its last answer lands, so parts may be finished out of order; a finished part is never
    generated again, unless it kept turns past a smaller `context` than this one (module docstring).
    `context`: the tokens a sample may hold and what sets them; `read_counts`: what reading the
    user's file counted, written with the merged file's own counts into its metadata; `template_kwargs`:
    the chat template's variables (`data.chat_template_kwargs`, part of `settings` when set)."""
    from tqdm import tqdm

    parts_dir = out_path.with_name(out_path.stem + ".parts")
    parts_dir.mkdir(parents=True, exist_ok=True)
    meta_path = parts_dir / "settings.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        made = meta.get("settings")
        if made is None:  # written before the settings themselves were kept: only their key
            legacy = {**{k: v for k, v in settings.items() if k not in ("rows_per_part", "template", "target_config")},
                      "chunk_size": settings["rows_per_part"]}
            made = settings if meta.get("key") == generate_settings_key(legacy) else {"settings": "unknown (older parts)"}
        changed = dotted_differences(with_unrecorded_of(made, settings), settings)
        if changed:
            what = ", ".join(f"{k} ({v[0]} -> {v[1]})" for k, v in changed.items())
            raise DataError(
                f"{parts_dir} holds answers made with other settings than the config gives: {what}. Its parts "
                f"cannot be reused: delete that folder to regenerate everything, or choose another run_dir"
            )
    chunks = [conversations[i : i + cfg.rows_per_part] for i in range(0, len(conversations), cfg.rows_per_part)]
    wanted = [part_name(number, chunk) for number, chunk in enumerate(chunks)]

    def named(exc: BaseException, writing: Path) -> BaseException:
        """A full disk as one line (the folder, its free space, what is kept); anything else as it is."""
        kept = sum((parts_dir / name).exists() for name in wanted)
        return full_disk(
            exc, parts_dir, f"writing {writing.name}; the {kept} of {len(wanted)} parts written so far are kept; "
            f"free space and rerun `python -m stage1_extract generate`, which resumes from them"
        ) or exc

    failure = parts_dir / f".failed-rank-{rank}"
    try:
        if rank == 0:
            write_atomic(meta_path, json.dumps({"settings": settings}))
            for stale in parts_dir.glob(".failed-rank-*"):  # an earlier run's (torchrun stops every rank on a failure)
                stale.unlink(missing_ok=True)
    except OSError as exc:
        raise named(exc, meta_path) from None
    failure.unlink(missing_ok=True)
    started = time.perf_counter()
    generated_tokens = reused = 0
    start_s = generate_s = 0.0
    mine = [number for number in range(len(chunks)) if number % world == rank]
    bar = tqdm(total=sum(len(chunks[n]) for n in mine), desc="generate", unit="conv", disable=not progress)
    if rank == 0:
        for stale in set(p.name for p in parts_dir.glob("part-*.parquet")) - set(wanted):
            (parts_dir / stale).unlink()  # rows edited or removed since: their answers no longer apply
    todo = []
    for number in mine:
        if (parts_dir / wanted[number]).exists() and not kept_under_smaller_context(parts_dir / wanted[number], context):
            reused += 1
            bar.update(len(chunks[number]))
        else:
            todo.append(number)
    engine: Engine | None = None  # the model loads only when a part is left to write
    running: dict[int, PartRewrite] = {}
    part = meta_path
    limit = 0

    def advance(number: int) -> None:
        """The part's next round into the engine, or the part written when it has none left."""
        nonlocal part
        rewrite = running[number]
        requests = rewrite.next_round(prompt_limit(engine.max_prompt_tokens(), context))
        if requests:
            try:
                engine.submit(requests)
            except RequestRefused as exc:
                row = rewrite.source[exc.key[1]].row
                raise DataError(
                    f"{rewrite.source[exc.key[1]].source}: row {row}: the engine refused its assistant turn {rewrite.round} "
                    f"({exc.reason}) while writing {wanted[number]}; fix or drop that row, then rerun `python -m "
                    f"stage1_extract generate` (finished parts are kept)"
                ) from None
            return
        part = parts_dir / wanted[number]
        write_conversations_parquet(running.pop(number).conversations(), part, {
            "long_prompt_turns_kept": sum(rewrite.past_context.values()),
            "turns_dropped_after_cut": sum(rewrite.cut_at.values()),
            **({"context": context[0]} if context is not None else {}),  # what it was made under (kept_under_smaller_context)
        })
        bar.update(len(chunks[number]))
        bar.set_postfix(tok_s=f"{generated_tokens / max(time.perf_counter() - started, 1e-9):.0f}")

    try:
        loop_started = time.perf_counter()
        while todo or running:
            if engine is None:
                t0 = time.perf_counter()
                engine = make_engine()
                start_s = time.perf_counter() - t0
                limit = max(cfg.rows_per_part, engine.capacity())
            # Feed the engine up to what it decodes at once: the next parts go in while the current
            # one's longest answers decode, and a part enters as soon as answers leave room for it.
            while todo and engine.pending() < limit:
                number = todo.pop(0)
                running[number] = PartRewrite(number, chunks[number], tokenizer, seed, template_kwargs)
                advance(number)
            for (number, i), answer in engine.collect() if running else []:
                generated_tokens += len(answer.ids)
                if running[number].answer(i, answer):
                    advance(number)
        generate_s = time.perf_counter() - loop_started - start_s
    except BaseException as exc:
        error = named(exc, part)
        try:
            write_atomic(failure, f"{type(error).__name__}: {error}")  # rank 0 stops waiting and names it
        except OSError as marker_exc:  # the disk that refused the part refuses its marker too
            if world > 1:
                log.warning("could not leave %s (%s); torchrun stops the other ranks when this one exits", failure, marker_exc)
        if error is exc:
            raise
        raise error from None
    finally:
        bar.close()
    kept = sum(bool(m.get("tool_calls")) for c in conversations for m in c.messages if m["role"] == "assistant")
    if rank != 0:
        return GenerateResult(out_path, 0, generated_tokens, time.perf_counter() - started, reused, kept, start_s, generate_s, 0, limit)
    wait_for_parts(parts_dir, wanted, world, context)
    # Summed over every part, each rank's and each earlier run's: the count belongs to the data made.
    counts = [part_counts(parts_dir / name) for name in wanted]
    read = ReadStats()  # the cut answers, counted as the parts hold them
    # By name, as waited for: another node's newest parts can be missing from this node's cached listing (NFS).
    parts = [c for name in wanted for c in read_conversations(parts_dir / name, stats=read)]
    if [p.source_row for p in parts] != [c.row for c in conversations]:
        raise RuntimeError(f"{parts_dir}: its parts hold other rows than the {len(conversations)} of the data, in another order")
    # Each row keeps its row in the user's data (source_row) and its prompt's hash (module docstring).
    merged = [
        Conversation(row=c.row, messages=p.messages, source=str(out_path), tools=p.tools, prompt_hash=prompt_hash(c))
        for c, p in zip(conversations, parts)
    ]
    limit_now = prompt_limit(engine.max_prompt_tokens() if engine is not None else None, context)
    result = GenerateResult(
        out_path, len(merged), generated_tokens, time.perf_counter() - started, reused, kept, start_s, generate_s,
        sum(c.get("long_prompt_turns_kept", 0) for c in counts), limit,
        answers=sum(m.get("token_ids") is not None for c in merged for m in c.messages),
        answers_cut=read.answers_cut, answers_cut_unknown=read.answers_cut_unknown,
        turns_dropped_after_cut=sum(c.get("turns_dropped_after_cut", 0) for c in counts),
        prompt_limit=limit_now[0] if limit_now else None, prompt_limit_why=limit_now[1] if limit_now else "",
    )
    record = {
        **(read_counts or {}),
        "conversations": result.num_conversations,
        "tool_call_turns_kept": result.tool_call_turns_kept,
        "long_prompt_turns_kept": result.long_prompt_turns_kept,
        "answers": result.answers,
        "answers_cut": result.answers_cut,
        "answers_cut_unknown": result.answers_cut_unknown,
        "turns_dropped_after_cut": result.turns_dropped_after_cut,
    }
    try:
        write_conversations_parquet(merged, out_path, record)
    except OSError as exc:
        raise named(exc, out_path) from None
    return result


def kept_under_smaller_context(part: Path, context: tuple[int, str] | None) -> bool:
    """Whether a finished part kept turns as the data has them under a smaller context than
    `context` (data.max_length was raised since): those turns now fit, and extraction would store
    the data's answers where the target's belong, so the part is generated again. A part that kept
    none, or that does not record its context (made before it did), is reused."""
    counts = part_counts(part)
    return context is not None and bool(counts.get("long_prompt_turns_kept")) and counts.get("context", context[0]) < context[0]


def wait_for_parts(
    parts_dir: Path, wanted: list[str], world: int, context: tuple[int, str] | None = None, poll_s: float = 2.0
) -> None:
    """Rank 0: until every part exists and is current. The ranks share no process group (vLLM builds
    its own and would adopt ours), so they meet on the files: each part is written atomically, and a
    failing rank leaves `.failed-rank-R` (torchrun stops every rank when one dies). A part another
    rank is making again (`kept_under_smaller_context`) still exists in its old form until then:
    it counts as missing, or a rank with less work would merge the data's answers."""
    while True:
        failed = sorted(parts_dir.glob(".failed-rank-*"))
        if failed:
            raise DataError(f"generate failed on {failed[0].name[len('.failed-'):]}: {failed[0].read_text()} ({parts_dir})")
        missing = [name for name in wanted
                   if not (parts_dir / name).exists() or kept_under_smaller_context(parts_dir / name, context)]
        if not missing or world == 1:
            if missing:
                raise RuntimeError(f"{len(missing)} parts missing after generation, first {missing[0]}")
            return
        time.sleep(poll_s)
