"""Loaded by a subprocess whose PYTHONPATH starts here (tests/test_trainer.py): records every file
hashed by shared.files.file_sha256, with the rank that hashed it, to $DFLASH_HASH_LOG."""

import os

import shared.files

_real = shared.files.file_sha256


def _counted(path):
    with open(os.environ["DFLASH_HASH_LOG"], "a") as log:
        log.write(f"{os.environ.get('RANK', '0')} {os.path.abspath(path)}\n")
    return _real(path)


shared.files.file_sha256 = _counted
