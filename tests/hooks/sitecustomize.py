"""Fault hooks for subprocess tests: a subprocess whose PYTHONPATH starts with this folder loads
it at start-up. Each hook is off unless its variable is set, and none changes what is computed.

    DFLASH_HASH_LOG=FILE        every file hashed by shared.files.file_sha256, with the hashing rank
    DFLASH_STEP_SLEEP_S=S       each optimizer step sleeps S seconds first (time to signal mid-run)
    DFLASH_SAVE_SLEEP_S=S       each checkpoint file write sleeps S seconds first, after touching
    DFLASH_SAVING_MARKER=FILE   this file (so a test knows a save is under way)
    DFLASH_PAUSE_AFTER_FIRST_SHARD=FILE   extraction touches FILE after its first shard and record, then hangs
    DFLASH_NO_ANCHORS_FOR_EVEN_SAMPLES=1  samples with an even id yield no block (micro-batches without one)
"""

import os
import time

if os.environ.get("DFLASH_HASH_LOG"):
    import shared.files

    _real_hash = shared.files.file_sha256

    def _counted(path):
        with open(os.environ["DFLASH_HASH_LOG"], "a") as log:
            log.write(f"{os.environ.get('RANK', '0')} {os.path.abspath(path)}\n")
        return _real_hash(path)

    shared.files.file_sha256 = _counted

if os.environ.get("DFLASH_STEP_SLEEP_S"):
    from stage2_train.train import trainer

    _real_step = trainer.Trainer.optimizer_step

    def _slow_step(self, counts):
        time.sleep(float(os.environ["DFLASH_STEP_SLEEP_S"]))
        return _real_step(self, counts)

    trainer.Trainer.optimizer_step = _slow_step

if os.environ.get("DFLASH_SAVE_SLEEP_S"):
    from stage2_train.train.checkpoint import saver

    _real_write = saver.write_part

    def _slow_write(*args, **kwargs):
        open(os.environ["DFLASH_SAVING_MARKER"], "a").close()
        time.sleep(float(os.environ["DFLASH_SAVE_SLEEP_S"]))
        return _real_write(*args, **kwargs)

    saver.write_part = _slow_write

if os.environ.get("DFLASH_PAUSE_AFTER_FIRST_SHARD"):
    from stage1_extract import writer

    _real_shard_write = writer.ShardWriter._write

    def _pausing_write(self, shard, samples):
        _real_shard_write(self, shard, samples)
        open(os.environ["DFLASH_PAUSE_AFTER_FIRST_SHARD"], "a").close()  # one shard and its record are on disk
        time.sleep(3600)  # until the test kills the process

    writer.ShardWriter._write = _pausing_write

if os.environ.get("DFLASH_NO_ANCHORS_FOR_EVEN_SAMPLES"):
    import shared.reader
    from stage2_train.data import anchors

    _real_anchors = anchors.AnchorSampler.anchors
    _real_pairs = shared.reader.StoreReader.supervised_pairs

    def _odd_only(self, loss_mask_T, *, sample_id, epoch):
        found = _real_anchors(self, loss_mask_T, sample_id=sample_id, epoch=epoch)
        return found[:0] if sample_id % 2 == 0 else found  # as an answer of one token would

    def _odd_pairs(self):  # the counts the block budget plans with say the same (the loader checks them)
        return _real_pairs(self) * (self.sample_ids % 2 == 1)

    anchors.AnchorSampler.anchors = _odd_only
    shared.reader.StoreReader.supervised_pairs = _odd_pairs
