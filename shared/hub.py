"""Hugging Face Hub ids for `target.path` and `model.init_from`, resolved through the local cache only.

    snapshot = resolve_hub("Qwen/Qwen3-8B@main", "target.path")   # HubSnapshot(folder, repo_id, revision, commit)
    download("z-lab/Qwen3-8B-DFlash-b16")                          # the one place anything is fetched

A Hub id (`org/name`, optionally `@revision`: a branch, tag or commit) is looked up in the cache the
Hugging Face libraries use (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub, read when
the command runs). Nothing downloads implicitly: an id missing from the cache is an error naming the
command that fetches it (`python -m stage1_extract download`), and `download` is the only call that
fetches from the Hub (`export --push-to-hub` the only upload). The commit a revision resolved to is recorded beside what was made from it (the
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
            f"implicitly: fetch it with `{DOWNLOAD} --config ...` (or `hf download {repo}"
            f"{'' if revision == 'main' else ' --revision ' + revision}`), or give a local folder"
            # `models/Qwen3-8B` may have meant a folder beside the config file: say where it was looked for.
            + ("" if "@" in text else f" (no folder {text} under the working directory {os.getcwd()} either: a relative "
                                      f"path resolves against it, not against the config file's folder)")
        ) from None
    return HubSnapshot(folder, repo, revision, folder.name)


# What a target or a drafter folder is loaded from: safetensors weights, configs, tokenizer files
# (tokenizer.json, tokenizer.model, *.tiktoken, vocab.txt / merges.txt) and chat templates. Not the
# pickled `.bin` weights or the `original/*.pth` checkpoints some repos carry beside the safetensors
# (Llama-3.1-8B-Instruct's original/consolidated.00.pth alone is 16 GB), nor anything else.
HUB_FILES = ("*.safetensors", "*.json", "*.jinja", "*.model", "*.tiktoken", "*.txt")
LOGIN = "`export HF_TOKEN=hf_...` or `hf auth login` (`huggingface-cli login` before huggingface_hub 0.34)"


def download(text: str, setting: str = "download") -> HubSnapshot:
    """Fetch a Hub id's HUB_FILES into the cache (the network), then resolve it as every command does.
    Whatever keeps it from the cache (a gated or private repo, a missing id or revision, a bad token,
    no network) is one InputFileError naming `setting`, the repo's page and the fix."""
    from huggingface_hub import snapshot_download

    repo, revision = split_id(text)
    try:
        folder = Path(snapshot_download(repo, revision=revision, cache_dir=hub_cache(), allow_patterns=list(HUB_FILES)))
    except Exception as exc:  # noqa: BLE001 - the Hub's errors become one line; anything else keeps its traceback
        problem = _download_problem(exc, repo, revision)
        if problem is None:
            raise
        raise InputFileError(f"{setting}={text}: {problem}") from None
    if not any(folder.glob("*.safetensors")):
        raise InputFileError(
            f"{setting}={text}: {repo} has no *.safetensors weights in its top folder ({_page(repo)}), and "
            f"`{DOWNLOAD}` fetches no others (pickled .bin weights run code when loaded): use a repo with safetensors, or fetch it "
            f"yourself (`hf download {repo} --local-dir DIR`), convert it and set {setting} to that folder"
        )
    return resolve_hub(text, "download")


def _page(repo: str) -> str:
    from huggingface_hub import constants

    return f"{constants.ENDPOINT}/{repo}"


def _download_problem(exc: Exception, repo: str, revision: str) -> str | None:
    """What kept `repo` from the cache, and the fix, in one line; None for an error not the Hub's."""
    from huggingface_hub import constants, get_token
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    page = _page(repo)
    token = "no token was found" if get_token() is None else "the token found here has no access to it"
    rerun = f"then rerun `{DOWNLOAD}`"
    if isinstance(exc, GatedRepoError):  # before RepositoryNotFoundError, of which it is one
        return (
            f"{repo} is gated and {token}: accept its terms on {page} with your Hugging Face account, give this "
            f"machine that account's token ({LOGIN}), {rerun}"
        )
    if isinstance(exc, RepositoryNotFoundError):  # the Hub answers 401 for a private repo without a token too
        return (
            f"the Hub has no repository {repo} ({page}), or it is private or gated and {token}: check the id, or give "
            f"this machine the token of an account that can read it ({LOGIN}), {rerun}"
        )
    if isinstance(exc, RevisionNotFoundError):
        return f"{repo} has no revision {revision!r} ({page}/tree/main lists branches and commits): fix the @revision"
    if isinstance(exc, LocalEntryNotFoundError):  # what snapshot_download raises when it cannot reach the Hub;
        # before HfHubHTTPError, of which huggingface_hub 0.x (transformers 4.x) makes it one
        cause = exc.__cause__ or exc.__context__
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"{type(cause).__name__ if cause else 'no answer'}"
        return (
            f"cannot reach the Hub at {constants.ENDPOINT} ({why}) and {repo}@{revision} is not in the cache at "
            f"{hub_cache()}: check the network, proxy and HF_ENDPOINT (HF_HUB_OFFLINE=1 forbids downloads), {rerun}"
        )
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "?"
        if status == 401:
            return f"the Hub refused the token (HTTP 401: invalid credentials): set a valid one ({LOGIN}), {rerun}"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"the Hub answered HTTP {status} for {repo} ({first}); {rerun} later (it resumes what was fetched)"
    return None


def fetch_rest(folder: Path, what: str) -> str:
    """How to complete a Hub snapshot (models--ORG--NAME/snapshots/REV: the download) or a folder (a copy)."""
    folder = Path(folder)
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        repo = folder.parent.parent.name.removeprefix("models--").replace("--", "/", 1)
        return f"{repo} was fetched into the Hugging Face cache in part: `{DOWNLOAD} --config ...` fetches the rest"
    return f"copy {what} into it"
