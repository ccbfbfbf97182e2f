"""Stage 1 extraction: layer capture, top-k, store contents, resume, multi-process, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.config import load_run_config
from shared.errors import DataError, StoreError
from shared.reader import StoreReader
from shared.store import read_manifest, read_shard_arrays
from shared.target_model import LayerCapture
from shared.token_cache import source_fingerprint
from stage1_extract import commands
from stage1_extract import extract as extract_mod
from stage1_extract import writer as writer_mod
from stage1_extract.resolve import prepare_run

from .conftest import chat_rows, stage1_overrides, write_jsonl

ROOT = Path(__file__).resolve().parent.parent
LAYERS = [1, 2, 3]  # the DFlash rule on the 6-layer tiny target with 3 feature layers


def config(tiny_target_dir, data, run_dir, **extra):
    return load_run_config(ROOT / "configs/default.yaml", stage1_overrides(tiny_target_dir, data, run_dir, **extra))


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", chat_rows(30))


@pytest.fixture(scope="module")
def store(tiny_target_dir, data_file, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    cfg = config(tiny_target_dir, data_file, run_dir)
    summary = commands.cmd_extract(cfg, progress=False)
    return cfg, summary, StoreReader(cfg.store.url(cfg.run_dir))


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()


def test_layer_capture_equals_hf_hidden_states_plus_one(target):
    ids_1T = torch.randint(0, 1000, (1, 20))
    capture = LayerCapture(target, [0, 2, 4, 5])
    with torch.inference_mode():
        out = target(ids_1T, output_hidden_states=True)
    captured_1TLH = capture.stacked()
    capture.close()
    for j, layer in enumerate([0, 2, 4]):
        # The output of decoder layer i is HF hidden_states[i + 1] (index i would be off by one).
        torch.testing.assert_close(captured_1TLH[0, :, j], out.hidden_states[layer + 1][0], rtol=0, atol=0)
        assert not torch.allclose(captured_1TLH[0, :, j], out.hidden_states[layer][0])
    # HF's last entry is after the final norm, not the last layer's output: the hooks are right there too.
    with torch.inference_mode():
        normed_TH = target.model.norm(captured_1TLH[0, :, 3])
    torch.testing.assert_close(normed_TH, out.hidden_states[6][0])
    assert not torch.allclose(captured_1TLH[0, :, 3], out.hidden_states[6][0])


def test_store_sample_equals_a_direct_forward(store, target, tiny_target_dir):
    cfg, _, reader = store
    prepared = prepare_run(cfg)
    rows = {r.sample_id: r for r in prepared.rows}
    for index in (0, 7, len(reader) - 1):
        sample = reader[index]
        row = rows[sample["sample_id"]]
        np.testing.assert_array_equal(sample["input_ids_T"].numpy(), row.input_ids)
        np.testing.assert_array_equal(sample["loss_mask_T"].numpy(), row.loss_mask)
        with torch.inference_mode():
            out = target(torch.from_numpy(row.input_ids.astype(np.int64))[None], output_hidden_states=True)
        expected_TLH = torch.stack([out.hidden_states[i + 1][0] for i in LAYERS], dim=1)
        torch.testing.assert_close(sample["hidden_TLH"], expected_TLH.to(torch.bfloat16), rtol=0, atol=0)
        full_TV = torch.log_softmax(out.logits[0].float(), dim=-1)
        top = torch.topk(full_TV, 8, dim=-1)
        # Top-k of the full log-softmax (after the final norm and LM head), stored in float16.
        # Stored as logits - logsumexp (no second vocab-wide tensor): equal to log_softmax up to fp32
        # rounding, so at most one fp16 step apart once stored.
        torch.testing.assert_close(sample["topk_logprobs_TK"], top.values.half().float(), rtol=2**-10, atol=0)
        assert torch.equal(sample["topk_ids_TK"], top.indices)


def test_manifest_records_what_made_the_store(store, tiny_target_dir):
    cfg, summary, reader = store
    manifest = reader.manifest
    assert manifest["schema_version"] == 1
    assert manifest["layer_ids"] == LAYERS and manifest["top_k"] == 8
    assert "path" not in manifest["target"] and manifest["target_source"]["path"] == str(tiny_target_dir)
    assert manifest["identity_version"] == 7 and manifest["data"]["source_sha256"] == source_fingerprint(Path(cfg.data.path))
    # data.regenerate=false: the split keys samples on their opening, and nothing was generated to count
    assert manifest["split_key"] == "opening" and "generate" not in manifest["data"] and manifest["data"]["rows_read"] == 30
    assert len(manifest["target"]["weights_sha256"]) == 64
    assert len(manifest["tokenizer_sha256"]) == 64 and len(manifest["chat_template_sha256"]) == 64
    assert len(manifest["target"]["config_sha256"]) == 64 and len(manifest["tokenizer_probe_sha256"]) == 64
    assert manifest["data"]["row_settings"] == {"on_bad_row": "raise", "max_samples": None, "format": "auto"}
    assert manifest["storage"] == {"dtype": "bf16", "compression": "zstd", "zstd_level": 3, "chunk_tokens": 1024}
    assert manifest["num_samples"] == 30 == len(reader)
    assert manifest["num_tokens"] == int(reader.lengths.sum()) == summary["tokens"]
    assert sorted(reader.sample_ids.tolist()) == list(range(30))
    for record in manifest["shards"]:
        assert record["sample_end"] - record["sample_start"] == record["num_samples"]
        assert record["bytes"] > 0 and len(record["checksum"]) == 64 and len(record["rows_sha256"]) == 64
    assert len(manifest["shards"]) == summary["shards_total"] >= 2


def test_padding_is_never_stored(store):
    _, _, reader = store
    for record in reader.manifest["shards"]:
        arrays = read_shard_arrays(reader.url, record["name"])
        assert arrays["hidden"].shape[0] == record["num_tokens"] == arrays["offsets"][-1]
        assert list(np.diff(arrays["offsets"])) == record["lengths"]


def test_part_records_count_each_samples_anchor_positions(store):
    """The trainer's block budget counts each sample's blocks from `supervised_pairs` (positions t with
    loss_mask[t] and loss_mask[t + 1]), recorded at extraction so no rank reads a loss mask for it."""
    _, _, reader = store
    for record in reader.manifest["shards"]:
        arrays = read_shard_arrays(reader.url, record["name"])
        offsets = arrays["offsets"]
        masks = [arrays["loss_mask"][a:b] for a, b in zip(offsets[:-1], offsets[1:])]
        assert record["supervised_pairs"] == [int((m[:-1] & m[1:]).sum()) for m in masks]
    assert reader.supervised_pairs().sum() > 0


def test_rerun_is_a_no_op_and_status_is_complete(store):
    cfg, _, reader = store
    before = read_manifest(reader.url)["shards"]
    summary = commands.cmd_extract(cfg, progress=False)
    assert summary["shards_already_done"] == summary["shards_total"] and summary["shards_extracted_here"] == 0
    assert read_manifest(reader.url)["shards"] == before
    status = commands.cmd_status(cfg)
    assert status["complete"] and status["shards_done"] == status["shards_total"]
    assert commands.cmd_verify(cfg)["ok"]


def store_contents(url: str) -> list:
    manifest = read_manifest(url)
    return [(r["name"], r["checksum"], r["sample_ids"]) for r in manifest["shards"]]


def test_crash_then_resume_equals_an_uninterrupted_run(tiny_target_dir, data_file, tmp_path, store, monkeypatch):
    cfg = config(tiny_target_dir, data_file, tmp_path)
    real_write = writer_mod.write_shard
    calls = []

    def failing_write(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated crash mid-run")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(writer_mod, "write_shard", failing_write)
    with pytest.raises(RuntimeError, match="simulated crash"):
        commands.cmd_extract(cfg, progress=False)
    assert not (tmp_path / "store" / "manifest.json").exists()
    assert commands.cmd_status(cfg)["shards_done"] == 1
    monkeypatch.setattr(writer_mod, "write_shard", real_write)
    summary = commands.cmd_extract(cfg, progress=False)
    assert summary["shards_already_done"] == 1
    assert store_contents(cfg.store.url(cfg.run_dir)) == store_contents(store[2].url)


def test_out_of_memory_continues_with_a_smaller_batch_each_shard_as_a_clean_run_makes_it(
    tiny_target_dir, data_file, tmp_path, store, monkeypatch
):
    """An 8B extraction ran out of memory mid-store: the same command with a smaller extract.batch_tokens
    continues it. The batch shape is no part of the store's identity: the shards already done stay,
    the rest are made with the smaller batch, each exactly as a clean run with its batch makes it,
    and each shard's record says which batch made it."""
    cfg = config(tiny_target_dir, data_file, tmp_path / "run")
    second = read_manifest(store[2].url)["shards"][1]["sample_start"]
    parts = tmp_path / "run" / "store" / "parts"
    real_forward = extract_mod.forward_batch

    def out_of_memory_in_shard_1(model, capture, rows, *args):
        if any(r.sample_id >= second for r in rows):
            deadline = time.monotonic() + 60  # shard 0 is written in the background: let it land first
            while not (parts / "shard-000000.json").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_forward(model, capture, rows, *args)

    monkeypatch.setattr(extract_mod, "forward_batch", out_of_memory_in_shard_1)
    with pytest.raises(torch.OutOfMemoryError):
        commands.cmd_extract(cfg, progress=False)
    monkeypatch.setattr(extract_mod, "forward_batch", real_forward)
    smaller = config(tiny_target_dir, data_file, tmp_path / "run", **{"extract.batch_tokens": 64})
    summary = commands.cmd_extract(smaller, progress=False)
    assert summary["shards_already_done"] == 1 and summary["shards_extracted_here"] == summary["shards_total"] - 1
    clean_small = config(tiny_target_dir, data_file, tmp_path / "clean", **{"extract.batch_tokens": 64})
    commands.cmd_extract(clean_small, progress=False)
    continued = store_contents(smaller.store.url(smaller.run_dir))
    assert continued[:1] == store_contents(store[2].url)[:1]  # made with 512 tokens a batch, kept
    assert continued[1:] == store_contents(clean_small.store.url(clean_small.run_dir))[1:]
    records = read_manifest(smaller.store.url(smaller.run_dir))["shards"]
    assert [r["batching"]["batch_tokens"] for r in records] == [512] + [64] * (len(records) - 1)
    assert commands.cmd_status(cfg)["complete"] and commands.cmd_status(smaller)["complete"]
    assert commands.cmd_verify(smaller)["ok"]


@pytest.mark.slow  # 10-15 s: `make test-all`
def test_sigkill_mid_extraction_resumes_to_the_same_store(tiny_target_dir, data_file, tmp_path, store):
    overrides = stage1_overrides(tiny_target_dir, data_file, tmp_path, **{"extract.window_shards": 1})
    command = [sys.executable, "-m", "stage1_extract", "extract", "--json", "--no-progress", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    paused = tmp_path / "first-shard-written"
    hooked = {**env, "PYTHONPATH": f"{ROOT / 'tests' / 'hooks'}:{ROOT}", "DFLASH_PAUSE_AFTER_FIRST_SHARD": str(paused)}
    proc = subprocess.Popen(command, cwd=ROOT, env=hooked, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120  # the hook holds the process after one shard: no race with the end
    while not paused.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "extraction ended before its first shard"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "store" / "manifest.json").exists()
    assert len(list((tmp_path / "store" / "parts").iterdir())) >= 1
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
    assert store_contents(str(tmp_path / "store")) == store_contents(store[2].url)


def test_truncate_and_skip_are_counted(tiny_target_dir, tmp_path):
    rows = chat_rows(6) + [{"messages": [{"role": "user", "content": "long"}, {"role": "assistant", "content": "word " * 400}]}]
    rows[2]["messages"] = [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}, *rows[2]["messages"]]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = config(tiny_target_dir, data, tmp_path / "t", **{"data.max_length": 128})
    summary = commands.cmd_extract(cfg, progress=False)
    manifest = read_manifest(cfg.store.url(cfg.run_dir))
    assert (manifest["num_truncated"], manifest["num_skipped"], manifest["num_samples"]) == (1, 0, 7)
    assert manifest["num_empty_turns"] == summary["num_empty_turns"] == 1  # an empty answer is counted
    assert StoreReader(cfg.store.url(cfg.run_dir)).lengths.max() == 128
    cfg = config(tiny_target_dir, data, tmp_path / "s", **{"data.max_length": 128, "data.on_long": "skip"})
    commands.cmd_extract(cfg, progress=False)
    manifest = read_manifest(cfg.store.url(cfg.run_dir))
    assert (manifest["num_truncated"], manifest["num_skipped"], manifest["num_samples"]) == (0, 1, 6)
    assert 6 not in StoreReader(cfg.store.url(cfg.run_dir)).sample_ids.tolist()


def test_non_finite_features_name_the_sample(tiny_target_dir, data_file, tmp_path, monkeypatch):
    real_forward = extract_mod.forward_batch

    def poisoned(model, capture, rows, *args):
        outputs = [tuple(t.clone() for t in out) for out in real_forward(model, capture, rows, *args)]
        for row, out in zip(rows, outputs):
            if row.sample_id == 11:
                out[0][3, 0, 0] = float("nan")
        return outputs

    monkeypatch.setattr(extract_mod, "forward_batch", poisoned)
    cfg = config(tiny_target_dir, data_file, tmp_path)
    with pytest.raises(DataError, match=r"sample 11: 1 non-finite values \(NaN/inf\) in hidden"):
        commands.cmd_extract(cfg, progress=False)


def disk_full_at_the_second_shard(monkeypatch) -> None:
    real_write = writer_mod.write_shard
    calls = []

    def disk_full(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(writer_mod, "write_shard", disk_full)


def test_full_disk_keeps_earlier_shards(tiny_target_dir, data_file, tmp_path, monkeypatch):
    disk_full_at_the_second_shard(monkeypatch)
    cfg = config(tiny_target_dir, data_file, tmp_path)
    with pytest.raises(StoreError, match=r"No space left on device.*intact, rerun `python -m stage1_extract extract` after freeing space"):
        commands.cmd_extract(cfg, progress=False)
    assert commands.cmd_status(cfg)["shards_done"] == 1


def test_plan_refuses_a_store_that_will_not_fit(tiny_target_dir, data_file, tmp_path, monkeypatch):
    from shared.store import StoreFiles

    monkeypatch.setattr(StoreFiles, "free_bytes", lambda self: 1000)
    cfg = config(tiny_target_dir, data_file, tmp_path)
    plan = commands.cmd_plan(cfg)
    assert plan["fits"] is False and plan["tokens"] > 0 and plan["bytes_per_token"] == 3 * 64 * 2 + 8 * 6 + 5
    with pytest.raises(StoreError, match=r"still needs about 1.13 MiB \(2 of 2 shards left\) but .* has 1000 B free.*--force"):
        commands.cmd_extract(cfg, progress=False)
    assert commands.cmd_extract(cfg, force=True, progress=False)["num_samples"] == 30


def test_after_a_full_disk_only_the_shards_left_must_fit(tiny_target_dir, data_file, tmp_path, monkeypatch):
    """extract --force hit a full disk after one shard; space was freed for the rest, not for all:
    a plain extract now goes on (it used to count every shard and refuse)."""
    from shared.store import StoreFiles

    real_write = writer_mod.write_shard
    disk_full_at_the_second_shard(monkeypatch)
    cfg = config(tiny_target_dir, data_file, tmp_path)
    plan = commands.cmd_plan(cfg)
    with pytest.raises(StoreError, match="No space left"):
        commands.cmd_extract(cfg, force=True, progress=False)
    monkeypatch.setattr(writer_mod, "write_shard", real_write)
    status = commands.cmd_status(cfg)
    assert status["shards_done"] == 1
    left = (status["tokens_total"] - status["tokens_done"]) * plan["bytes_per_token"]
    monkeypatch.setattr(StoreFiles, "free_bytes", lambda self: left + 1)  # less than the whole store
    assert left + 1 < plan["total_bytes"]
    assert commands.cmd_extract(cfg, progress=False)["num_samples"] == 30


def test_changed_settings_are_refused_by_name(store, tiny_target_dir, data_file):
    cfg, _, _ = store
    changed = config(tiny_target_dir, data_file, Path(cfg.run_dir), **{"extract.top_k": 4})
    with pytest.raises(ValueError, match=r"started with extract.top_k=8 \(top_k\), the config now gives 4: set extract.top_k=8 "
                                         r"to continue this store, or run `python -m stage1_extract reprocess`"):
        commands.cmd_extract(changed, progress=False)


def test_fsspec_url_store(tiny_target_dir, data_file, tmp_path, store):
    url = f"memory://stores/{tmp_path.name}"
    cfg = config(tiny_target_dir, data_file, tmp_path, **{"store.path": url})
    commands.cmd_extract(cfg, progress=False)
    assert store_contents(url) == store_contents(store[2].url)
    reader = StoreReader(url)
    assert torch.equal(reader[3]["hidden_TLH"], store[2][3]["hidden_TLH"])
    assert commands.cmd_verify(cfg)["ok"]


def test_fp8_storage_halves_bytes_with_small_error(tiny_target_dir, data_file, tmp_path, store):
    cfg = config(tiny_target_dir, data_file, tmp_path, **{"store.dtype": "fp8", "store.compression": "none"})
    commands.cmd_extract(cfg, progress=False)
    fp8, bf16 = StoreReader(cfg.store.url(cfg.run_dir)), store[2]
    a, b = fp8[5]["hidden_TLH"].float(), bf16[5]["hidden_TLH"].float()
    relative = ((a - b).norm(dim=-1) / b.norm(dim=-1)).max()
    assert relative < 0.06  # e4m3 keeps 3 mantissa bits; per-token scale keeps the range
    assert torch.equal(fp8[5]["topk_ids_TK"], bf16[5]["topk_ids_TK"])


def json_objects(text: str) -> list[dict]:
    """Every JSON object printed one after another (the ranks' summaries, in either order)."""
    decoder, objects, pos = json.JSONDecoder(), [], 0
    while (start := text.find("{", pos)) >= 0:
        obj, pos = decoder.raw_decode(text, start)
        objects.append(obj)
    return objects


@pytest.mark.slow  # 10-15 s: `make test-all`
def test_two_processes_split_shards_and_equal_one_process(tiny_target_dir, data_file, tmp_path, store):
    overrides = stage1_overrides(tiny_target_dir, data_file, tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "stage1_extract", "extract", "--json", "--no-progress", *overrides,
    ]
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    ranks = json_objects(out.stdout)
    assert sorted(r["rank"] for r in ranks) == [0, 1], repr(out.stdout)
    assert all(r["shards_extracted_here"] >= 1 for r in ranks)
    assert store_contents(str(tmp_path / "store")) == store_contents(store[2].url)


@pytest.mark.slow  # 10-15 s: `make test-all`
def test_bad_input_under_two_processes_fails_on_every_rank_naming_the_row(tiny_target_dir, tmp_path):
    """Rank 0 tokenizes first while the others wait; its error must not leave them waiting."""
    rows = chat_rows(12)
    rows[9] = {"messages": [{"role": "robot", "content": "beep"}]}
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "stage1_extract", "extract", "--json", "--no-progress", *stage1_overrides(tiny_target_dir, data, tmp_path / "run"),
    ]
    out = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0  # and within the timeout: no rank is left waiting at the barrier
    assert "bad.jsonl: row 9: messages[0] has unknown role" in out.stderr, out.stderr[-2000:]


@pytest.mark.device
@pytest.mark.parametrize("attn", ["sdpa", "eager", "flash_attention_2"])
def test_packed_extraction_equals_padded_extraction(tiny_target_dir, attn, device):
    """Samples of different lengths in one packed batch never attend to each other: hidden states
    and top-k log-probs equal the padded path's (a KV cache turns transformers' packed-sequence
    detection off, so the decoder must run without one). On a GPU (`--device cuda`) in bf16 as
    extraction runs there, with longer samples, and flash-attn's varlen kernel where it is installed."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    from stage1_extract.batching import TokenizedRow
    from stage1_extract.forward import forward_batch

    cuda = device.type == "cuda"
    if attn == "flash_attention_2" and not (cuda and importlib.util.find_spec("flash_attn")):
        pytest.skip("flash-attn: needs CUDA and the gpu extra (CPU: the next test, with a stand-in for its varlen kernel)")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=dtype, attn_implementation=attn).to(device).eval()
    generator = torch.Generator().manual_seed(0)
    lengths = [37, 211, 512, 1024, 90, 700, 1500, 333] if cuda else [5, 17, 9, 30]
    rows = [
        TokenizedRow(sample_id=i, row_hash="", input_ids=torch.randint(0, 1000, (n,), generator=generator).numpy().astype(np.int32), loss_mask=np.ones(n, bool))
        for i, n in enumerate(lengths)
    ]
    capture = LayerCapture(model, LAYERS)
    chunk = 1024 if cuda else 16  # the LM head in chunks of this many tokens
    padded = forward_batch(model, capture, rows, top_k=8, chunk=chunk, packed=False)
    packed = forward_batch(model, capture, rows, top_k=8, chunk=chunk, packed=True)
    capture.close()
    for (hidden_p, values_p, ids_p), (hidden_q, values_q, ids_q), row in zip(padded, packed, rows):
        assert hidden_q.shape == (len(row.input_ids), len(LAYERS), 64)
        if not cuda:
            torch.testing.assert_close(hidden_q, hidden_p, rtol=0, atol=1e-5)
            torch.testing.assert_close(values_q, values_p, rtol=0, atol=1e-5)
            assert torch.equal(ids_q, ids_p)
            continue
        # bf16 through every layer, summed in another order: rounding, never another sample's tokens
        rel = float((hidden_q.float() - hidden_p.float()).abs().max() / hidden_p.float().abs().max())
        assert rel <= 0.05, (len(row.input_ids), rel)
        assert float((values_q.float() - values_p.float()).abs().max()) <= 0.25  # the random target's ids tie: not compared


def test_packed_flash_attention_gets_the_sequence_boundaries_once_per_forward(tiny_target_dir):
    """Under flash-attn a packed batch hands every layer its samples' boundaries (transformers'
    varlen kwargs: cu_seq_lens as int32, the longest length as an int), so no layer derives them from
    the position ids (a few host syncs per layer). Shown with a stand-in for flash-attn's varlen kernel
    (CPU has none): each layer sees the boundaries, and the store's features equal the padded path's."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from stage1_extract.batching import TokenizedRow
    from stage1_extract.forward import forward_batch

    seen = []

    def varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
        seen.append((cu, longest, kwargs.get("cu_seq_lens_k"), kwargs.get("max_length_k")))
        assert cu is not None and isinstance(longest, int), "the layer would derive the boundaries itself"
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        bounds = cu.tolist()
        out = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling)
               for a, b in zip(bounds[:-1], bounds[1:])]
        return torch.cat(out, dim=2).transpose(1, 2), None

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 17, 9, 30]
    rows = [
        TokenizedRow(sample_id=i, row_hash="", input_ids=torch.randint(0, 1000, (n,), generator=generator).numpy().astype(np.int32), loss_mask=np.ones(n, bool))
        for i, n in enumerate(lengths)
    ]
    capture = LayerCapture(model, LAYERS)
    padded = forward_batch(model, capture, rows, top_k=8, chunk=16, packed=False)
    ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = varlen_attention
    try:
        model.config._attn_implementation = "flash_attention_2"
        packed = forward_batch(model, capture, rows, top_k=8, chunk=16, packed=True)
    finally:
        model.config._attn_implementation = "sdpa"
        del ALL_ATTENTION_FUNCTIONS._local_mapping["flash_attention_2"]
        capture.close()
    assert len(seen) == model.config.num_hidden_layers  # every layer, one forward
    for cu_q, longest, cu_k, longest_k in seen:
        assert cu_q.dtype == torch.int32 and cu_q.tolist() == [0, 5, 22, 31, 61] and cu_k is cu_q
        assert longest == longest_k == 30
    for (hidden_p, values_p, ids_p), (hidden_q, values_q, ids_q) in zip(padded, packed):
        torch.testing.assert_close(hidden_q, hidden_p, rtol=0, atol=1e-5)
        torch.testing.assert_close(values_q, values_p, rtol=0, atol=1e-5)
        assert torch.equal(ids_q, ids_p)


def test_packed_extraction_is_refused_where_the_attention_cannot_keep_samples_apart(tiny_target_dir, data_file, tmp_path, monkeypatch):
    """Refused by name before any row is read or the target loads; sdpa and eager honour packing."""
    import transformers.masking_utils

    from shared.errors import ConfigError
    from stage1_extract import forward

    for attn in ("sdpa", "eager"):
        cfg = config(tiny_target_dir, data_file, tmp_path / attn, **{"extract.packed": "on", "target.attn_implementation": attn})
        assert prepare_run(cfg).header["extraction"]["packed"] is True
    monkeypatch.setattr(forward, "MASK_PACKING", ("eager",))  # an attention that builds no packed mask
    cfg = config(tiny_target_dir, data_file, tmp_path / "sdpa", **{"extract.packed": "on", "target.attn_implementation": "sdpa"})
    with pytest.raises(ConfigError, match=r"extract\.packed=on with target\.attn_implementation=sdpa: attention 'sdpa' takes no packed-sequence mask, .* set extract\.packed=off"):
        commands.cmd_plan(cfg)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"the 'mamba' model builds its attention mask without"):
        forward.check_packing("sdpa", "mamba")
    forward.check_packing("flash_attention_2", "llama")  # flash-attn's varlen path reads the position ids
    monkeypatch.delattr(transformers.masking_utils, "find_packed_sequence_indices")  # an older transformers
    with pytest.raises(ConfigError, match=r"cannot detect packed sequences"):
        commands.cmd_extract(cfg, progress=False)


def pin_plan_on_rank(rank: int, port: int, target_dir: str, data: str, run_dir: str, out: str) -> None:
    """Rank 1 cannot see plan.json (NFS attribute caching on another node) when it asks for the plan."""
    import torch.distributed as dist

    from shared.store import StoreFiles
    from stage1_extract import distributed
    from stage1_extract.resolve import prepare_run

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    distributed._work_group = dist.new_group(backend="gloo")
    try:
        cfg = config(Path(target_dir), Path(data), Path(run_dir))
        prepared = None
        for turn in (0, 1):  # rank 0 tokenizes (and caches) first, as _prepare_all_ranks does
            if turn == rank:
                prepared = prepare_run(cfg)
            dist.barrier()
        if rank == 1:
            real = StoreFiles.exists
            StoreFiles.exists = lambda self, name: False if name == "plan.json" else real(self, name)
        shards, per, _, _ = commands._pin_plan(cfg, prepared, rank, 2, False, rank)
        dist.barrier()
        Path(out, f"rank{rank}.json").write_text(json.dumps({"per": per, "shards": len(shards)}))
    finally:
        distributed._work_group = None
        dist.destroy_process_group()


@pytest.mark.slow  # ~10 s: two gloo ranks tokenize the data
def test_a_rank_that_cannot_see_the_plan_yet_gets_rank_0s_and_writes_none(tiny_target_dir, data_file, tmp_path):
    """Every rank asked plan.json for samples_per_shard itself: one that could not see it yet wrote a
    plan with 0 samples per shard over rank 0's (every later run then failed). Rank 0's reading reaches
    every rank; plan.json stays rank 0's."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "run"
    mp.spawn(pin_plan_on_rank, args=(port, str(tiny_target_dir), str(data_file), str(run_dir), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    plan = json.loads((run_dir / "store" / "plan.json").read_text())
    assert plan["samples_per_shard"] > 0 and ranks[0] == ranks[1] == {"per": plan["samples_per_shard"], "shards": ranks[0]["shards"]}


def channels_refused_on_rank(rank: int, port: int, target_dir: str, data: str, run_dir: str, out: str) -> None:
    """Rank 0 refuses the store's fp4 outlier channels (plan.json holds none, or another count) as the
    extraction starts; each rank writes what it raised."""
    from datetime import timedelta

    import torch.distributed as dist

    from stage1_extract import distributed
    from stage1_extract.resolve import prepare_run

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    distributed._work_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))  # a hang fails the test
    try:
        cfg = config(Path(target_dir), Path(data), Path(run_dir))
        prepared = None
        for turn in (0, 1):
            if turn == rank:
                prepared = prepare_run(cfg)
            dist.barrier()
        shards, per, _, _ = commands._pin_plan(cfg, prepared, rank, 2, False, rank)
        if rank == 0:
            def refuse(*_):
                raise StoreError("plan.json holds no fp4 outlier channels")

            commands.pinned_outlier_channels = refuse
        try:
            commands.extract_store(prepared, shards, per, cfg.store, cfg.extract, cfg.target, (rank, 2, rank),
                                   force=False, progress=False, prepare_seconds=0.0)
            outcome = "extracted"
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the test's answer
            outcome = f"{type(exc).__name__}: {exc}"
        Path(out, f"rank{rank}.txt").write_text(outcome)
    finally:
        distributed._work_group = None
        dist.destroy_process_group()


@pytest.mark.slow  # ~10 s: two gloo ranks tokenize the data
def test_rank_0_refusing_the_outlier_channels_stops_every_rank_at_once(tiny_target_dir, data_file, tmp_path):
    """Rank 0 alone read the fp4 outlier channels and broadcast them: when its reading raised, it left
    before the broadcast and the other ranks waited in it for WORK_TIMEOUT (6 hours). Its refusal is
    agreed first: rank 0 raises its own error, the others say rank 0 refused."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(channels_refused_on_rank, args=(port, str(tiny_target_dir), str(data_file), str(tmp_path / "run"), str(tmp_path)),
             nprocs=2, join=True)
    assert (tmp_path / "rank0.txt").read_text() == "StoreError: plan.json holds no fp4 outlier channels"
    assert (tmp_path / "rank1.txt").read_text().startswith("StoreError: ") and "rank 0 could not read the fp4 outlier channels" in (
        tmp_path / "rank1.txt").read_text()


def pin_plan_on_another_node(rank: int, port: int, target_dir: str, data: str, run_dir: str, out: str) -> None:
    """Rank 1's node resolves target.dtype=auto otherwise (a CPU with native bf16, as flash-attn
    importable on one GPU node and not another decides attention and packing); each rank writes
    what _pin_plan did."""
    from datetime import timedelta

    import torch.distributed as dist

    from shared import target_model
    from stage1_extract import distributed
    from stage1_extract.resolve import prepare_run

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    distributed._work_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))  # a hang fails the test
    try:
        if rank == 1:
            native = target_model.cpu_has_native_bf16()
            target_model.cpu_has_native_bf16 = lambda: not native
        cfg = config(Path(target_dir), Path(data), Path(run_dir), **{"target.dtype": "auto"})
        prepared = None
        for turn in (0, 1):
            if turn == rank:
                prepared = prepare_run(cfg)
            dist.barrier()
        try:
            commands._pin_plan(cfg, prepared, rank, 2, False, rank)
            outcome = f"pinned with {prepared.header['extraction']['compute_dtype']}"
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the test's answer
            outcome = f"{type(exc).__name__}: {exc}"
        Path(out, f"rank{rank}.txt").write_text(outcome)
    finally:
        distributed._work_group = None
        dist.destroy_process_group()


@pytest.mark.slow  # ~10 s: two gloo ranks tokenize the data
def test_a_rank_whose_node_resolves_other_settings_is_refused_before_it_extracts(tiny_target_dir, data_file, tmp_path):
    """Each rank resolved the store's auto settings on its own node and extracted its windows with
    them: a node without flash-attn (or native bf16) stored its shards under another header, found
    only by rank 0's merge after the whole extraction. Every rank now compares its header with rank
    0's and all refuse at once, naming the setting to pin."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(pin_plan_on_another_node, args=(port, str(tiny_target_dir), str(data_file), str(tmp_path / "run"), str(tmp_path)),
             nprocs=2, join=True)
    outcomes = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert outcomes[1].startswith("ConfigError: rank 1 resolved extraction.compute_dtype=") and "target.dtype" in outcomes[1]
    assert outcomes[0].startswith("ConfigError: ") and "another rank resolved other settings than rank 0" in outcomes[0]


def test_packed_extraction_of_a_target_whose_layers_carry_state_across_samples_is_refused(tmp_path, data_file):
    """Qwen3-Next's (and Qwen3.5's) gated DeltaNet layers take no packed mask: their state ran on from one
    packed sample into the next, and every sample after a batch's first was stored mixed with the ones
    before it (here ~100% off a forward of the sample alone). Refused before any shard is written;
    padded batches store each sample's own features."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from shared.errors import ConfigError
    from testkit.target import tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    hybrid = AutoConfig.for_model(
        "qwen3_next", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        initializer_range=0.2, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hybrid).eval()
    target = tmp_path / "hybrid"
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    packed = config(target, data_file, tmp_path / "packed", **{"extract.packed": "on", "target.attn_implementation": "sdpa",
                                                                "data.max_samples": 6})
    with pytest.raises(ConfigError, match=r"extract\.packed: the target \(Qwen3NextForCausalLM\) gives a packed sample other "
                                          r"features than the same sample alone .* set extract\.packed=off"):
        commands.cmd_extract(packed, progress=False)
    assert not list((Path(packed.store.url(packed.run_dir)) / "parts").glob("*.json"))
    padded = config(target, data_file, tmp_path / "padded", **{"extract.packed": "off", "data.max_samples": 6})
    commands.cmd_extract(padded, progress=False)
    reader = StoreReader(padded.store.url(padded.run_dir))
    for index in range(len(reader)):
        sample = reader[index]
        with torch.inference_mode():
            out = model(sample["input_ids_T"][None], output_hidden_states=True)
        expected_TLH = torch.stack([out.hidden_states[i + 1][0] for i in reader.manifest["layer_ids"]], dim=1)
        torch.testing.assert_close(sample["hidden_TLH"].float(), expected_TLH.bfloat16().float(), rtol=0.02, atol=0.02)
