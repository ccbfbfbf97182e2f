"""Generation backends behind one engine interface: requests go in, answers come out as they finish.

    engine = vllm_engine(model_dir, cfg, seed, dtype, stop_ids, rank)     # GPU: vLLM's engine, fed request by request
    engine = BatchEngine(transformers_backend(model, tokenizer, cfg, seed))  # CPU: one submitted group per call
    engine.submit([(key, Request(prompt_ids, seed)), ...])
    for key, answer in engine.collect(): ...                              # blocks until one or more finish

    resolve_backend("auto", device), backend_problem("vllm")            # which one runs here, and why not

`generate.generate_all` keeps the engine fed across parts: it submits the next part's requests while
the current part's longest answers are still decoding, and writes each part as its last answer lands.

An answer says whether the target ended it (a stop token) or `generate.max_new_tokens` cut it (vLLM's
finish_reason "length"; on transformers, no stop token among the ids): the chat template closes
either with its end-of-turn marker, and only a finished answer's marker is the target's.

Seeds. vLLM samples fastest with one engine seed (`engine_seed`: from the run's seed and the rank, so
ranks draw different streams); a seed per request (`generate.per_request_seeds`) sends every decode
step of that request through vLLM's per-request seeded sampler and off its fast top-p path. Neither
makes a GPU run reproducible: vLLM is not batch-invariant, so an answer's logits move in their last
bits with whatever else is in the batch, and the two samples part at the first near-tie. What is
reproducible is said in docs/store.md. The transformers backend seeds each batch from its requests'
seeds (HF's generate samples from the global generator), so a CPU run repeats itself exactly.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

from shared.target import stop_token_ids

log = logging.getLogger(__name__)


def vllm_installed() -> bool:
    """Whether vllm can be imported here, found without importing it (its import takes seconds and
    initialises CUDA machinery)."""
    import importlib.util
    import sys

    return "vllm" in sys.modules or importlib.util.find_spec("vllm") is not None  # imported already: installed


def backend_problem(backend: str) -> str | None:
    """Why generate.backend cannot run here (vllm chosen and not installed), or None: `generate`
    refuses it before reading any data, `check` warns."""
    if backend != "vllm" or vllm_installed():
        return None
    return (
        "generate.backend=vllm, but vllm is not installed here: install it with `pip install -e '.[gpu]'` (on a GPU "
        "node), or set generate.backend=transformers (runs anywhere, CPU included, but slowly: fine for a small test, "
        "weeks for an 8B target)"
    )


def resolve_backend(backend: str, device: str) -> str:
    if backend != "auto":
        return backend
    return "vllm" if device.startswith("cuda") and vllm_installed() else "transformers"


@dataclass(frozen=True)
class Request:
    """One answer to generate: the prompt's token ids and the seed of its sampling, derived from the
    row and the turn (`request_seed`), so it depends on its row only: not on the batch, the part, the
    rank or how many ranks share the work."""

    prompt_ids: list[int]
    seed: int


def request_seed(seed: int, row: int, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}:{row}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def engine_seed(seed: int, rank: int) -> int:
    """The seed of rank `rank`'s vLLM engine: each rank draws its own stream."""
    return request_seed(seed, -1, rank) & 0x7FFF_FFFF


@dataclass(frozen=True)
class Answer:
    """One generated answer: the target's token ids, stop token removed, whether
    generate.max_new_tokens cut it before the target ended it, and the stop token it ended with (None:
    cut, or ended by a stop string): Llama 3.1 ends a turn with <|eom_id|> or <|eot_id|>, Qwen3 with
    <|im_end|> or <|endoftext|>, and the template's closing names one of them only."""

    ids: list[int]
    cut: bool
    stop: int | None = None


def until_stop(ids: list[int], stop_ids: list[int]) -> Answer:
    """The answer's ids before its first stop token (padding after it included); none among the ids:
    the limit cut it (the transformers backend: generation runs on only while a row has not stopped)."""
    stops = set(stop_ids)
    for position, token in enumerate(ids):
        if token in stops:
            return Answer(ids[:position], cut=False, stop=token)
    return Answer(ids, cut=True)


Keyed = list[tuple[Hashable, Request]]


class Engine(Protocol):
    """Answers requests as they finish: the target's own token ids, stop tokens removed (the chat
    template closes the turn itself), and whether the limit cut them."""

    def submit(self, requests: Keyed) -> None: ...

    def collect(self) -> list[tuple[Hashable, Answer]]:
        """The answers finished since the last call, at least one (blocks until one is)."""
        ...

    def pending(self) -> int:
        """Requests submitted and not yet collected."""
        ...

    def capacity(self) -> int:
        """Requests the engine decodes at once (vLLM's max_num_seqs), 0 where it sets no such limit."""
        ...

    def max_prompt_tokens(self) -> int | None:
        """The longest prompt it leaves room to answer (below vLLM's max_model_len), None: no limit known."""
        ...


class RequestRefused(Exception):
    """The engine refused one request (vLLM validates each in add_request): `key` names it."""

    def __init__(self, key: Hashable, reason: str):
        super().__init__(reason)
        self.key, self.reason = key, reason


# A backend answering a list of requests at once, one answer per request (the transformers backend).
Backend = Callable[[list[Request]], list[Answer]]


class BatchEngine:
    """A backend that answers a whole list at once, run one submitted group per `collect`: each
    group (one part's round) is generated exactly as it was submitted, so its answers do not depend on
    what else is queued."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.groups: deque[Keyed] = deque()

    def submit(self, requests: Keyed) -> None:
        if requests:
            self.groups.append(requests)

    def collect(self) -> list[tuple[Hashable, Answer]]:
        group = self.groups.popleft()
        answers = self.backend([r for _, r in group])
        return [(key, answer) for (key, _), answer in zip(group, answers)]

    def pending(self) -> int:
        return sum(len(g) for g in self.groups)

    def capacity(self) -> int:
        return 0  # one group per collect: more queued gains nothing

    def max_prompt_tokens(self) -> int | None:
        return None


def transformers_backend(model: Any, tokenizer: Any, cfg: Any, seed: int) -> Backend:
    """Batched, left-padded `generate` on the model's device (`cfg`: the generate section)."""
    import torch
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    stop_ids = stop_token_ids(tokenizer, model)
    # Left padding is masked out, so any id serves; a tokenizer with neither pad nor EOS gets 0.
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop_ids[0] if stop_ids else 0)
    if not stop_ids:
        log.warning("the tokenizer and generation config name no EOS token: answers stop at generate.max_new_tokens")

    # Exactly the settings given, as vLLM's SamplingParams: generate fills whatever it is not told from
    # the target's generation_config.json (a repetition_penalty, min_p, top_k, min_new_tokens...), even
    # from a generation_config passed to it, and the CPU answers would be other samples than vLLM's.
    model.generation_config = GenerationConfig(eos_token_id=stop_ids or None, pad_token_id=pad_id)

    def run(requests: list[Request]) -> list[Answer]:
        answers: dict[int, Answer] = {}
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
        return [answers[i] for i in range(len(requests))]

    return run


class VllmEngine:
    """vLLM's engine fed request by request (`LLM.llm_engine`: add_request / step), so requests of
    several parts decode together and an answer is handed back the step it finishes. Answers are
    vLLM's token ids, never its text re-tokenized (nor detokenized at all: only final outputs)."""

    def __init__(self, llm: Any, cfg: Any, stop_ids: list[int], per_request_seeds: bool):
        from vllm import SamplingParams  # GPU only: imported here so CPU installs never need it

        self.engine = llm.llm_engine
        self.stop_ids = stop_ids
        self.per_request_seeds = per_request_seeds
        # The stop ids given (the template's turn end among them), not only the ones vLLM finds itself.
        self.options = {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_new_tokens,
                        "stop_token_ids": list(stop_ids)}
        try:  # only the finished answer, token ids only: no partial outputs built every step
            from vllm.sampling_params import RequestOutputKind

            self.options.update(output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)
        except ImportError:  # a stand-in (tests) or an older vLLM: outputs filtered on `finished` below
            pass
        self.sampling = SamplingParams
        self.shared_params = SamplingParams(**self.options)  # the fast path: no seed of its own
        self.keys: dict[str, Hashable] = {}
        self.ids = itertools.count()
        self.max_num_seqs = engine_setting(self.engine, "scheduler_config", "max_num_seqs")
        self.max_model_len = engine_setting(self.engine, "model_config", "max_model_len")

    def submit(self, requests: Keyed) -> None:
        for key, request in requests:
            params = self.sampling(**self.options, seed=request.seed) if self.per_request_seeds else self.shared_params
            request_id = str(next(self.ids))
            try:
                given = self.engine.add_request(request_id, {"prompt_token_ids": list(request.prompt_ids)}, params)
            except ValueError as exc:  # vLLM's validation of this one request: the caller names its row
                raise RequestRefused(key, str(exc)) from exc
            # Recent vLLM returns the id it uses for the request's outputs.
            self.keys[given if isinstance(given, str) else request_id] = key

    def collect(self) -> list[tuple[Hashable, Answer]]:
        done: list[tuple[Hashable, Answer]] = []
        while not done:
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"vLLM holds no unfinished request while {len(self.keys)} answers are awaited")
            for output in self.engine.step():
                if output.finished and output.request_id in self.keys:
                    key = self.keys.pop(output.request_id)
                    completion = output.outputs[0]
                    # vLLM says why it stopped: "length" is max_tokens, "stop" a stop token or string
                    found, cut = until_stop(list(completion.token_ids), self.stop_ids), completion.finish_reason == "length"
                    done.append((key, Answer(found.ids, cut=cut, stop=None if cut else found.stop)))
        return done

    def pending(self) -> int:
        return len(self.keys)

    def capacity(self) -> int:
        return self.max_num_seqs or 0

    def max_prompt_tokens(self) -> int | None:
        return None if self.max_model_len is None else self.max_model_len - 1  # room for one answer token


def engine_setting(engine: Any, section: str, name: str) -> int | None:
    """An int of the engine's config: `vllm_config.<section>.<name>` (vLLM's LLMEngine), or the section
    on the engine itself (older engines); None where neither holds it."""
    for holder in (getattr(engine, "vllm_config", None), engine):
        value = getattr(getattr(holder, section, None), name, None)
        if isinstance(value, int):
            return value
    return None


def vllm_engine(model_dir: str, cfg: Any, seed: int, dtype: str, stop_ids: list[int], rank: int = 0) -> VllmEngine:
    """One vLLM engine on this process's GPU (or `generate.tensor_parallel_size` GPUs), seeded per rank."""
    from vllm import LLM  # GPU only

    from shared.target_model import TORCH_DTYPES

    llm = LLM(
        model=model_dir, dtype=TORCH_DTYPES[dtype], seed=engine_seed(seed, rank), tensor_parallel_size=cfg.tensor_parallel_size
    )
    return VllmEngine(llm, cfg, stop_ids, cfg.per_request_seeds)
