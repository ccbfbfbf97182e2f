"""The store reader's fast path (whole inner chunks or exact row ranges, one plain read each) gives,
byte for byte, what zarr itself reads from the same shards; arrays written another way fall back
to zarr; a remote store's chunks are cached on local disk within a size bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.chunks import LocalChunkCache
from shared.codecs import SampleFeatures
from shared.reader import StoreReader
from shared.store import StoreConfig, read_shard_arrays, supervised_pairs, write_shard
from testkit.store import make_store, samples


@pytest.mark.parametrize(
    "storage", [dict(compression="zstd"), dict(compression="none"), dict(compression="zstd", dtype="fp8"), dict(chunk_tokens=64)]
)
def test_every_sample_equals_zarrs_own_read_byte_for_byte(tmp_path, storage):
    cfg = StoreConfig(**storage)
    shards = [samples(7, seed=1), samples(5, seed=2)]
    make_store(str(tmp_path), shards, cfg)
    reader = StoreReader(str(tmp_path), cache_mb=1)  # a small cache: eviction happens along the way
    for shard_index, shard in enumerate(shards):
        arrays = read_shard_arrays(str(tmp_path), f"shard-{shard_index:06d}-x")  # through zarr
        offsets = arrays["offsets"]
        for local in range(len(shard)):
            index = int(reader._shard_start[shard_index]) + local
            lo, hi = int(offsets[local]), int(offsets[local + 1])
            got = reader[index]
            assert got["input_ids_T"].numpy().astype(np.int32).tobytes() == arrays["input_ids"][lo:hi].tobytes()
            assert got["loss_mask_T"].numpy().tobytes() == arrays["loss_mask"][lo:hi].tobytes()
            assert got["topk_ids_TK"].numpy().astype(np.int32).tobytes() == arrays["topk_ids"][lo:hi].tobytes()
            assert got["topk_logprobs_TK"].numpy().astype(np.float16).tobytes() == arrays["topk_logprobs"][lo:hi].tobytes()
            if cfg.dtype == "bf16":
                assert got["hidden_TLH"].view(torch.int16).numpy().view(np.uint16).tobytes() == arrays["hidden"][lo:hi].tobytes()
            else:  # fp8: the decoded values equal those of zarr's bits and scales
                from shared.codecs import decode_hidden

                want = decode_hidden(arrays["hidden"][lo:hi], arrays["hidden_scale"][lo:hi], "fp8")
                assert torch.equal(got["hidden_TLH"], want)
            window = reader.read(index, 3, 17)  # a window read inside the sample
            assert window["input_ids_T"].tolist() == got["input_ids_T"][3:17].tolist()


def test_a_shard_group_copied_in_from_another_store_is_refused_naming_it(tmp_path):
    """The same samples and lengths with other features (another target's store): the counts the
    manifest holds agree, only the shard's own checksum tells it is not the shard the manifest lists."""
    import shutil

    from shared.errors import StoreError

    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    make_store(str(ours), [samples(4, seed=1)], StoreConfig())
    other = [SampleFeatures(s.sample_id, s.input_ids_T, s.loss_mask_T, s.hidden_TLH + 1, s.topk_logprobs_TK, s.topk_ids_TK)
             for s in samples(4, seed=1)]
    make_store(str(theirs), [other], StoreConfig())
    assert StoreReader(str(ours))[0]["hidden_TLH"].abs().sum() > 0  # the store reads as it was written
    shard = ours / "shards" / "shard-000000-x"
    shutil.rmtree(shard)
    shutil.copytree(theirs / "shards" / "shard-000000-x", shard)
    with pytest.raises(StoreError, match=r"shard shard-000000-x is another shard than the manifest lists .* verify --repair"):
        StoreReader(str(ours))[0]


def test_reads_do_not_alias_the_chunk_cache(tmp_path):
    make_store(str(tmp_path), [samples(4)], StoreConfig())
    reader = StoreReader(str(tmp_path))
    first = reader[1]
    first["hidden_TLH"].zero_()  # a consumer writing into its sample
    assert reader[1]["hidden_TLH"].abs().sum() > 0


def test_arrays_written_with_another_codec_are_read_through_zarr(tmp_path):
    import zarr

    make_store(str(tmp_path), [samples(3)], StoreConfig(compression="none"))
    reader = StoreReader(str(tmp_path))
    before = reader[2]
    # Rewrite one array without sharding (a plain chunked array): the fast path does not read it.
    group = zarr.open_group(str(tmp_path / "shards" / "shard-000000-x"), mode="a")
    data = group["topk_ids"][...]
    del group["topk_ids"]
    group.create_array("topk_ids", shape=data.shape, dtype=data.dtype, chunks=(17, data.shape[1]))[...] = data  # zarr 3.0 has no data=
    again = StoreReader(str(tmp_path))
    assert not hasattr(again._shard(0)[0]["topk_ids"], "index")  # a zarr array, not a ShardArray
    assert torch.equal(again[2]["topk_ids_TK"], before["topk_ids_TK"])


def test_a_remote_store_keeps_its_chunks_on_local_disk_within_the_bound(tmp_path):
    url = f"memory://reader-{tmp_path.name}"
    make_store(url, [samples(6, seed=3)], StoreConfig())
    reader = StoreReader(url, local_cache_dir=tmp_path / "cache", local_cache_gb=0.0005)  # ~500 KB
    expected = [reader[i] for i in range(6)]
    cached = list((tmp_path / "cache").glob("*.bin"))
    assert cached and sum(p.stat().st_size for p in cached) <= 0.0005 * 2**30 + max(p.stat().st_size for p in cached)
    again = StoreReader(url, local_cache_dir=tmp_path / "cache", local_cache_gb=0.0005)
    for i in range(6):
        assert torch.equal(again[i]["hidden_TLH"], expected[i]["hidden_TLH"])


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_shard_rewritten_under_its_own_name_is_never_read_from_old_local_copies(tmp_path, compression):
    """`reprocess` of rows whose tokens changed (same rows, same settings: same shard name) or `verify
    --repair` rewrites a shard under its name; uncompressed, its chunks sit at the same offsets and
    lengths, and the local copies of the old ones (each passing its crc32c) were served for them."""
    url = f"memory://rewrite-{compression}-{tmp_path.name}"
    cached = {"local_cache_dir": tmp_path / "cache", "local_cache_gb": 0.01}
    make_store(url, [samples(3, seed=5)], StoreConfig(compression=compression))
    assert [StoreReader(url, **cached)[i]["sample_id"] for i in range(3)] == [0, 1, 2]  # the old chunks cached
    rewritten = samples(3, seed=5)
    for sample in rewritten:  # the same lengths, other tokens and loss mask (a tokenization fix)
        sample.input_ids_T = (sample.input_ids_T + 1).astype(np.int32)
        sample.loss_mask_T = ~sample.loss_mask_T
    make_store(url, [rewritten], StoreConfig(compression=compression))
    reader = StoreReader(url, **cached)
    for i, sample in enumerate(rewritten):
        got = reader[i]
        assert np.array_equal(got["input_ids_T"].numpy(), sample.input_ids_T)
        assert np.array_equal(got["loss_mask_T"].numpy(), sample.loss_mask_T)


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_a_flipped_bit_is_caught_when_read_and_a_damaged_local_copy_is_fetched_again(tmp_path, compression):
    """Each chunk's crc32c is checked when read, uncompressed chunks too (read whole for it); a damaged
    copy in the local cache of a remote store is dropped and read from the store, which decides."""
    from shared.errors import StoreError

    make_store(str(tmp_path / "local"), [samples(3, seed=4)], StoreConfig(compression=compression))
    path = tmp_path / "local" / "shards" / "shard-000000-x" / "hidden" / "c" / "0" / "0" / "0"
    good = StoreReader(str(tmp_path / "local"))[0]["hidden_TLH"]
    raw = bytearray(path.read_bytes())
    raw[5] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(StoreError, match=r"hidden/c/0/0/0: inner chunk 0 .* does not match its crc32c"):
        StoreReader(str(tmp_path / "local"))[0]

    url = f"memory://crc-{compression}-{tmp_path.name}"
    make_store(url, [samples(3, seed=4)], StoreConfig(compression=compression))
    cached = {"local_cache_dir": tmp_path / "cache", "local_cache_gb": 0.01}
    assert torch.equal(StoreReader(url, **cached)[0]["hidden_TLH"], good)
    copies = list((tmp_path / "cache").glob("*.bin"))
    assert copies
    for copy in copies:  # every cached read damaged (chunks and indexes), each keeping its length
        data = bytearray(copy.read_bytes())
        data[len(data) // 2] ^= 0x01
        copy.write_bytes(bytes(data))
    assert torch.equal(StoreReader(url, **cached)[0]["hidden_TLH"], good)


def test_the_local_chunk_cache_evicts_least_recently_used(tmp_path):
    cache = LocalChunkCache(tmp_path, max_bytes=250)
    fetched = []

    def fetch(tag):
        return lambda: fetched.append(tag) or bytes(100)

    for tag in ("a", "b", "a", "c"):  # a is used again before c arrives: b is the one evicted
        cache.get_or_fetch(tag, 0, 100, fetch(tag))
    assert fetched == ["a", "b", "c"]
    cache.get_or_fetch("a", 0, 100, fetch("a"))
    cache.get_or_fetch("b", 0, 100, fetch("b"))
    assert fetched == ["a", "b", "c", "b"]


def test_a_one_sample_shard_of_sample_zero_is_written_whole_and_a_missing_file_is_named(tmp_path):
    """sample_ids [0] equals zarr's fill value: zarr writes no file for such an array unless told to,
    and a reader could not tell that from a lost file (found by the scaling bench's 2K-token point)."""
    import json

    from shared.errors import StoreError

    make_store(str(tmp_path), [samples(1)], StoreConfig())
    shard = tmp_path / "shards" / "shard-000000-x"
    ids_file = shard / "sample_ids" / "c" / "0"
    assert ids_file.is_file()
    assert StoreReader(str(tmp_path))[0]["input_ids_T"].shape[0] > 0
    # A store written before every chunk was written: no file, no attribute -> zarr's fill value.
    meta_path = shard / "sample_ids" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    ids_file.unlink()
    meta_path.write_text(json.dumps({**meta, "attributes": {}}))
    assert StoreReader(str(tmp_path))._shard(0)[0]["sample_ids"].index[0][0] == 2**64 - 1
    StoreReader(str(tmp_path))[0]
    # The same file missing from a store whose writer writes every chunk is a lost file.
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(StoreError, match=r"shard-000000-x cannot be opened .*sample_ids"):
        StoreReader(str(tmp_path))[0]
    with pytest.raises(FileNotFoundError, match="sample_ids"):  # and `verify` names the shard
        read_shard_arrays(str(tmp_path), "shard-000000-x")


@pytest.mark.parametrize(
    "storage", [dict(compression="zstd"), dict(compression="none"), dict(compression="zstd", dtype="fp8"), dict(chunk_tokens=64)]
)
def test_the_loader_reads_features_straight_into_its_packed_batch(tmp_path, storage):
    """Same batches as packing the plain reads, with the features read into the batch's buffer."""
    from stage2_train.data.anchors import AnchorSampler
    from stage2_train.data.config import SamplerConfig
    from stage2_train.data.loader import PrefetchLoader, collate
    from stage2_train.data.sampler import LengthMixedSampler

    make_store(str(tmp_path), [samples(7, seed=1), samples(5, seed=2)], StoreConfig(**storage))
    reader = StoreReader(str(tmp_path), cache_mb=1)
    into = []
    plain_read = reader.read

    def spy(index, *args, **kwargs):
        got = plain_read(index, *args, **kwargs)
        if kwargs.get("hidden_out") is not None:
            into.append(got["hidden_TLH"].data_ptr() == kwargs["hidden_out"].data_ptr())
        return got

    reader.read = spy
    cfg = SamplerConfig(micro_batch_tokens=700, max_anchors_per_seq=6)
    sampler = LengthMixedSampler(cfg, reader.lengths, seed=0)
    anchors = AnchorSampler(cfg, block_size=4, seed=0)
    loader = PrefetchLoader(reader, sampler, anchors, mask_token_id=999, num_threads=2)
    batches = list(loader)
    assert sum(len(b.sample_indices) for b in batches) == len(reader) and len(batches) > 1
    assert len(into) == len(reader) and all(into)
    for loaded in batches:
        plain = [plain_read(i) for i in loaded.sample_indices]
        want = collate(plain, [anchors.anchors(s["loss_mask_T"], sample_id=s["sample_id"], epoch=0) for s in plain],
                       block_size=4, mask_token_id=999)
        assert loaded.batch.context_TF.dtype == torch.bfloat16
        assert torch.equal(loaded.batch.context_TF.view(torch.int16), want.context_TF.view(torch.int16))
        assert torch.equal(loaded.batch.labels_NB, want.labels_NB)
        assert torch.equal(loaded.batch.topk_ids_NBK, want.topk_ids_NBK)
        assert loaded.batch.num_tokens == want.num_tokens


def test_a_sample_whose_offsets_disagree_with_the_manifest_is_named_on_the_packed_path(tmp_path):
    import json

    from stage2_train.data.anchors import AnchorSampler
    from stage2_train.data.config import SamplerConfig
    from stage2_train.data.loader import DataLoadError, PrefetchLoader
    from stage2_train.data.sampler import LengthMixedSampler

    make_store(str(tmp_path), [samples(4)], StoreConfig())
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["shards"][0]["lengths"][2] += 1  # the manifest now disagrees with the shard's offsets
    manifest["shards"][0]["lengths"][3] -= 1  # (with the same sum, which loading the manifest checks)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    reader = StoreReader(str(tmp_path))
    cfg = SamplerConfig(micro_batch_tokens=4096, max_anchors_per_seq=4)
    loader = PrefetchLoader(reader, LengthMixedSampler(cfg, reader.lengths, seed=0), AnchorSampler(cfg, block_size=4, seed=0),
                            mask_token_id=999)
    with pytest.raises(DataLoadError, match=r"sample 2 \(input row 2\) in shard shard-000000-x .*store's lengths say"):
        list(loader)


def test_a_local_shard_is_on_disk_before_write_shard_returns(tmp_path, monkeypatch):
    """The part record written next marks the shard done, so every file of the shard (and its
    folders) is fsynced first: a node crash cannot leave a "done" shard without its data."""
    import os

    synced: set[str] = set()
    real_fsync = os.fsync

    def record(fd):
        synced.add(os.path.realpath(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    write_shard(str(tmp_path), "shard-000000-x", samples(3), StoreConfig())
    root = tmp_path / "shards" / "shard-000000-x"
    everything = {str(p.resolve()) for p in root.rglob("*")} | {str(root.resolve()), str(root.parent.resolve())}
    assert len(everything) > 10 and everything <= synced


def test_samples_supervised_pairs_come_from_the_manifest_or_once_from_the_loss_masks(tmp_path, monkeypatch):
    """A store extracted before part records carried `supervised_pairs` gives the same counts, read
    from its loss masks (no features); one that carries them is not read at all. Blocks counted from
    them equal the anchors each sample really draws."""
    import json

    from stage2_train.data.anchors import AnchorSampler
    from stage2_train.data.config import SamplerConfig

    shards = [samples(7, seed=1), samples(1, seed=2), samples(5, seed=3)]
    for shard in shards:  # edge cases: a one-token sample, an unsupervised one, a fully supervised one
        shard[0].loss_mask_T[:] = True
    shards[0][1].loss_mask_T[:] = False
    shards[2][2] = SampleFeatures(99, np.array([5], np.int32), np.array([True]), torch.zeros(1, 3, 40), torch.zeros(1, 5), torch.zeros(1, 5, dtype=torch.int32))
    make_store(str(tmp_path), shards, StoreConfig())
    want = [supervised_pairs(s.loss_mask_T) for shard in shards for s in shard]
    assert want[:2] == [len(shards[0][0].loss_mask_T) - 1, 0] and want[-3] == 0
    counted = StoreReader(str(tmp_path)).supervised_pairs()
    assert counted.tolist() == want

    manifest = json.loads((tmp_path / "manifest.json").read_text())
    start = 0
    for record in manifest["shards"]:
        record["supervised_pairs"] = want[start : start + record["num_samples"]]
        start += record["num_samples"]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    reader = StoreReader(str(tmp_path))
    monkeypatch.setattr(reader, "_count_pairs", lambda shard: pytest.fail("read a loss mask the manifest counts"))
    assert reader.supervised_pairs().tolist() == want

    for everywhere in (False, True):
        anchors = AnchorSampler(SamplerConfig(max_anchors_per_seq=50), block_size=4, seed=0, everywhere=everywhere)
        blocks = anchors.block_counts(reader.lengths, None if everywhere else reader.supervised_pairs())
        for i in range(len(reader)):
            drawn = anchors.anchors(reader[i]["loss_mask_T"], sample_id=i, epoch=3)
            assert len(drawn) == blocks[i]


def test_a_wrong_supervised_pairs_count_in_the_manifest_is_named_by_the_loader(tmp_path):
    """The block budget packs micro-batches by each sample's supervised_pairs from the manifest; a count
    that disagrees with the sample's loss mask (and so with the anchors it draws) is refused naming
    the sample and its shard, never trained on with a budget that does not hold."""
    import json

    from stage2_train.data.anchors import AnchorSampler
    from stage2_train.data.config import SamplerConfig
    from stage2_train.data.loader import DataLoadError, PrefetchLoader
    from stage2_train.data.sampler import LengthMixedSampler

    shards = [samples(4, seed=1), samples(3, seed=2, first_id=4)]
    make_store(str(tmp_path), shards, StoreConfig())
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    for record, shard in zip(manifest["shards"], shards):
        record["supervised_pairs"] = [supervised_pairs(s.loss_mask_T) for s in shard]
    manifest["shards"][1]["supervised_pairs"][1] -= 1  # input row 5: one block fewer than its loss mask gives
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    reader = StoreReader(str(tmp_path))
    cfg = SamplerConfig(micro_batch_tokens=4096, max_anchors_per_seq=1000)
    anchors = AnchorSampler(cfg, block_size=4, seed=0)
    sampler = LengthMixedSampler(cfg, reader.lengths, seed=0, blocks=anchors.block_counts(reader.lengths, reader.supervised_pairs()))
    loader = PrefetchLoader(reader, sampler, anchors, mask_token_id=999)
    with pytest.raises(DataLoadError, match=(
        r"sample 5 \(input row 5\) in shard shard-000001-x .* draws (\d+) anchors from its loss mask, but the manifest's "
        r"supervised_pairs plan \d+ blocks.*`python -m stage1_extract verify`"
    )):
        list(loader)
