"""Hub ids for target.path and model.init_from, through a Hugging Face cache built in the hub's own
layout (models--org--name/{blobs, refs/main, snapshots/<commit>/ -> ../../blobs}) from local folders:
resolved offline, recorded with the commit they meant, and never downloaded implicitly."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from shared.config import load_run_config
from shared.errors import InputFileError
from shared.hub import HUB_FILES
from shared.store import StoreFiles, load_manifest
from shared.target import TargetConfig, resolve_target, resolve_target_dir
from stage1_extract import commands as stage1
from testkit.data import chat_rows, stage1_overrides, write_jsonl
from tests.conftest import add_to_hub_cache

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_target_dir) -> Path:
    cache = tmp_path / "hf" / "hub"
    add_to_hub_cache(cache, "tiny-org/tiny-target", tiny_target_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_a_hub_id_resolves_through_the_cache_by_branch_or_commit(hub):
    for path in ("tiny-org/tiny-target", "tiny-org/tiny-target@main", f"tiny-org/tiny-target@{COMMIT}"):
        folder = resolve_target_dir(TargetConfig(path=path))
        assert folder == hub / "models--tiny-org--tiny-target" / "snapshots" / COMMIT and (folder / "config.json").is_file()
    target = resolve_target(TargetConfig(path="tiny-org/tiny-target", num_feature_layers=3))
    assert target.source == {"path": "tiny-org/tiny-target", "hub_id": "tiny-org/tiny-target", "revision": "main", "commit": COMMIT}


def test_an_id_not_in_the_cache_names_the_command_that_fetches_it(hub):
    with pytest.raises(InputFileError, match=r"target.path=Qwen/Qwen3-8B: not in the Hugging Face cache at .*"
                                             r"`python -m stage1_extract download --config \.\.\.`"):
        resolve_target_dir(TargetConfig(path="Qwen/Qwen3-8B"))
    with pytest.raises(InputFileError, match="not in the Hugging Face cache"):
        resolve_target_dir(TargetConfig(path="tiny-org/tiny-target@v2"))  # no such ref cached


def test_a_local_folder_named_like_a_repo_is_a_folder(tmp_path, tiny_target_dir, monkeypatch, hub):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_target_dir, tmp_path / "org" / "model")
    assert resolve_target_dir(TargetConfig(path="org/model")) == Path("org/model")


def test_check_refuses_a_target_that_cannot_be_resolved(tmp_path, hub):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    for path in ("/models/not-there", "Qwen/Qwen3-8B"):
        done = subprocess.run([sys.executable, "-m", "stage1_extract", "check", "--quiet", f"target.path={path}"],
                              cwd=repo, capture_output=True, text=True, env={**os.environ})
        assert done.returncode == 2 and "target.path=" in done.stderr and path in done.stderr, done.stderr


def test_a_store_from_a_hub_target_records_the_commit(hub, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6))
    cfg = load_run_config("configs/default.yaml", stage1_overrides("tiny-org/tiny-target", data, tmp_path / "run"))
    stage1.cmd_extract(cfg, progress=False)
    manifest = load_manifest(StoreFiles(cfg.store.url(cfg.run_dir)))
    assert manifest["target_source"]["hub_id"] == "tiny-org/tiny-target" and manifest["target_source"]["commit"] == COMMIT
    assert stage1.cmd_status(cfg)["complete"]


def test_download_fetches_only_hub_ids_and_only_when_asked(hub, monkeypatch, tmp_path):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, revision=None, cache_dir=None, local_files_only=False, **kw):
        if not local_files_only:
            calls.append((repo_id, revision))
            assert kw["allow_patterns"] == list(HUB_FILES)
            return str(add_to_hub_cache(Path(cache_dir), repo_id, Path(resolve_target_dir(TargetConfig(path="tiny-org/tiny-target")))))
        return real(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True, **kw)

    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    cfg = load_run_config("configs/default.yaml", ["target.path=new-org/new-target", "model.init_from=z-org/drafter@main"])
    out = stage1.cmd_download(cfg)
    assert calls == [("new-org/new-target", "main"), ("z-org/drafter", "main")]
    assert out["downloaded"]["target.path"]["commit"] == COMMIT
    assert stage1.cmd_download(load_run_config("configs/default.yaml", []))["downloaded"] == {}


def test_model_init_from_takes_a_published_drafter_by_hub_id(hub, tmp_path):
    import torch

    from shared.target import TargetArch
    from stage2_train.model.config import DrafterConfig
    from stage2_train.model.description import describe_parts
    from stage2_train.model.drafter import DFlashDrafter
    from stage2_train.serve.export import export_drafter
    from stage2_train.serve.load import init_weights_for

    target = resolve_target(TargetConfig(path="tiny-org/tiny-target", num_feature_layers=3))
    cfg = DrafterConfig(num_layers=1, block_size=8)
    drafter = DFlashDrafter(cfg, target.arch, 3, target.mask_token_id)
    folder = export_drafter(drafter, describe_parts(cfg, target.arch, target.layer_ids, target.mask_token_id), {}, tmp_path / "published")
    add_to_hub_cache(hub, "z-org/drafter-b8", folder, commit="f" * 40)
    weights = init_weights_for("z-org/drafter-b8", cfg, target)
    assert torch.equal(weights["fc.weight"], drafter.fc.weight.detach().to(torch.bfloat16))
    with pytest.raises(InputFileError, match=r"model.init_from=z-org/missing: not in the Hugging Face cache"):
        init_weights_for("z-org/missing", cfg, target)
    assert isinstance(target.arch, TargetArch)


def test_download_fetches_what_loading_needs_not_the_original_checkpoints():
    """Llama-3.1-8B-Instruct's files, filtered by huggingface_hub's own rule with download's patterns."""
    from huggingface_hub.utils import filter_repo_objects

    files = [
        ".gitattributes", "LICENSE", "README.md", "USE_POLICY.md", "config.json", "generation_config.json",
        "model-00001-of-00004.safetensors", "model-00004-of-00004.safetensors", "model.safetensors.index.json",
        "original/consolidated.00.pth", "original/params.json", "original/tokenizer.model", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json", "pytorch_model.bin", "chat_template.jinja", "merges.txt",
    ]
    assert sorted(filter_repo_objects(files, allow_patterns=list(HUB_FILES))) == [
        "chat_template.jinja", "config.json", "generation_config.json", "merges.txt", "model-00001-of-00004.safetensors",
        "model-00004-of-00004.safetensors", "model.safetensors.index.json", "original/params.json",
        "original/tokenizer.model", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
    ]


def _hub_refusal(status: int, url: str, **headers: str) -> Exception:
    """The exception huggingface_hub itself raises for this answer of the Hub (its own hf_raise_for_status)."""
    import huggingface_hub
    from huggingface_hub.utils import hf_raise_for_status

    # What this huggingface_hub speaks HTTP with: httpx2 from 2.x, httpx in 1.x (1.33 on the GPU image),
    # requests in 0.x (transformers 4.x).
    if huggingface_hub.__version__.startswith("0."):
        import requests

        response = requests.Response()
        response.status_code, response.url, response.request = status, url, requests.Request("GET", url).prepare()
        response.headers.update(headers)
    else:
        try:
            import httpx2 as httpx
        except ImportError:
            import httpx
        response = httpx.Response(status, headers=headers, request=httpx.Request("GET", url))
    try:
        hf_raise_for_status(response)
    except Exception as exc:  # noqa: BLE001 - returned for the fake to raise
        return exc
    raise AssertionError(f"HTTP {status} raised nothing")


API = "https://huggingface.co/api/models/meta-llama/Llama-3.1-8B-Instruct/revision/main"


@pytest.mark.parametrize(
    "refusal, expected",
    [
        (lambda: _hub_refusal(403, API, **{"X-Error-Code": "GatedRepo"}),
         "target.path=meta-llama/Llama-3.1-8B-Instruct: meta-llama/Llama-3.1-8B-Instruct is gated and no token was found: "
         "accept its terms on https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct with your Hugging Face account, "
         "give this machine that account's token (`export HF_TOKEN=hf_...` or `hf auth login` (`huggingface-cli login` "
         "before huggingface_hub 0.34)), then rerun `python -m stage1_extract download`"),
        (lambda: _hub_refusal(401, API),
         "target.path=meta-llama/Llama-3.1-8B-Instruct: the Hub has no repository meta-llama/Llama-3.1-8B-Instruct "
         "(https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct), or it is private or gated and no token was found: "
         "check the id, or give this machine the token of an account that can read it (`export HF_TOKEN=hf_...` or `hf "
         "auth login` (`huggingface-cli login` before huggingface_hub 0.34)), then rerun `python -m stage1_extract download`"),
        (lambda: _hub_refusal(401, API, **{"X-Error-Message": "Invalid credentials in Authorization header"}),
         "target.path=meta-llama/Llama-3.1-8B-Instruct: the Hub refused the token (HTTP 401: invalid credentials): set a "
         "valid one (`export HF_TOKEN=hf_...` or `hf auth login` (`huggingface-cli login` before huggingface_hub 0.34)), "
         "then rerun `python -m stage1_extract download`"),
        (lambda: _hub_refusal(404, API, **{"X-Error-Code": "RevisionNotFound"}),
         "target.path=meta-llama/Llama-3.1-8B-Instruct: meta-llama/Llama-3.1-8B-Instruct has no revision 'main' "
         "(https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/tree/main lists branches and commits): fix the @revision"),
    ],
    ids=["gated", "private-or-missing", "bad-token", "no-revision"],
)
def test_a_repo_the_hub_refuses_is_one_line_naming_the_token_and_the_page(hub, monkeypatch, tmp_path, refusal, expected):
    import huggingface_hub

    def refused(repo_id, **kw):
        raise refusal()

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refused)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    cfg = load_run_config("configs/default.yaml", ["target.path=meta-llama/Llama-3.1-8B-Instruct"])
    with pytest.raises(InputFileError) as error:
        stage1.cmd_download(cfg)
    assert str(error.value) == expected


def test_an_unreachable_hub_and_a_repo_without_safetensors_are_one_line(hub, monkeypatch, tmp_path, tiny_target_dir):
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    class OfflineOfHub0(LocalEntryNotFoundError, HfHubHTTPError):  # huggingface_hub 0.x (transformers 4.x) makes it both
        pass

    cfg = load_run_config("configs/default.yaml", ["target.path=org/model"])
    for error in (LocalEntryNotFoundError, OfflineOfHub0):
        def offline(repo_id, error=error, **kw):
            try:
                raise ConnectionError("no route to host")
            except ConnectionError as exc:  # snapshot_download's own wrapping of a failed connection
                raise error("An error happened while trying to locate the files on the Hub") from exc

        monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
        with pytest.raises(InputFileError, match=r"^target.path=org/model: cannot reach the Hub at https://huggingface.co "
                                                 r"\(ConnectionError\) and org/model@main is not in the cache at .*check the network"):
            stage1.cmd_download(cfg)

    pickles = tmp_path / "pickles"
    pickles.mkdir()
    for file in tiny_target_dir.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, pickles / file.name)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, cache_dir=None, **kw: str(
        add_to_hub_cache(Path(cache_dir), repo_id, pickles)))
    with pytest.raises(InputFileError, match=r"^target.path=org/model: org/model has no \*.safetensors weights in its top "
                                             r"folder \(https://huggingface.co/org/model\)"):
        stage1.cmd_download(cfg)


def test_a_snapshot_fetched_in_part_names_the_command_that_fetches_the_rest(tmp_path, monkeypatch, tiny_target_dir):
    """A Hub id whose cached snapshot holds its config.json but no tokenizer (`hf download ORG/NAME
    config.json`, a download cut short) passed `check`, then `plan` and `extract` died in
    transformers' tokenizer conversion with a bare traceback naming no file; one without its weights
    said only "no weight files". Both now name the folder and `download`."""
    from stage1_extract.plan import cmd_plan

    cache = tmp_path / "hf" / "hub"
    for repo, keep in (("org/config-only", ("config.json",)), ("org/no-weights", ("config.json", "tokenizer.json", "chat_template.jinja",
                                                                                   "tokenizer_config.json"))):
        part = tmp_path / repo
        part.mkdir(parents=True)
        for name in keep:
            shutil.copyfile(tiny_target_dir / name, part / name)
        add_to_hub_cache(cache, repo, part)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    snapshot = rf"{cache}/models--org--{{}}/snapshots/{COMMIT}"
    fetch = r"{} was fetched into the Hugging Face cache in part: `python -m stage1_extract download --config \.\.\.` fetches the rest"
    for command in (lambda cfg: cmd_plan(cfg), lambda cfg: stage1.cmd_extract(cfg, progress=False)):
        cfg = load_run_config("configs/default.yaml", stage1_overrides("org/config-only", data, tmp_path / "run"))
        with pytest.raises(InputFileError, match=r"^target\.path: no tokenizer files \(tokenizer\.json, .*\) in "
                                                 + snapshot.format("config-only") + "; " + fetch.format("org/config-only") + "$"):
            command(cfg)
        cfg = load_run_config("configs/default.yaml", stage1_overrides("org/no-weights", data, tmp_path / "run"))
        with pytest.raises(InputFileError, match=r"^no weight files \(\*\.safetensors, \*\.bin\) in " + snapshot.format("no-weights")
                                                 + "; " + fetch.format("org/no-weights") + "$"):
            command(cfg)
    local = load_run_config("configs/default.yaml", stage1_overrides(tmp_path / "org" / "config-only", data, tmp_path / "run"))
    with pytest.raises(InputFileError, match=r"no tokenizer files .* in .*org/config-only; copy the model's tokenizer files into it$"):
        stage1.cmd_extract(local, progress=False)


def test_stage2_plan_reads_a_hub_targets_shape_from_the_cache(hub):
    """`python -m stage2_train plan` read target.path as a folder only: a Hub id in the cache whose name
    is not a known shape (Qwen/Qwen3-14B, the tiny one here) was refused as "no config.json there ...
    copy the target's config.json into that folder", a folder that does not exist. It now reads the
    snapshot's config.json, and an id not cached names the download command."""
    from shared.errors import ConfigError
    from stage2_train.commands import cmd_plan, plan_inputs

    cfg = load_run_config("configs/default.yaml", ["target.path=tiny-org/tiny-target", "target.num_feature_layers=3"])
    inputs, source = plan_inputs(cfg)  # what cmd_plan traces (a tiny shape: the trace itself is the slow part)
    assert source == "config.json" and (inputs.arch.hidden_size, inputs.arch.num_hidden_layers) == (64, 6)
    missing = load_run_config("configs/default.yaml", ["target.path=tiny-org/other-target"])
    with pytest.raises(ConfigError, match=rf"^target\.path=tiny-org/other-target: not in the Hugging Face cache at {hub} and not a "
                                          r"known shape \(qwen3-8b, llama-3\.1-8b\); fetch it with `python -m stage1_extract "
                                          r"download --config \.\.\.` to plan for it$"):
        cmd_plan(missing, world_size=1)


def test_a_relative_folder_read_as_a_hub_id_says_where_the_folder_was_looked_for(hub, tmp_path, monkeypatch):
    """docs/config.md: a relative setting's missing file is refused naming the rule and the folder.
    `target.path: models/Qwen3-8B` written relative to the config file, run from elsewhere, was read
    as a Hub id and refused only as "not in the Hugging Face cache": the folder meant was never named."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputFileError) as refused:
        resolve_target_dir(TargetConfig(path="models/Qwen3-8B"))
    assert str(refused.value).endswith(
        f"or give a local folder (no folder models/Qwen3-8B under the working directory {tmp_path} either: a relative path "
        f"resolves against it, not against the config file's folder)")
    with pytest.raises(InputFileError) as refused:
        resolve_target_dir(TargetConfig(path="tiny-org/tiny-target@v2"))  # a revision: a Hub id, no folder meant
    assert str(refused.value).endswith("or give a local folder")
