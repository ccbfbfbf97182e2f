"""Regenerate the assistant turns with the target, as the DFlash recipe does.

    python -m stage1_extract generate --config configs/default.yaml

A drafter learns to predict the target's own continuations, so every assistant turn is rewritten
by the target (temperature 0.7, top-p 0.8 by default). A turn that calls tools is kept as the data
has it: the tool results after it answer that call, which a rewritten turn might not make. Backends: vllm on GPU, transformers
(batched, left-padded) on CPU. Work is done in chunks of conversations, each written as its own
Parquet part; a rerun skips finished parts, so a killed run resumes. The parts are merged into
`run_dir/data/generated.parquet` at the end.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from shared.config import Section, dotted_differences
from shared.conversation_files import read_conversations
from shared.conversations import Conversation
from shared.errors import DataError
from shared.files import full_disk, write_atomic
from shared.identity import generate_settings_key
from shared.target import stop_token_ids
from stage1_extract.data import write_conversations_parquet
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
    """Longest regenerated answer, in tokens."""
    batch_size: int = 32
    """Sequences per transformers generate call."""
    rows_per_part: int = 128
    """Conversations per resumable Parquet part."""
    seed: int = 0
    """Seeds the sampled answers (with each row and turn). Not the run's `seed`: training with another
    seed keeps these answers and the store made from them."""
    tensor_parallel_size: int = 1
    """vllm: GPUs per engine. Under torchrun each rank (or group of ranks) runs its own engine on its
    own GPU(s) over its share of the parts (data parallel)."""

    def validate(self) -> None:
        self.require(self.temperature >= 0, "temperature", "must be >= 0")
        self.require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        self.require(self.max_new_tokens > 0, "max_new_tokens", "must be > 0")
        self.require(self.batch_size > 0, "batch_size", "must be > 0")
        self.require(self.rows_per_part > 0, "rows_per_part", "must be > 0")
        self.require(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")

    def recipe_warnings(self) -> list[str]:
        if (self.temperature, self.top_p) != (0.7, 0.8):
            return [
                f"generate: temperature={self.temperature}, top_p={self.top_p} differ from the DFlash recipe "
                f"(0.7, 0.8, SpecForge PR #578)"
            ]
        return []


def resolve_backend(backend: str, device: str) -> str:
    if backend != "auto":
        return backend
    import importlib.util

    if device.startswith("cuda") and importlib.util.find_spec("vllm") is not None:
        return "vllm"
    return "transformers"


@dataclass(frozen=True)
class Request:
    """One answer to generate: the prompt's token ids and the seed of its sampling, derived from the
    row and the turn (`request_seed`), so an answer depends on its row only: not on the batch, the
    part, the rank or how many ranks share the work."""

    prompt_ids: list[int]
    seed: int


def request_seed(seed: int, row: int, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}:{row}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


# A backend turns requests into the target's own answers: token ids, stop tokens removed (the chat
# template closes the turn itself), one list per request.
Backend = Callable[[list[Request]], list[list[int]]]


def until_stop(ids: list[int], stop_ids: list[int]) -> list[int]:
    """The answer's ids before its first stop token (padding after it included)."""
    stops = set(stop_ids)
    for position, token in enumerate(ids):
        if token in stops:
            return ids[:position]
    return ids


def transformers_backend(model: Any, tokenizer: Any, cfg: GenerateConfig, seed: int) -> Backend:
    import torch

    device = next(model.parameters()).device
    stop_ids = stop_token_ids(tokenizer, model)
    # Left padding is masked out, so any id serves; a tokenizer with neither pad nor EOS gets 0.
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop_ids[0] if stop_ids else 0)
    if not stop_ids:
        log.warning("the tokenizer and generation config name no EOS token: answers stop at generate.max_new_tokens")

    def run(requests: list[Request]) -> list[list[int]]:
        answers: list[list[int]] = [[] for _ in requests]
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))  # less left padding
        for start in range(0, len(order), cfg.batch_size):
            idx = order[start : start + cfg.batch_size]
            width = max(len(requests[i].prompt_ids) for i in idx)
            ids_BT = torch.full((len(idx), width), pad_id, dtype=torch.long)
            attn_BT = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                prompt = requests[i].prompt_ids
                ids_BT[row, width - len(prompt) :] = torch.tensor(prompt)
                attn_BT[row, width - len(prompt) :] = 1
            # HF's generate samples a batch from the global generator (no per-row generator): the
            # batch's seed mixes its requests' seeds, so a resumed run regenerates exactly what it
            # lost, and fork_rng puts the caller's RNG state back afterwards.
            batch_seed = request_seed(seed, sum(requests[i].seed for i in idx) & 0x7FFF_FFFF, len(idx))
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.inference_mode():
                torch.manual_seed(batch_seed)
                out_BT = model.generate(
                    input_ids=ids_BT.to(device),
                    attention_mask=attn_BT.to(device),
                    do_sample=cfg.temperature > 0,
                    temperature=cfg.temperature if cfg.temperature > 0 else None,
                    top_p=cfg.top_p if cfg.temperature > 0 else None,
                    top_k=None,
                    max_new_tokens=cfg.max_new_tokens,
                    eos_token_id=stop_ids or None,
                    pad_token_id=pad_id,
                )
            for row, i in enumerate(idx):
                answers[i] = until_stop(out_BT[row, width:].tolist(), stop_ids)
        return answers

    return run


def vllm_backend(model_dir: str, cfg: GenerateConfig, seed: int, dtype: str, stop_ids: list[int]) -> Backend:
    """One vLLM engine on this process's GPU (or `generate.tensor_parallel_size` GPUs). Each request
    carries its own seed; the answer is vLLM's token ids, never its text re-tokenized."""
    from vllm import LLM, SamplingParams  # GPU only: imported here so CPU installs never need it

    from shared.target_model import TORCH_DTYPES

    llm = LLM(model=model_dir, dtype=TORCH_DTYPES[dtype], seed=seed, tensor_parallel_size=cfg.tensor_parallel_size)

    def run(requests: list[Request]) -> list[list[int]]:
        params = [
            SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_new_tokens, seed=r.seed)
            for r in requests
        ]
        outputs = llm.generate([{"prompt_token_ids": r.prompt_ids} for r in requests], params, use_tqdm=False)
        return [until_stop(list(o.outputs[0].token_ids), stop_ids) for o in outputs]

    return run


def assistant_slots(messages: list[dict[str, Any]]) -> list[int]:
    """Indices of the turns to (re)write: every assistant turn that calls no tool, plus one after a
    trailing user (or tool) turn."""
    slots = [i for i, m in enumerate(messages) if m["role"] == "assistant" and not m.get("tool_calls")]
    if messages[-1]["role"] != "assistant":
        slots.append(len(messages))
    return slots


def regenerate(conversations: list[Conversation], tokenizer: Any, backend: Backend, seed: int) -> list[Conversation]:
    """Rewrite every assistant turn in order; turn r of all conversations is one batched round. Each
    new turn keeps the target's own token ids (`token_ids`, what extraction stores) beside their
    decoded text (for people and for other tools)."""
    current = [list(c.messages) for c in conversations]
    slots = [assistant_slots(c.messages) for c in conversations]
    for round_index in range(max(len(s) for s in slots)):
        todo = [i for i, s in enumerate(slots) if round_index < len(s)]
        requests = [
            Request(
                prompt_ids(tokenizer, current[i][: slots[i][round_index]], conversations[i].tools),
                request_seed(seed, conversations[i].row, round_index),
            )
            for i in todo
        ]
        answers = backend(requests)
        for i, ids in zip(todo, answers):
            reply = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True), "token_ids": list(ids)}
            at = slots[i][round_index]
            current[i] = current[i][:at] + [reply] + current[i][at + 1 :]
    return [Conversation(row=c.row, messages=m, source=c.source, tools=c.tools) for c, m in zip(conversations, current)]


@dataclass
class GenerateResult:
    path: Path
    num_conversations: int
    num_generated_tokens: int
    seconds: float
    parts_reused: int
    tool_call_turns_kept: int = 0  # assistant turns that call tools, kept as the data has them


def part_name(number: int, chunk: list[Conversation]) -> str:
    rows = hashlib.sha256("".join(c.row_hash() for c in chunk).encode()).hexdigest()[:12]
    return f"part-{number:06d}-{rows}.parquet"


def generate_all(
    conversations: list[Conversation],
    tokenizer: Any,
    make_backend: Callable[[], Backend],
    out_path: Path,
    cfg: GenerateConfig,
    settings: dict[str, Any],
    seed: int,
    progress: bool = True,
    rank: int = 0,
    world: int = 1,
) -> GenerateResult:
    """Every part of the conversations written once (resumable); with several ranks (torchrun, one
    engine per GPU) rank r writes parts r, r + W, ..., and rank 0 waits until every part exists (or
    a rank reports a failure) and merges them into `out_path`. The answers depend on the rows only
    (per-request seeds), so any rank count gives the same file."""
    from tqdm import tqdm

    parts_dir = out_path.with_name(out_path.stem + ".parts")
    parts_dir.mkdir(parents=True, exist_ok=True)
    meta_path = parts_dir / "settings.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        made = meta.get("settings")
        if made is None:  # written before the settings themselves were kept: only their key
            legacy = {**{k: v for k, v in settings.items() if k != "rows_per_part"}, "chunk_size": settings["rows_per_part"]}
            made = settings if meta.get("key") == generate_settings_key(legacy) else {"settings": "unknown (older parts)"}
        changed = dotted_differences(made, settings)
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
    mine = [number for number in range(len(chunks)) if number % world == rank]
    bar = tqdm(total=sum(len(chunks[n]) for n in mine), desc="generate", unit="conv", disable=not progress)
    backend: Backend | None = None  # the model loads only when a part is left to write
    if rank == 0:
        for stale in set(p.name for p in parts_dir.glob("part-*.parquet")) - set(wanted):
            (parts_dir / stale).unlink()  # rows edited or removed since: their answers no longer apply
    part = meta_path
    try:
        for number in mine:
            chunk, part = chunks[number], parts_dir / wanted[number]
            if part.exists():
                reused += 1
                bar.update(len(chunk))
                continue
            backend = backend or make_backend()
            done = regenerate(chunk, tokenizer, backend, seed=seed)
            generated_tokens += sum(len(m["token_ids"]) for c in done for m in c.messages if m.get("token_ids") is not None)
            write_conversations_parquet(done, part)
            bar.update(len(chunk))
            elapsed = time.perf_counter() - started
            bar.set_postfix(tok_s=f"{generated_tokens / max(elapsed, 1e-9):.0f}")
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
        return GenerateResult(out_path, 0, generated_tokens, time.perf_counter() - started, reused, kept)
    wait_for_parts(parts_dir, wanted, world)
    merged = [
        Conversation(row=i, messages=c.messages, source=str(out_path), tools=c.tools)
        for i, c in enumerate(read_conversations(parts_dir))
    ]
    try:
        write_conversations_parquet(merged, out_path)
    except OSError as exc:
        raise named(exc, out_path) from None
    return GenerateResult(out_path, len(merged), generated_tokens, time.perf_counter() - started, reused, kept)


def wait_for_parts(parts_dir: Path, wanted: list[str], world: int, poll_s: float = 2.0) -> None:
    """Rank 0: until every part exists. The ranks share no process group (vLLM builds its own and
    would adopt ours), so they meet on the files: each part is written atomically, and a failing
    rank leaves `.failed-rank-R` (torchrun stops every rank when one dies)."""
    while True:
        failed = sorted(parts_dir.glob(".failed-rank-*"))
        if failed:
            raise DataError(f"generate failed on {failed[0].name[len('.failed-'):]}: {failed[0].read_text()} ({parts_dir})")
        missing = [name for name in wanted if not (parts_dir / name).exists()]
        if not missing or world == 1:
            if missing:
                raise RuntimeError(f"{len(missing)} parts missing after generation, first {missing[0]}")
            return
        time.sleep(poll_s)
