"""Hugging Face Hub ids for `target.path` and `model.init_from`, resolved through the local cache only.

    snapshot = resolve_hub("Qwen/Qwen3-8B@main", "target.path")   # HubSnapshot(folder, repo_id, revision, commit)
    download("z-lab/Qwen3-8B-DFlash-b16")                          # the one place anything is fetched

A Hub id (`org/name`, optionally `@revision`: a branch, tag or commit) is looked up in the cache the
Hugging Face libraries use (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub, read when
the command runs). Nothing downloads implicitly: an id missing from the cache is an error naming the
command that fetches it (`python -m stage1_extract download`), and `download` is the only call that
reaches the network. The commit a revision resolved to is recorded beside what was made from it (the
store's manifest, an export's config.json), so "Qwen/Qwen3-8B" always says which weights it meant.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from shared.errors import InputFileError

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+)(@(?P<revision>[A-Za-z0-9_./-]+))?$")
DOWNLOAD = "python -m stage1_extract download"


@dataclass(frozen=True)
class HubSnapshot:
    folder: Path
    repo_id: str
    revision: str  # as asked ("main" when not given)
    commit: str  # what it resolved to in the cache

    def record(self) -> dict[str, str]:
        return {"hub_id": self.repo_id, "revision": self.revision, "commit": self.commit}


def hub_cache() -> Path:
    """The Hub cache as the user has it configured, read now (tests and users set the variables)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def is_hub_id(text: str) -> bool:
    """`org/name[@rev]` that is not an existing local path (a folder named like a repo wins)."""
    if not text or text.startswith(("/", ".", "~")) or Path(text).expanduser().exists():
        return False
    return HUB_ID.match(text) is not None


def split_id(text: str) -> tuple[str, str]:
    match = HUB_ID.match(text)
    if match is None:
        raise InputFileError(f"{text!r} is not a Hub id (org/name or org/name@revision)")
    return match["repo"], match["revision"] or "main"


def resolve_hub(text: str, setting: str) -> HubSnapshot:
    """The cached snapshot of a Hub id; InputFileError naming the setting and the command that
    fetches it when it is not (completely) in the cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo, revision = split_id(text)
    cache = hub_cache()
    try:
        folder = Path(snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError) as exc:  # IncompleteSnapshotError is a LocalEntryNotFoundError
        raise InputFileError(
            f"{setting}={text}: not in the Hugging Face cache at {cache} ({type(exc).__name__}); nothing is downloaded "
            f"implicitly: fetch it with `{DOWNLOAD} --config ...` (or `huggingface-cli download {repo}"
            f"{'' if revision == 'main' else ' --revision ' + revision}`), or give a local folder"
        ) from None
    return HubSnapshot(folder, repo, revision, folder.name)


def download(text: str) -> HubSnapshot:
    """Fetch a Hub id into the cache (the network), then resolve it as every command does."""
    from huggingface_hub import snapshot_download

    repo, revision = split_id(text)
    snapshot_download(repo, revision=revision, cache_dir=hub_cache())
    return resolve_hub(text, "download")
