"""The errors a user can fix: printed as one line (exit status 2), never as a traceback.

    raise ConfigError("train.epochs must be >= 1, got 0")
    raise StoreError(f"{url}/manifest.json is not valid JSON (...); run `python -m stage1_extract reprocess`")

Everything else that escapes a command (a CUDA out-of-memory, an internal bug) keeps its traceback.
Each subclass also derives from the builtin that code and tests have always caught for it
(ValueError, FileNotFoundError), so `except ValueError` still sees a bad config.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input, a damaged file, or a state the user must resolve; the message names the file,
    sample, shard or key and, where one exists, the command that fixes it."""

    exit_code = 2


class ConfigError(UserError, ValueError):
    """A config file, override or setting that cannot work."""


class InputFileError(UserError, FileNotFoundError):
    """A file or folder the config names does not exist."""


class DataError(UserError, ValueError):
    """A row of the input data, or a sample of the store, that cannot be used."""


class StoreError(UserError, ValueError):
    """The feature store is missing, incomplete, stale, damaged or busy; the message says which file or shard."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be used (damaged, incomplete, or made for other settings)."""


class DiskFullError(UserError, OSError):
    """A disk (or quota) that filled while a command wrote: the message names the folder, its free space and the fix."""


class BusyError(UserError, RuntimeError):
    """Another command holds the lock of a store or run directory."""


class DivergedError(UserError, RuntimeError):
    """Training produced non-finite losses or gradients for too many steps in a row."""

    exit_code = 3
