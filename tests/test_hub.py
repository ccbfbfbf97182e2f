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
from shared.target import TargetConfig, resolve_target, resolve_target_dir
from stage1_extract import commands as stage1
from tests.conftest import add_to_hub_cache, chat_rows, stage1_overrides, write_jsonl

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
    manifest = stage1.load_manifest(stage1.StoreFiles(cfg.store.url(cfg.run_dir)))
    assert manifest["target_source"]["hub_id"] == "tiny-org/tiny-target" and manifest["target_source"]["commit"] == COMMIT
    assert stage1.cmd_status(cfg)["complete"]


def test_download_fetches_only_hub_ids_and_only_when_asked(hub, monkeypatch, tmp_path):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, revision=None, cache_dir=None, local_files_only=False, **kw):
        if not local_files_only:
            calls.append((repo_id, revision))
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
