"""Stage 1 on a GPU node, as far as CPU can show it: the rank's device, copies read only after they
land, a writer queue bounded in bytes, parallel shard writes, and a header that names every setting
that changes the stored bytes.

    .venv/bin/python -m pytest tests/test_extract_writer.py -q
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch

from shared.codecs import SampleFeatures
from shared.config import load_run_config
from shared.store import StoreConfig, StoreFiles
from stage1_extract import commands, distributed
from stage1_extract import extract as extract_mod
from stage1_extract import writer as writer_mod
from stage1_extract.batching import ShardPlan, TokenizedRow
from stage1_extract.writer import HostBatch, ShardWriter, host_bytes

from .conftest import chat_rows, stage1_overrides, write_jsonl

ROOT = Path(__file__).resolve().parent.parent


def rows_and_shards(num_shards: int, per_shard: int, tokens: int = 64) -> list[ShardPlan]:
    shards = []
    for s in range(num_shards):
        rows = [
            TokenizedRow(sample_id=s * per_shard + i, row_hash=f"{s}-{i}", input_ids=torch.arange(tokens).numpy(),
                         loss_mask=torch.ones(tokens, dtype=torch.bool).numpy())
            for i in range(per_shard)
        ]
        shards.append(ShardPlan(index=s, rows=rows, tag=f"t{s}", key="k"))
    return shards


def host_samples(shard: ShardPlan, layers: int = 2, hidden: int = 1024, k: int = 8) -> list[SampleFeatures]:
    out = []
    for row in shard.kept:
        T = len(row.input_ids)
        out.append(SampleFeatures(row.sample_id, row.input_ids, row.loss_mask, torch.randn(T, layers, hidden),
                                  torch.randn(T, k), torch.randint(0, 100, (T, k))))
    return out


def test_each_rank_makes_its_own_gpu_current(monkeypatch):
    """Rank k runs on cuda:k, made current before anything touches CUDA (else every default stream,
    and every "current stream" sync, is cuda:0's)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    assert distributed.rank_device("auto", 3) == "cuda:3" and calls == [3]
    assert distributed.rank_device("cuda:5", 0) == "cuda:5" and calls == [3, 5]
    assert distributed.rank_device("cpu", 3) == "cpu" and calls == [3, 5]


class FakeEvent:
    """Stands in for the CUDA event the loop records after a batch's copies."""

    def __init__(self):
        self.synchronized = False

    def synchronize(self):
        self.synchronized = True


class LandedSum:
    """A batch's value sum, which may be read only after the batch's event."""

    def __init__(self, event, value):
        self.event, self.value = event, value

    def __float__(self):
        assert self.event.synchronized, "a batch's value sum was read before its copies landed"
        return self.value


def test_the_writer_reads_a_batch_only_after_its_copies_have_landed(tmp_path, monkeypatch):
    """Every batch carries the event of its copies; nothing reads the host bytes, nor the batch's
    value sum, before waiting on it."""
    shards = rows_and_shards(2, 2)
    event_of: dict[int, FakeEvent] = {}
    real_encode = writer_mod.encode_sample

    def encode(sample, *args):
        assert event_of[sample.sample_id].synchronized, "a sample was read before its copies landed"
        return real_encode(sample, *args)

    monkeypatch.setattr(writer_mod, "encode_sample", encode)
    writer = ShardWriter(str(tmp_path / "store"), StoreConfig(compression="none"), shards, queue_mb=64)
    for shard in shards:
        event = FakeEvent()
        samples = host_samples(shard)
        event_of.update(dict.fromkeys((s.sample_id for s in samples), event))
        writer.put(HostBatch(samples, event, host_bytes(samples), LandedSum(event, 1.0)))
    stats = writer.finish()
    assert stats.shards_written == 2 and all(e.synchronized for e in event_of.values())
    assert stats.host_checked_batches == 0


def test_the_loop_hands_every_batch_its_ready_event(tiny_target_dir, tmp_path, monkeypatch):
    """run_shards records the event (to_host) and passes it with the batch: on CPU there is none to
    wait for, so the loop's own hand-off is checked with a stand-in for CUDA's."""
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6))
    cfg = load_run_config(ROOT / "configs/default.yaml", stage1_overrides(tiny_target_dir, data, tmp_path / "run"))
    made = []

    def to_host(outputs, device, value_sum):
        event = FakeEvent()
        made.append(event)
        return [tuple(t.cpu() for t in triple) for triple in outputs], event, LandedSum(event, float(value_sum))

    monkeypatch.setattr(extract_mod, "to_host", to_host)
    commands.cmd_extract(cfg, progress=False)
    assert made and all(e.synchronized for e in made)


def test_finiteness_is_one_device_sum_per_batch_never_a_host_scan(tiny_target_dir, tmp_path, monkeypatch):
    """The loop sums each batch's stored values on the device (one fp32 number, copied with the
    batch); the writer reads it after the batch's event and scans no value on the host while it is
    finite. A NaN still names its sample (tests/test_extract.py)."""
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6))
    cfg = load_run_config(ROOT / "configs/default.yaml", stage1_overrides(tiny_target_dir, data, tmp_path / "run"))
    scanned, sums = [], []
    real_sum = extract_mod.stored_value_sum

    def summed(outputs):
        total = real_sum(outputs)
        sums.append((total.shape, total.dtype, len(outputs)))
        return total

    monkeypatch.setattr(writer_mod, "check_finite", scanned.append)
    monkeypatch.setattr(extract_mod, "stored_value_sum", summed)
    commands.cmd_extract(cfg, progress=False)
    assert sums and all(shape == () and dtype == torch.float32 for shape, dtype, _ in sums)
    assert sum(n for _, _, n in sums) == 6 and scanned == []


def test_the_writer_queue_holds_two_forward_batches_of_the_target(tiny_target_dir, tmp_path, monkeypatch):
    """Left unset, extract.writer_queue_mb is two batches of host copies: 5.1 GiB at the 8B presets
    (65,536 tokens x (5 layers x 4,096 x bf16 + 64 x 8)), which the old 2 GiB default could not hold
    once; on the tiny target, what the loop hands the writer."""
    from stage1_extract.extract import ExtractConfig, host_token_bytes, writer_queue_mb

    preset = load_run_config(ROOT / "configs/qwen3-8b.yaml", [])
    assert preset.extract.writer_queue_mb is None and preset.extract.batch_tokens == 65536
    per_token = host_token_bytes(5, 4096, 2, preset.extract.top_k)
    assert per_token == 41472 and writer_queue_mb(preset.extract, per_token) == 5184  # MiB: 2 x 2.53 GiB
    assert writer_queue_mb(ExtractConfig(writer_queue_mb=300), per_token) == 300
    made = []
    real_writer = extract_mod.ShardWriter

    def writer(url, store_cfg, shards, queue_mb, *args):
        made.append(queue_mb)
        return real_writer(url, store_cfg, shards, queue_mb, *args)

    monkeypatch.setattr(extract_mod, "ShardWriter", writer)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6))
    cfg = load_run_config(ROOT / "configs/default.yaml", stage1_overrides(tiny_target_dir, data, tmp_path / "run"))
    commands.cmd_extract(cfg, progress=False)
    # 3 feature layers of the tiny target's 64 in fp32, top-8
    assert made == [math.ceil(2 * cfg.extract.batch_tokens * host_token_bytes(3, 64, 4, cfg.extract.top_k) / 2**20)]


def test_the_writer_queue_is_bounded_in_bytes(tmp_path, monkeypatch):
    """With the absorbing thread held, a batch that would pass writer_queue_mb waits in put(); one
    batch always fits even when it alone is larger than the bound."""
    shards = rows_and_shards(3, 1, tokens=256)
    release = threading.Event()
    real_encode = writer_mod.encode_sample

    def held_encode(sample, *args):
        release.wait()
        return real_encode(sample, *args)

    monkeypatch.setattr(writer_mod, "encode_sample", held_encode)
    batches = [host_samples(s, hidden=512) for s in shards]  # 256 x 2 x 512 x 4 B = 1 MiB + top-k each
    assert all(1 << 20 < host_bytes(b) < 2 << 20 for b in batches)
    writer = ShardWriter(str(tmp_path / "store"), StoreConfig(compression="none"), shards, queue_mb=2)
    writer.put(HostBatch(batches[0], None, host_bytes(batches[0])))  # alone over 1 MiB: accepted
    second = threading.Thread(target=writer.put, args=(HostBatch(batches[1], None, host_bytes(batches[1])),))
    second.start()
    second.join(timeout=0.3)
    assert second.is_alive(), "put() returned although the queue held more than writer_queue_mb"
    release.set()
    second.join()
    writer.put(HostBatch(batches[2], None, host_bytes(batches[2])))
    stats = writer.finish()
    assert stats.shards_written == 3 and stats.peak_queue_bytes <= (2 << 20) + host_bytes(batches[0])


def test_writer_threads_write_shards_in_parallel(tmp_path, monkeypatch):
    """Two writer threads hold two shards at once (a barrier of two would time out with one)."""
    shards = rows_and_shards(2, 1)
    both = threading.Barrier(2, timeout=20)
    real_write = writer_mod.write_shard

    def meeting_write(*args, **kwargs):
        both.wait()
        return real_write(*args, **kwargs)

    monkeypatch.setattr(writer_mod, "write_shard", meeting_write)
    writer = ShardWriter(str(tmp_path / "store"), StoreConfig(compression="none"), shards, queue_mb=64, threads=2)
    for shard in shards:
        samples = host_samples(shard)
        writer.put(HostBatch(samples, None, host_bytes(samples)))
    assert writer.finish().shards_written == 2
    assert sorted(StoreFiles(str(tmp_path / "store")).list("parts")) == ["shard-000000.json", "shard-000001.json"]


def test_status_names_the_compute_dtype_and_packing_that_made_a_shard_and_records_its_batch_shape(tiny_target_dir, tmp_path):
    """An fp32 store is not current for a bf16 config: status names the field. The batch shape is not
    identity (it changes a value in its last bits at most): each shard's record says which made it."""
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    run = tmp_path / "run"
    cfg = load_run_config(ROOT / "configs/default.yaml", stage1_overrides(tiny_target_dir, data, run))
    commands.cmd_extract(cfg, progress=False)
    manifest = StoreFiles(cfg.store.url(cfg.run_dir)).read_json("manifest.json")
    assert manifest["extraction"] == {"compute_dtype": "fp32", "attn_implementation": "sdpa", "packed": False}
    batching = {"batch_tokens": 512, "max_samples_per_batch": 64, "window_shards": 1, "lm_head_chunk_tokens": 2048,
                "tensor_parallel_size": 1}
    assert [r["batching"] for r in manifest["shards"]] == [batching] * len(manifest["shards"])
    changed = load_run_config(ROOT / "configs/default.yaml", [*stage1_overrides(tiny_target_dir, data, run), "target.dtype=bf16"])
    report = commands.cmd_status(changed)
    assert report["settings_changed"] == ["extraction.compute_dtype"]
    assert {r["state"] for r in report["shards"]} == {"stale"}
    assert all(r["why"] == "settings changed: extraction.compute_dtype" for r in report["shards"])
    with pytest.raises(Exception, match="extraction.compute_dtype"):
        commands.cmd_extract(changed, progress=False)
    other_batch = [*stage1_overrides(tiny_target_dir, data, run), "extract.batch_tokens=1024", "extract.window_shards=2"]
    assert commands.cmd_status(load_run_config(ROOT / "configs/default.yaml", other_batch))["complete"]


def test_writer_threads_unset_follow_the_device_and_the_ranks_share_of_the_cpus(monkeypatch):
    """Two threads cannot write an 8B store at an H100's pace (~64 MB/s each against ~1 GB/s of
    output): unset, a GPU rank takes its share of the node's CPUs less two, from 2 to 8; CPU keeps 2."""
    from stage1_extract.extract import ExtractConfig, writer_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(96)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert writer_threads(ExtractConfig(), "cuda") == 8  # 96 / 8 - 2 = 10, capped at 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert writer_threads(ExtractConfig(), "cuda") == 4
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert writer_threads(ExtractConfig(), "cuda") == 2
    assert writer_threads(ExtractConfig(), "cpu") == 2
    assert writer_threads(ExtractConfig(writer_threads=5), "cuda") == 5


@pytest.mark.device
def test_host_copies_read_after_their_event_equal_the_device_tensors(device):
    """What the writer reads after a batch's event equals what the forward made, the batch's
    finiteness sum included: on a GPU the copies are issued on the forward's own device and stream
    (cuda:1 when there are two GPUs, rank 1's case; else a side stream of cuda:0) and are pinned;
    on CPU they are plain copies and there is no event."""
    from contextlib import nullcontext

    from stage1_extract.extract import stored_value_sum, to_host

    cuda = device.type == "cuda"
    where = torch.device("cuda", 1) if cuda and torch.cuda.device_count() > 1 else device
    stream = torch.cuda.Stream(where) if cuda else None
    with torch.cuda.device(where) if cuda else nullcontext(), torch.cuda.stream(stream) if cuda else nullcontext():
        outputs = [tuple(torch.randn(4096, *shape, device=where) for shape in ((5, 1024), (64,), (64,))) for _ in range(8)]
        host, ready, value_sum = to_host(outputs, where, stored_value_sum(outputs))
        assert (ready is None) == (not cuda)
        if ready is not None:
            ready.synchronize()  # as the writer waits, before it reads a byte
        landed, read = float(value_sum), [[h.clone() for h in copies] for copies in host]  # what the writer reads
        if cuda:
            assert host[0][0].is_pinned()
            torch.cuda.synchronize(where)
    assert all(torch.equal(h, o.cpu()) for copies, made in zip(read, outputs) for h, o in zip(copies, made))
    expected = sum(float(t.double().sum()) for hidden, values, _ in outputs for t in (hidden, values))
    assert math.isclose(landed, expected, rel_tol=1e-4, abs_tol=1.0)


class StreamEvents:
    """CUDA timing events on one stream, as torch has them: done in record order, done only once the
    host waited for them (or for a later one), and `elapsed_time` raises for one still pending."""

    def __init__(self):
        self.recorded, self.done = 0, 0
        streams = self

        class Event:
            def __init__(self, enable_timing=False):
                self.seq = None

            def record(self, stream=None):
                streams.recorded += 1
                self.seq = streams.recorded

            def synchronize(self):
                streams.done = max(streams.done, self.seq)

            def query(self):
                return self.seq <= streams.done

            def elapsed_time(self, other):
                if not (self.query() and other.query()):
                    raise RuntimeError("Both events must be completed before calculating elapsed time.")
                return 1.0

        self.Event = Event


def test_a_tensor_parallel_rank_that_does_not_write_reads_its_forward_time_after_its_last_batch(monkeypatch):
    """On a TP group's ranks that do not write, no writer waits on the batches: the timer read its
    events while the last forward still ran, and `elapsed_time` raised on every such rank at the end
    of an extraction (torchrun then stopped the job before rank 0 merged the manifest)."""
    events = StreamEvents()
    monkeypatch.setattr(torch.cuda, "Event", events.Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    timer = extract_mod.ForwardTimer(torch.device("cuda", 1))
    for _ in range(3):  # three forward batches, queued on the GPU, none waited for
        timer.stop(timer.start())
    assert timer.seconds() == pytest.approx(0.003)
