"""Targets larger than one GPU (issue 34, item 5): tensor parallelism through transformers' own TP
plans, proven on CPU with gloo ranks; the plan's weights per GPU and its refusal; the store's identity.

    .venv/bin/python -m pytest tests/test_tensor_parallel.py -q            # fast
    .venv/bin/python -m pytest tests/test_tensor_parallel.py -q -m slow    # 2 gloo ranks, TP 2 (~1 min)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shared.config import load_run_config
from shared.errors import ConfigError, StoreError
from shared.identity import store_header
from shared.reader import StoreReader
from shared.store import StoreFiles, read_manifest
from shared.target import TargetArch, resolve_target
from stage1_extract import commands, tensor_parallel
from stage1_extract.header import load_or_pin_plan
from stage1_extract.plan import extraction_memory
from stage1_extract.resolve import resolve_store
from stage1_extract.tensor_parallel import Layout, launch_problem, layout, tensor_parallel_problem
from testkit.data import chat_rows, stage1_overrides, write_jsonl
from tests.test_extract import json_objects  # the ranks' summaries, printed one after another

ROOT = Path(__file__).resolve().parents[1]
LLAMA_70B = TargetArch("llama", 8192, 28672, 80, 64, 8, 128, 128256, 1e-5, 5e5, 131072, False)


def test_ranks_form_groups_of_consecutive_ranks_that_share_windows_and_one_writes():
    groups = [layout(rank, 8, 4, local_world=8) for rank in range(8)]
    assert [(g.dp_rank, g.tp_rank, g.writes) for g in groups] == [
        (0, 0, True), (0, 1, False), (0, 2, False), (0, 3, False), (1, 0, True), (1, 1, False), (1, 2, False), (1, 3, False),
    ]
    assert {g.dp_size for g in groups} == {2}
    assert Layout(3, 4, 1).writes and Layout(3, 4, 1).dp_rank == 3  # no TP: every rank its own group
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 does not divide the 8 ranks of this job"):
        layout(0, 8, 3)
    with pytest.raises(ConfigError, match=r"does not divide the 2 processes per node: a TP group would span nodes"):
        layout(0, 4, 4, local_world=2)


def test_a_target_whose_heads_do_not_divide_is_refused_before_any_row_is_read(tiny_target_dir, tmp_path):
    smollm2 = TargetArch("llama", 576, 1536, 30, 9, 3, 64, 49152, 1e-5, 1e5, 8192, True)
    assert tensor_parallel_problem(smollm2, 2) == (
        "the target's attention heads 9, key/value heads 3 do not divide by extract.tensor_parallel_size=2"
    )
    assert tensor_parallel_problem(smollm2, 3) is None and tensor_parallel_problem(smollm2, 1) is None
    cfg = load_run_config("configs/default.yaml", stage1_overrides(
        tiny_target_dir, tmp_path / "none.jsonl", tmp_path / "run", **{"extract.tensor_parallel_size": 4}))
    with pytest.raises(ConfigError, match=r"key/value heads 2 do not divide by extract.tensor_parallel_size=4: choose a size"):
        resolve_store(cfg)


def test_a_tp_size_transformers_cannot_honour_is_refused_before_any_rank_joins_tokenizes_or_pins(
    tiny_target_dir, tmp_path, monkeypatch
):
    """transformers 5.x builds its TP mesh over the whole job: TP 2 on 4 processes is refused on every
    rank before it joins the process group, reads a row or pins plan.json (then TP 4 would be refused
    as a changed setting), and by `plan` for --gpus 4, naming the size that runs."""
    monkeypatch.setattr(tensor_parallel, "_spans_the_world", lambda: True)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    cfg = load_run_config("configs/default.yaml", stage1_overrides(
        tiny_target_dir, data, tmp_path / "run", **{"extract.tensor_parallel_size": 2}))
    for name, value in {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(commands, "join_ranks", lambda *a: pytest.fail("joined the process group"))
    monkeypatch.setattr(commands, "prepare_run", lambda *a, **k: pytest.fail("tokenized the rows"))
    expected = (r"^extract.tensor_parallel_size=2 with the 4 processes of this job: transformers .* so the size must be 1 or "
                r"the number of processes; set extract.tensor_parallel_size=4 .*launch 2 processes \(torchrun --nproc_per_node 2\)")
    with pytest.raises(ConfigError, match=expected):
        commands.cmd_extract(cfg, progress=False)
    assert not (tmp_path / "run" / "store" / "plan.json").exists()
    with pytest.raises(ConfigError, match=r"^extract.tensor_parallel_size=2 with plan --gpus 4: .* set extract.tensor_parallel_size=4"):
        commands.cmd_plan(cfg, gpu="h100", gpus=4)
    assert launch_problem(4, 4, "x") is None and launch_problem(1, 8, "x") is None


def test_the_plan_gives_the_weights_per_gpu_and_refuses_a_size_that_does_not_fit():
    """A Llama-3.1-70B (no weights here: its dense shape) needs 4 H100s per copy at the recipe's
    batch; at TP 1 the plan refuses naming the size that fits, and the split halves as it should."""
    def preset(tp: int = 1):
        return load_run_config("configs/llama-3.1-8b.yaml", [f"extract.tensor_parallel_size={tp}"])

    target = SimpleNamespace(target_dir=None, arch=LLAMA_70B, layer_ids=[1, 20, 39, 58, 77])
    embed = 128256 * 8192
    split = 80 * (8192 * 128 * (2 * 64 + 2 * 8) + 3 * 8192 * 28672) + 128256 * 8192  # layers and the LM head
    for tp in (4, 8):
        memory = extraction_memory(preset(tp), target, "h100")
        assert memory["weights_gib_per_gpu"] == pytest.approx((embed + split / tp) * 2 / 2**30, abs=0.01)
        assert memory["fits"] and memory["smallest_tensor_parallel_size"] == 4 and memory["gpu_memory_gib"] == 79.6
    with pytest.raises(ConfigError, match=r"extract.tensor_parallel_size=1: 131.\d GiB of weights per GPU \+ .* more than a "
                                          r"H100 SXM's 79.6 GiB; set extract.tensor_parallel_size=4"):
        extraction_memory(preset(), target, "h100")
    two = preset(2)
    with pytest.raises(ConfigError, match=r"set extract.tensor_parallel_size=4"):  # 66 GiB of weights + the batch
        extraction_memory(two, target, "h100")
    assert extraction_memory(two, target, "h200")["fits"]


def test_the_plan_counts_the_mask_a_packed_batch_gets_from_sdpa_or_eager():
    """extract.packed=on with sdpa (or eager) keeps the samples of a 65K-token batch apart with a
    [tokens, tokens] mask: 4 GiB of booleans and 8 GiB of sdpa's bf16 additive copy, and eager's scores
    per head besides. The plan counted none of it and called fitting what the first batch ran out of."""
    target = SimpleNamespace(target_dir=None, arch=LLAMA_70B, layer_ids=[1, 20, 39, 58, 77])

    def memory(*overrides: str):
        return extraction_memory(load_run_config("configs/llama-3.1-8b.yaml", ["extract.tensor_parallel_size=8", *overrides]),
                                 target, "h200")

    flash = memory("extract.packed=on", "target.attn_implementation=flash_attention_2")
    sdpa = memory("extract.packed=on", "target.attn_implementation=sdpa")
    assert memory("extract.packed=off", "target.attn_implementation=sdpa")["working_set_gib"] == flash["working_set_gib"]
    assert sdpa["working_set_gib"] - flash["working_set_gib"] == pytest.approx(65536**2 * 3 / 2**30, abs=0.01)
    assert "[tokens, tokens] sdpa mask" in sdpa["basis"]
    with pytest.raises(ConfigError, match=r"GiB working set"):  # 8 heads per GPU x 65536^2 scores in bf16 and fp32
        memory("extract.packed=on", "target.attn_implementation=eager")


def test_the_plan_counts_the_weights_in_the_safetensors_headers(tiny_target_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    cfg = load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, data, tmp_path / "run"))
    out = commands.cmd_plan(cfg, gpu="l40s", gpus=1)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_target_dir).parameters())  # tied head: once
    assert out["gpu_memory"]["weights_gib_per_gpu"] == round(params * 4 / 2**30, 2)  # target.dtype=fp32
    assert "tensors in the safetensors headers" in out["gpu_memory"]["basis"] and out["gpu_memory"]["fits"]


def test_the_tp_size_is_not_identity_so_train_reads_a_tp_store_as_current(tiny_target_dir, tmp_path):
    """A TP forward differs from one GPU's in the last bits only, as another batch shape does. Were the
    size identity, `train` with the config file alone (the size given on extract's command line)
    would call the store stale and send its user to re-extract a 70B target on one GPU."""
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6))

    def cfg(tp):
        return load_run_config("configs/default.yaml", stage1_overrides(
            tiny_target_dir, data, tmp_path / "run", **{"extract.tensor_parallel_size": tp}))

    target = resolve_target(cfg(1).target)
    assert store_header(cfg(1), target) == store_header(cfg(2), target)
    commands.cmd_extract(cfg(1), progress=False)
    report = commands.shard_report(cfg(2))
    assert report["settings_changed"] == [] and report["counts"]["stale"] == 0 and report["counts"]["current"] >= 1
    manifest = json.loads((tmp_path / "run" / "store" / "manifest.json").read_text())
    assert {r["batching"]["tensor_parallel_size"] for r in manifest["shards"]} == {1}  # which size made each shard
    # a store pinned while the size was identity (above 1) keeps it, so its keys stay what they were
    pinned = {**store_header(cfg(1), target)["extraction"], "tensor_parallel_size": 2}
    assert store_header(cfg(1), target, pinned=pinned)["extraction"]["tensor_parallel_size"] == 2


@pytest.mark.parametrize(("field", "made", "now", "setting", "shown"), [
    ("packed", True, False, "extract.packed", "on"),
    ("tensor_parallel_size", 2, None, "extract.tensor_parallel_size", 2),  # a store pinned while it was identity
])
def test_a_changed_setting_names_the_value_that_continues_the_store_before_reprocess(tmp_path, field, made, now, setting, shown):
    """Setting it back (no re-extraction) comes first; an absent TP size is the default (1), never None."""
    files = StoreFiles(str(tmp_path / "store"))

    def header(value):
        return {"extraction": {"compute_dtype": "fp32", **({field: value} if value is not None else {})}}

    load_or_pin_plan(files, header(made), 10, 100)
    with pytest.raises(StoreError, match=(
        rf"/plan.json: this store was started with {setting}={shown} \(extraction.{field}\), "
        rf"the config now gives {False if now is False else 1}: set {setting}={shown} to continue this store, or run "
        rf"`python -m stage1_extract reprocess` to re-extract its shards with the new value, or use another store.path$"
    )):
        load_or_pin_plan(files, header(now), 0, 100)


def tiny_qwen3(out: Path) -> Path:
    """A Qwen3 whose heads split 2 ways (4 heads, 2 KV heads; untied head), SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, Qwen3Config

    from testkit.target import build_random_target
    from testkit.target import tokenizer_dir as test_tokenizer

    tokenizer_dir = test_tokenizer()
    config = Qwen3Config(vocab_size=len(AutoTokenizer.from_pretrained(tokenizer_dir)), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    build_random_target(out, config, tokenizer_dir, "cpu")
    return out


@pytest.mark.slow
@pytest.mark.device
def test_two_ranks_split_a_qwen3_target_and_store_what_one_process_stores(tmp_path, device):
    """torchrun, 2 ranks (CPU ranks over gloo; 2 GPUs over NCCL under `--device cuda`),
    extract.tensor_parallel_size=2: one TP group loads the target split by Qwen3's own plan, rank 0
    writes; every sample's features equal a single process's within rounding (the row-parallel sums
    run in another order), the ids and masks exactly, and the store verifies."""
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip(f"tensor-parallel extraction needs 2 GPUs; this machine has {torch.cuda.device_count()}")
    target = tiny_qwen3(tmp_path / "qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(12))
    base = {"target.dtype": "fp32", "target.attn_implementation": "sdpa", "extract.packed": "off", "extract.device": device.type}
    single = stage1_overrides(target, data, tmp_path / "one", **base)
    split = stage1_overrides(target, data, tmp_path / "two", **base, **{"extract.tensor_parallel_size": 2})
    commands.cmd_extract(load_run_config("configs/default.yaml", single), progress=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "stage1_extract", "extract", "--json", "--no-progress", *split]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = {r["rank"]: r for r in json_objects(done.stdout)}
    assert ranks[0]["tensor_parallel"] == {"size": 2, "group": 0, "groups": 1, "writes": True}
    # What each rank's writer wrote: rank 1 made none (both would write the same files if it did).
    assert ranks[1]["tensor_parallel"]["writes"] is False and ranks[1]["shards_extracted_here"] == 0
    assert ranks[0]["shards_extracted_here"] == ranks[0]["shards_total"] >= 1

    one, two = StoreReader(str(tmp_path / "one" / "store")), StoreReader(str(tmp_path / "two" / "store"))
    # the same identity (a TP forward differs in the last bits only); each part record names its size
    assert read_manifest(two.url)["extraction"] == read_manifest(one.url)["extraction"]
    assert {r["batching"]["tensor_parallel_size"] for r in read_manifest(two.url)["shards"]} == {2}
    assert len(one) == len(two) == 12 and one.sample_ids.tolist() == two.sample_ids.tolist()
    worst, scale = 0.0, 1.0
    if device.type == "cuda":
        scale = max(float(one[i]["hidden_TLH"].float().abs().max()) for i in range(len(one)))
    for i in range(len(one)):
        a, b = one[i], two[i]
        assert torch.equal(a["input_ids_T"], b["input_ids_T"]) and torch.equal(a["loss_mask_T"], b["loss_mask_T"])
        worst = max(worst, float((a["hidden_TLH"].float() - b["hidden_TLH"].float()).abs().max() / scale))
        torch.testing.assert_close(b["topk_logprobs_TK"], a["topk_logprobs_TK"], rtol=0, atol=1e-2)  # one fp16 step below 16
        assert (a["topk_ids_TK"] == b["topk_ids_TK"]).float().mean() > 0.99  # near-ties may swap
    # fp32 values that differ in their last bits, stored as bf16: a step of bf16 at most (measured 2.4e-4);
    # on GPUs, relative to the largest value, as cuBLAS may sum in TF32.
    assert worst <= (0.05 if device.type == "cuda" else 1e-3)
    verified = commands.cmd_verify(load_run_config("configs/default.yaml", split), progress=False)
    assert verified["ok"] and not verified["bad_shards"]

    # A damaged shard: one process refuses to repair it (tests/test_reprocess.py); the command it
    # names, verify --repair under torchrun, extracts it again split 2 ways, and the store verifies.
    name = read_manifest(two.url)["shards"][0]["name"]
    (chunk,) = [p for p in (Path(two.url) / "shards" / name / "hidden").rglob("*") if p.is_file() and "c" in p.parts]
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    repair = [*command[:-len(split) - 3], "verify", "--repair", "--json", "--no-progress", *split]
    done = subprocess.run(repair, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = {r.get("rank", 0): r for r in json_objects(done.stdout)}
    assert ranks[0]["ok"] and ranks[0]["reextracted"] == [name]
    assert ranks[1]["extract"]["shards_extracted_here"] == 0 and ranks[0]["shards_checked"] >= 1
