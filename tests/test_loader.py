"""collate (positions, blocks, labels, top-k at anchor+k-1) and PrefetchLoader (order, errors, resume)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from stage2_train.data.anchors import AnchorSampler, valid_anchor_positions
from stage2_train.data.config import SamplerConfig
from stage2_train.data.loader import DataLoadError, PrefetchLoader, collate
from stage2_train.data.sampler import LengthMixedSampler

LAYERS, HIDDEN, TOP_K, BLOCK, MASK_ID = 2, 3, 4, 4, 999


class FakeReader:
    """The feature-store reader's interface, with values that encode (sample, position)."""

    def __init__(self, lengths, *, fail_on=None, delay_s=0.0, unsupervised=(), hidden_dtype=torch.float32):
        self.hidden_dtype = hidden_dtype
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.fail_on = fail_on
        self.delay_s = delay_s
        self.unsupervised = set(unsupervised)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        if i == self.fail_on:
            raise OSError("shard 3 is corrupt")
        if self.delay_s:
            time.sleep(self.delay_s)
        num_tokens = int(self.lengths[i])
        t = torch.arange(num_tokens)
        loss_mask = t >= 3  # a 3-token prompt
        loss_mask[num_tokens // 2] = False  # and one unsupervised token mid-answer
        if i in self.unsupervised:
            loss_mask[:] = False
        hidden = (
            1000.0 * i
            + t[:, None, None]
            + 0.1 * torch.arange(LAYERS)[None, :, None]
            + 0.01 * torch.arange(HIDDEN)[None, None, :]
        )
        k = torch.arange(TOP_K)
        return {
            "input_ids_T": 10_000 * (i + 1) + t,
            "loss_mask_T": loss_mask,
            "hidden_TLH": hidden.to(self.hidden_dtype),
            "topk_logprobs_TK": -(t[:, None] + k[None, :] / 10.0).float(),
            "topk_ids_TK": 100 * t[:, None] + k[None, :],
            "sample_id": 500 + i,
        }


def reference_block(sample: dict, anchor: int):
    """Per-slot expectations, written as a plain loop."""
    ids, mask = sample["input_ids_T"], sample["loss_mask_T"]
    num_tokens = len(ids)
    labels, lps, tids = [], [], []
    ended = False  # the block's first supervised run is over: nothing after it is scored
    for k in range(BLOCK):
        p = anchor + k
        supervised = p < num_tokens and bool(mask[p]) and not ended
        ended = ended or (not supervised and any(bool(mask[q]) for q in range(anchor, min(p, num_tokens))))
        if k >= 1 and supervised:
            labels.append(int(ids[p]))
            lps.append(sample["topk_logprobs_TK"][p - 1])
            tids.append(sample["topk_ids_TK"][p - 1])
        else:
            labels.append(-100)
            lps.append(torch.zeros(TOP_K))
            tids.append(torch.zeros(TOP_K, dtype=torch.long))
    return labels, torch.stack(lps), torch.stack(tids)


def test_collate_packs_and_builds_exact_blocks():
    reader = FakeReader([12, 7, 9])
    samples = [reader[i] for i in range(3)]
    # Sample 0: anchors including one whose block runs past the end (10 + 3 >= 12).
    anchors = [torch.tensor([3, 5, 10]), torch.tensor([], dtype=torch.long), torch.tensor([4])]
    batch = collate(samples, anchors, block_size=BLOCK, mask_token_id=MASK_ID)

    assert batch.num_samples == 3 and batch.num_tokens == 28
    assert batch.context_TF.shape == (28, LAYERS * HIDDEN)
    want_context = torch.cat([s["hidden_TLH"].reshape(len(s["input_ids_T"]), -1) for s in samples])
    assert torch.equal(batch.context_TF, want_context)
    assert batch.context_TF[12 + 2, HIDDEN + 1].item() == pytest.approx(1000 + 2 + 0.1 + 0.01, abs=1e-3)
    assert batch.context_TF.dtype == torch.float32
    assert batch.context_pos_T.tolist() == list(range(12)) + list(range(7)) + list(range(9))
    assert batch.context_seq_T.tolist() == [0] * 12 + [1] * 7 + [2] * 9
    assert batch.block_seq_N.tolist() == [0, 0, 0, 2]
    assert batch.anchor_pos_N.tolist() == [3, 5, 10, 4]
    assert batch.block_ids_NB[:, 1:].eq(MASK_ID).all()
    assert batch.block_ids_NB[:, 0].tolist() == [10_003, 10_005, 10_010, 30_004]

    for n, (s, a) in enumerate([(0, 3), (0, 5), (0, 10), (2, 4)]):
        labels, lps, tids = reference_block(samples[s], a)
        assert batch.labels_NB[n].tolist() == labels, n
        assert torch.equal(batch.topk_logprobs_NBK[n], lps), n
        assert torch.equal(batch.topk_ids_NBK[n], tids), n
    # Spot checks of the rule itself: slot 0 unscored, slot k = token anchor+k, past the end -100,
    # position 6 (= 12 // 2) unsupervised, top-k from anchor+k-1.
    assert batch.labels_NB[0].tolist() == [-100, 10_004, 10_005, -100]
    assert batch.labels_NB[2].tolist() == [-100, 10_011, -100, -100]
    assert batch.topk_ids_NBK[0, 1].tolist() == [300, 301, 302, 303]


def test_collate_without_topk_keeps_store_dtype():
    reader = FakeReader([8], hidden_dtype=torch.bfloat16)
    batch = collate(
        [reader[0]], [torch.tensor([4])], block_size=BLOCK, mask_token_id=MASK_ID, gather_topk=False
    )
    assert batch.topk_logprobs_NBK is None and batch.topk_ids_NBK is None
    assert batch.context_TF.dtype == torch.bfloat16  # DrafterBatch.to(device, dtype) casts later
    assert batch.labels_NB.tolist() == [[-100, 10_005, 10_006, 10_007]]  # position 4 = 8 // 2 is unsupervised


class RecordingReader(FakeReader):
    """Counts how often each sample was read: every sample is read once per epoch, so a sample read
    e + 1 times has been read for epoch e."""

    def __init__(self, lengths):
        super().__init__(lengths)
        self.reads: dict[int, int] = {}
        self.cond = threading.Condition()

    def __getitem__(self, i: int) -> dict:
        sample = super().__getitem__(i)
        with self.cond:
            self.reads[i] = self.reads.get(i, 0) + 1
            self.cond.notify_all()
        return sample

    def wait_served(self, key: tuple[int, list[int]], timeout: float) -> bool:
        epoch, indices = key
        with self.cond:
            return self.cond.wait_for(lambda: all(self.reads.get(i, 0) >= epoch + 1 for i in indices), timeout)


def build(lengths, *, reader=None, seed=0, world_size=1, rank=0, **loader_kwargs):
    cfg = SamplerConfig(micro_batch_tokens=256, max_anchors_per_seq=8)
    sampler = LengthMixedSampler(cfg, lengths, seed=seed, rank=rank, world_size=world_size, grad_accum=2)
    anchors = AnchorSampler(cfg, block_size=BLOCK, seed=seed)
    reader = reader or FakeReader(lengths)
    return PrefetchLoader(reader, sampler, anchors, mask_token_id=MASK_ID, **loader_kwargs)


def lengths_for_tests(n: int = 120) -> np.ndarray:
    return np.random.default_rng(0).integers(5, 120, n)


def data_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dflash-data")]


def test_loader_keeps_the_sampler_order_and_content():
    lengths = lengths_for_tests()
    loader = build(lengths, reader=FakeReader(lengths, delay_s=0.0005), num_threads=3, prefetch=5)
    expected = build(lengths).sampler.remaining()
    got = list(loader)
    assert [b.sample_indices for b in got] == [r.indices for r in expected]
    assert [(b.epoch, b.step_in_epoch, b.micro_step) for b in got] == [r[:3] for r in expected]
    reader, anchor_sampler = loader.reader, loader.anchor_sampler
    for loaded in got[:5]:
        samples = [reader[i] for i in loaded.sample_indices]
        anchors = [
            anchor_sampler.anchors(s["loss_mask_T"], sample_id=s["sample_id"], epoch=0) for s in samples
        ]
        want = collate(samples, anchors, block_size=BLOCK, mask_token_id=MASK_ID)
        assert torch.equal(loaded.batch.context_TF, want.context_TF)
        assert torch.equal(loaded.batch.labels_NB, want.labels_NB)
        assert torch.equal(loaded.batch.topk_ids_NBK, want.topk_ids_NBK)
    assert loader.num_samples == len(lengths) and loader.num_batches == len(got)
    assert loader.data_wait_s == pytest.approx(sum(b.data_wait_s for b in got))
    assert loader.sampler.epoch == 1  # the whole epoch was consumed
    assert not data_threads()


def test_worker_error_names_the_sample_and_stops_cleanly():
    lengths = lengths_for_tests()
    bad = int(build(lengths).sampler.remaining()[6].indices[0])
    loader = build(lengths, reader=FakeReader(lengths, fail_on=bad), prefetch=4)
    consumed = 0
    with pytest.raises(
        DataLoadError, match=rf"sample {bad} \(epoch 0, step 3, micro-batch 0\).*shard 3 is corrupt"
    ) as info:
        for _ in loader:
            consumed += 1
    assert info.value.sample_index == bad
    assert consumed == 6
    assert loader.sampler.state_dict()["step_in_epoch"] == 3  # only consumed batches count
    assert not data_threads()


def test_store_length_mismatch_is_reported():
    lengths = lengths_for_tests()
    wrong = lengths.copy()
    target = build(lengths).sampler.remaining()[0].indices[0]
    wrong[target] += 1
    loader = build(wrong, reader=FakeReader(lengths))
    with pytest.raises(DataLoadError, match=rf"sample {target} .*store's lengths say"):
        next(iter(loader))


def test_early_break_joins_threads_and_counts_only_consumed():
    lengths = lengths_for_tests()
    loader = build(lengths, prefetch=6)
    for n, _ in enumerate(loader):
        if n == 2:
            break
    assert not data_threads()
    state = loader.state_dict()
    assert (state["step_in_epoch"], state["micro_step"]) == (1, 1)  # three micro-batches consumed


@pytest.mark.parametrize("stop_after", [3, 8])
def test_resume_replays_exactly(stop_after):
    lengths = lengths_for_tests()
    uninterrupted = [b for b in build(lengths, seed=2, world_size=2, rank=1)]

    first = build(lengths, seed=2, world_size=2, rank=1)
    head = []
    for loaded in first:
        head.append(loaded)
        if len(head) == stop_after:
            break
    state = first.state_dict()

    resumed = build(lengths, seed=2, world_size=2, rank=1)
    resumed.load_state_dict(state)
    tail = list(resumed)
    got = head + tail
    assert [b.sample_indices for b in got] == [b.sample_indices for b in uninterrupted]
    for a, b in zip(got, uninterrupted):
        assert torch.equal(a.batch.anchor_pos_N, b.batch.anchor_pos_N)
        assert torch.equal(a.batch.labels_NB, b.batch.labels_NB)


def test_anchorless_samples_are_counted():
    lengths = lengths_for_tests(60)
    lengths[:3] = [4, 3, 100]  # one supervised token (no pair), none at all, fine
    reader = FakeReader(lengths, unsupervised={3, 4})
    anchorless = {
        i for i in range(len(lengths)) if not len(valid_anchor_positions(reader[i]["loss_mask_T"], BLOCK))
    }
    assert {0, 1, 3, 4} <= anchorless and 2 not in anchorless
    loader = build(lengths, reader=reader)
    got = list(loader)
    assert loader.num_samples_without_anchor == len(anchorless)
    assert sum(b.num_samples_without_anchor for b in got) == len(anchorless)
    for b in got:
        seqs_with_blocks = set(b.batch.block_seq_N.tolist())
        for pos, index in enumerate(b.sample_indices):
            assert (pos in seqs_with_blocks) == (index not in anchorless)


def test_data_wait_is_measured_when_the_reader_is_slow():
    lengths = lengths_for_tests(40)
    loader = build(lengths, reader=FakeReader(lengths, delay_s=0.003), num_threads=1, prefetch=1)
    got = list(loader)
    # Each micro-batch reads several samples at 3 ms each and the consumer does nothing: it waits.
    assert loader.data_wait_s >= 0.5 * 0.003 * len(lengths)
    assert all(b.data_wait_s > 0 for b in got)


def test_stream_crosses_epochs_in_order_and_prefetches_the_next_epoch():
    lengths = lengths_for_tests(60)
    per_epoch = build(lengths, seed=3)
    expected = list(per_epoch) + list(per_epoch) + list(per_epoch)[:2]  # epochs 0, 1 and two of 2
    assert [b.epoch for b in expected][-1] == 2

    # The consumer holds the last micro-batch of every epoch until the reader has served every
    # sample of the next epoch's first one: only a loader that streams across the boundary gets there.
    reader = RecordingReader(lengths)
    loader = build(lengths, seed=3, reader=reader, prefetch=3)
    got = []
    for loaded in loader.stream():
        got.append(loaded)
        if len(got) == len(expected):
            break
        upcoming = expected[len(got)]
        if loaded.epoch != upcoming.epoch:
            assert reader.wait_served((upcoming.epoch, upcoming.sample_indices), timeout=30), (
                "the next epoch's first micro-batch was not read while this epoch's last one was in use"
            )
    first_of_later_epochs = [b for i, b in enumerate(got) if i and b.epoch != got[i - 1].epoch]
    assert len(first_of_later_epochs) == 2
    assert [(b.epoch, b.step_in_epoch, b.micro_step) for b in got] == [
        (b.epoch, b.step_in_epoch, b.micro_step) for b in expected
    ]
    assert [b.sample_indices for b in got] == [b.sample_indices for b in expected]
    for a, b in zip(got, expected):
        assert torch.equal(a.batch.anchor_pos_N, b.batch.anchor_pos_N)  # anchors drawn for their own epoch
    state = loader.state_dict()
    assert (state["epoch"], state["step_in_epoch"], state["micro_step"]) == (2, 1, 0)  # consumed only
    assert not data_threads()


class ReadIntoReader(FakeReader):
    """Reads features straight into the loader's packed buffer, as the store reader does."""

    feature_shape = (LAYERS, HIDDEN)

    def read(self, i: int, hidden_out=None) -> dict:
        sample = self[i]
        hidden_out.copy_(sample["hidden_TLH"])
        return {**sample, "hidden_TLH": hidden_out}


def test_host_buffers_are_reused_not_allocated_per_micro_batch():
    """A consumer that gives its micro-batches back gets the same (on CUDA: pinned) buffers again:
    pinning per step would cost more than the copy it speeds up. One that never gives back still
    runs, on fresh buffers."""
    from stage2_train.data.loader import BufferPool

    lengths = lengths_for_tests()
    loader = build(lengths, reader=ReadIntoReader(lengths), num_threads=1, prefetch=2)
    seen = set()
    for _, loaded in zip(range(12), loader.stream()):
        assert loaded.buffer is not None and loaded.batch.context_TF.data_ptr() == loaded.buffer.data_ptr()
        reference = torch.cat([FakeReader(lengths)[i]["hidden_TLH"] for i in loaded.sample_indices]).flatten(1)
        assert torch.equal(loaded.batch.context_TF, reference.to(torch.bfloat16))  # a reused buffer holds this batch only
        seen.add(loaded.buffer.data_ptr())
        loader.release(loaded)
    loader.close()
    pool = loader._pool
    assert isinstance(pool, BufferPool) and pool.keep == 2 + 1 + 1
    assert pool.allocated <= pool.keep and len(seen) <= pool.keep

    class Ready:
        waited = False

        def synchronize(self):
            Ready.waited = True

    _, buffer = pool.take(5)
    pool.give_back(buffer, Ready())
    _, same = pool.take(3)
    assert same is buffer and Ready.waited  # the copy out of it is waited for before it is refilled
    kept = build(lengths, reader=ReadIntoReader(lengths), num_threads=1, prefetch=2)
    held = [loaded for _, loaded in zip(range(8), kept.stream())]  # never given back: fresh buffers
    kept.close()
    assert len({lb.buffer.data_ptr() for lb in held}) == 8


@pytest.mark.device
def test_host_buffers_are_pinned_once_and_reused_across_copies_to_the_device(device):
    """Ten micro-batches copied to the device (asynchronously from pinned memory on a GPU), each
    buffer given back with its copy's event: one buffer serves them all, and none is refilled before
    the copy out of it has run. On a GPU each copy is held back behind a busy stream, so a pool that
    did not wait for the event would refill the buffer under it."""
    from stage2_train.data.loader import BufferPool

    cuda = device.type == "cuda"
    pool = BufferPool(16384, (5, 64), torch.bfloat16, keep=3, pin=cuda)
    copies = []
    for step in range(10):
        view, buffer = pool.take(12000)  # waits for the last copy out of a reused buffer
        view.fill_(step)
        if cuda:
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU cycles queued ahead of the copy
        copies.append(view.to(device, non_blocking=cuda, copy=True))
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        pool.give_back(buffer, event)
        assert buffer.is_pinned() == cuda
    # Read only now: a buffer refilled before its copy had run would show a later step's values.
    assert all(torch.equal(c, torch.full_like(c, step)) for step, c in enumerate(copies))
    assert pool.allocated == 1
