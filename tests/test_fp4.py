"""The fp4 store (`store.dtype: fp4`): decoding equals an independent reference quantizer bit for
bit, the outlier channels come back exact, the channel set is pinned once per store and used by
every shard, an fp4 store round-trips through extract, the reader and verify, and damage is caught."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.codecs import decode_hidden
from shared.errors import StoreError
from shared.fp4 import decode_fp4, encode_fp4, fit_outlier_channels
from shared.reader import StoreReader
from shared.store import bytes_per_token, read_manifest, read_shard_arrays
from stage1_extract import commands

from .conftest import chat_rows, stage1_overrides, write_jsonl

ROOT = Path(__file__).resolve().parent.parent

# ---- the reference: numpy, written from the format's definition, sharing no code with shared/fp4.py
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def ref_e4m3(v: np.ndarray) -> np.ndarray:
    """Non-negative float32 -> the nearest e4m3 value (3 mantissa bits, exponents >= -6, subnormal
    steps of 2^-9, at most 448), ties to even."""
    v = np.minimum(v.astype(np.float64), 448.0)
    _, e = np.frexp(v)  # v = m * 2^e, m in [0.5, 1)
    step = np.ldexp(1.0, np.maximum(e - 1, -6) - 3)
    return (np.round(v / step) * step).astype(np.float32)  # np.round: half to even


def ref_e2m1(y: np.ndarray) -> np.ndarray:
    """float32 -> the nearest of +-GRID (|y| clamped to 6); on a tie the even grid index."""
    a = np.minimum(np.abs(y).astype(np.float64), 6.0)
    d = np.abs(a[..., None] - GRID)
    nearest = d == d.min(axis=-1, keepdims=True)
    even = nearest & (np.arange(8) % 2 == 0)
    index = np.where(even.any(axis=-1), even.argmax(axis=-1), nearest.argmax(axis=-1))
    return (np.sign(y) * GRID[index]).astype(np.float32)


def ref_roundtrip(x_TLH: np.ndarray, channels_LN: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [T, L, H] -> (what decoding must return as float32 before the bf16 cast, |y| values
    that the quantizer saw, to check that ties were exercised)."""
    T, L, H = x_TLH.shape
    x = x_TLH.astype(np.float32).copy()
    exact = np.take_along_axis(x, np.broadcast_to(channels_LN[None], (T, L, channels_LN.shape[1])), axis=2).copy()
    np.put_along_axis(x, np.broadcast_to(channels_LN[None], exact.shape), np.float32(0), axis=2)
    amax = np.abs(x).max(axis=-1)
    s = np.where(amax > 0, amax / np.float32(2688.0), np.float32(1.0)).astype(np.float32)
    groups = x.reshape(T, L, H // 16, 16)
    g = ref_e4m3(np.abs(groups).max(axis=-1) / s[..., None] / np.float32(6.0))
    step = (g * s[..., None]).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(step[..., None] > 0, groups / step[..., None], np.float32(0)).astype(np.float32)
    out = (ref_e2m1(y) * step[..., None]).astype(np.float32).reshape(T, L, H)
    # The exact channels are stored as bf16 (what every store returns).
    np.put_along_axis(out, np.broadcast_to(channels_LN[None], exact.shape), bf16(exact), axis=2)
    return out, np.abs(y)


def bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).float().numpy()


def features(T: int = 40, L: int = 3, H: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random features with massive channels per layer, a zero token, a zero group, tiny groups,
    and a token whose values sit on the e2m1 midpoints exactly (ties)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, L, H)).astype(np.float32) * rng.uniform(0.01, 20, (T, L, 1)).astype(np.float32)
    channels = np.array([[3, 40], [7, 8], [0, 63]], dtype=np.int32)[:L]
    for layer in range(L):
        x[:, layer, channels[layer]] *= 500.0  # massive activations
    x[1] = 0.0  # a zero token: s = 1, every group scale 0
    x[2, :, 16:32] = 0.0  # a zero group
    x[3, :, 32:48] *= 1e-7  # groups far below the token's maximum: group scales underflow toward 0
    # Token 4, layer 0: s = 2.625 / 2688 = 2^-10 exactly, so the largest group's scale is 448 and its
    # step 0.4375; values on the midpoints between e2m1 values divide to them exactly.
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
    row = np.zeros(H, dtype=np.float32)
    row[:] = rng.uniform(-2.625, 2.625, H).astype(np.float32)
    row[16:32] = np.concatenate([[6.0], mids, -mids, [0.0]]) * np.float32(0.4375)
    row[channels[0]] = 1000.0
    x[4, 0] = row
    return x, channels


def test_decoding_equals_an_independent_reference_quantizer_exactly():
    x, channels = features()
    stored = encode_fp4(torch.from_numpy(x), channels)
    decoded = decode_fp4(**stored)
    want, seen = ref_roundtrip(x, channels)
    assert decoded.dtype == torch.bfloat16 and decoded.shape == x.shape
    assert torch.equal(decoded, torch.from_numpy(want).to(torch.bfloat16))
    # The cases the reference was built for were met: ties, zero groups, a zero token.
    assert np.isin(seen[4, 0, 1], [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]).sum() == 14
    assert (decoded[1] == 0).all() and (decoded[2, :, 16:32] == 0).all()
    # And the stored form is the documented one: shapes, dtypes, the token scale.
    assert stored["hidden"].shape == (40, 3, 32) and stored["hidden"].dtype == np.uint8
    assert stored["hidden_group_scale"].shape == (40, 3, 4) and stored["hidden_outliers"].shape == (40, 3, 2)
    assert stored["hidden_scale"][4, 0] == np.float32(2.0**-10)


def test_ties_round_to_the_even_code():
    """On the tie token, 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    (times the step 0.4375), mirrored for negatives."""
    x, channels = features()
    got = decode_fp4(**encode_fp4(torch.from_numpy(x), channels))[4, 0, 16:32].float().numpy() / 0.4375
    assert got.tolist() == [6, 0, 1, 1, 2, 2, 4, 4, 0, -1, -1, -2, -2, -4, -4, 0]


def test_outlier_channels_come_back_exact_and_spare_their_groups():
    x, channels = features(seed=1)
    decoded = decode_fp4(**encode_fp4(torch.from_numpy(x), channels)).float().numpy()
    for layer in range(3):
        np.testing.assert_array_equal(decoded[:, layer, channels[layer]], bf16(x[:, layer, channels[layer]]))
    # The other channels: fp4's own error with the massive ones set apart; with none set apart, a
    # massive channel sets its group's scale and flattens the other 15 values of the group to 0.
    none_apart = decode_fp4(**encode_fp4(torch.from_numpy(x), np.zeros((3, 0), np.int32))).float().numpy()
    rest = np.ones(64, bool)
    rest[channels[0]] = False
    part = x[5:, 0, rest]

    def median_error(y: np.ndarray) -> float:
        return float(np.median(np.linalg.norm(y[5:, 0, rest] - part, axis=-1) / np.linalg.norm(part, axis=-1)))

    assert 0.02 < median_error(decoded) < 0.15
    assert median_error(none_apart) > 4 * median_error(decoded)


def test_fit_picks_each_layers_largest_mean_magnitude_channels():
    abs_sum_LH = np.array([[1.0, 9.0, 3.0, 9.0, 0.5], [5.0, 0.0, 4.0, 1.0, 6.0]])
    assert fit_outlier_channels(abs_sum_LH, 2).tolist() == [[1, 3], [0, 4]]
    assert fit_outlier_channels(abs_sum_LH, 0).shape == (2, 0)


def test_bytes_per_token_at_the_qwen3_8b_shape():
    # 5 x (2048 codes + 256 group scales + 4 token scale + 8 x 2 exact) + top-64 (384) + ids/mask (5)
    assert bytes_per_token("fp4", 5, 4096, 64, outlier_channels=8) == 12009
    assert bytes_per_token("fp8", 5, 4096, 64) == 20889


# ---- the store


def config(tiny_target_dir, data, run_dir, **extra):
    from shared.config import load_run_config

    extra = {"store.dtype": "fp4", "store.fp4_outlier_channels": 4, **extra}
    return load_run_config(ROOT / "configs/default.yaml", stage1_overrides(tiny_target_dir, data, run_dir, **extra))


@pytest.fixture(scope="module")
def fp4_store(tiny_target_dir, tmp_path_factory):
    data = write_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", chat_rows(100))  # 2 shards of 1 MB
    run_dir = tmp_path_factory.mktemp("run")
    cfg = config(tiny_target_dir, data, run_dir)
    summary = commands.cmd_extract(cfg, progress=False)
    bf16_cfg = config(tiny_target_dir, data, run_dir, **{"store.dtype": "bf16", "store.path": str(run_dir / "store-bf16")})
    commands.cmd_extract(bf16_cfg, progress=False)
    return cfg, summary, data, run_dir


def test_an_fp4_store_round_trips_through_the_reader_and_verify(fp4_store):
    cfg, summary, _, run_dir = fp4_store
    url = cfg.store.url(cfg.run_dir)
    manifest = read_manifest(url)
    plan = json.loads((Path(url) / "plan.json").read_text())
    channels = plan["fp4_outlier_channels"]["channels"]
    assert manifest["storage"] == {"dtype": "fp4", "compression": "zstd", "zstd_level": 3, "chunk_tokens": 1024,
                                   "fp4_outlier_channels": 4}
    assert manifest["fp4_outlier_channels"] == channels and np.asarray(channels).shape == (3, 4)
    assert plan["fp4_outlier_channels"]["fitted_on"]["shard"] == 0
    assert len(manifest["shards"]) >= 2
    reader, bf16_reader = StoreReader(url), StoreReader(str(run_dir / "store-bf16"))
    assert reader.feature_shape == (3, 64)
    for record in manifest["shards"]:  # one channel set, in every shard
        assert read_shard_arrays(url, record["name"])["hidden_outlier_channels"].tolist() == channels
    first = manifest["shards"][1]
    arrays = read_shard_arrays(url, first["name"])
    start = manifest["shards"][0]["num_samples"]
    for local in range(first["num_samples"]):
        index = start + local
        lo, hi = int(arrays["offsets"][local]), int(arrays["offsets"][local + 1])
        want = decode_hidden(
            arrays["hidden"][lo:hi], arrays["hidden_scale"][lo:hi], "fp4", hidden_group_scale=arrays["hidden_group_scale"][lo:hi],
            hidden_outliers=arrays["hidden_outliers"][lo:hi], hidden_outlier_channels=arrays["hidden_outlier_channels"],
        )
        sample = reader.read(index)
        assert torch.equal(sample["hidden_TLH"], want)
        into = torch.empty(hi - lo, 3, 64, dtype=torch.bfloat16)  # the loader's fast path
        assert reader.read(index, hidden_out=into)["hidden_TLH"] is into and torch.equal(into, want)
        window = reader.read(index, 2, 9)["hidden_TLH"]
        assert torch.equal(window, want[2:9])
        exact = bf16_reader.read(index)["hidden_TLH"]
        for layer in range(3):
            assert torch.equal(sample["hidden_TLH"][:, layer, channels[layer]], exact[:, layer, channels[layer]])
        rel = (sample["hidden_TLH"].float() - exact.float()).norm(dim=-1) / exact.float().norm(dim=-1)
        assert rel.median() < 0.15
    assert commands.cmd_verify(cfg)["ok"]
    plan_out = commands.cmd_plan(cfg)
    assert plan_out["bytes_per_token"] == 3 * (32 + 4 + 4 + 2 * 4) + 8 * 6 + 5
    assert plan_out["storage"] == "fp4 (e2m1/16 + e4m3 scales + 4 exact channels)+zstd"


def test_a_rerun_keeps_the_pinned_channels_and_rewrites_nothing(fp4_store):
    cfg, _, _, _ = fp4_store
    url = cfg.store.url(cfg.run_dir)
    before = (Path(url) / "plan.json").read_text()
    again = commands.cmd_extract(cfg, progress=False)
    assert again["shards_extracted_here"] == 0 and (Path(url) / "plan.json").read_text() == before


@pytest.mark.slow
def test_a_reprocess_with_another_outlier_count_refits_and_rewrites_every_shard(fp4_store, tmp_path, copy_tree):
    cfg, _, data, _ = fp4_store
    copy_tree(Path(cfg.store.url(cfg.run_dir)), tmp_path / "store")
    changed = config(cfg.target.path, data, tmp_path, **{"store.fp4_outlier_channels": 2})
    with pytest.raises(StoreError, match="fp4_outlier_channels=4"):
        commands.cmd_extract(changed, progress=False)
    summary = commands.cmd_reprocess(changed, progress=False)
    assert len(summary["reextracted"]) == summary["shards_total"]
    manifest = read_manifest(str(tmp_path / "store"))
    assert np.asarray(manifest["fp4_outlier_channels"]).shape == (3, 2)
    assert commands.cmd_verify(changed)["ok"]


@pytest.mark.slow
def test_a_reprocess_stopped_before_its_fit_refits_when_run_again(fp4_store, tmp_path, copy_tree, monkeypatch):
    """reprocess repins plan.json's header, then fits the channels with the target: stopped between the
    two (the target failed to load), the rerun saw no change of header and kept the old layers' set."""
    cfg, _, data, _ = fp4_store
    old = read_manifest(cfg.store.url(cfg.run_dir))["fp4_outlier_channels"]
    other_layers = {"target.layer_ids": [0, 1, 4]}  # as many layers as before: the old set has the right shape
    copy_tree(Path(cfg.store.url(cfg.run_dir)), tmp_path / "clean" / "store")
    commands.cmd_reprocess(config(cfg.target.path, data, tmp_path / "clean", **other_layers), progress=False)
    fitted = read_manifest(str(tmp_path / "clean" / "store"))["fp4_outlier_channels"]
    assert fitted != old  # the layers' own set differs, so the test tells them apart

    copy_tree(Path(cfg.store.url(cfg.run_dir)), tmp_path / "stopped" / "store")
    changed = config(cfg.target.path, data, tmp_path / "stopped", **other_layers)

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr("stage1_extract.outliers.load_target_model", out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        commands.cmd_reprocess(changed, progress=False)
    monkeypatch.undo()
    commands.cmd_reprocess(changed, progress=False)
    manifest = read_manifest(str(tmp_path / "stopped" / "store"))
    assert manifest["fp4_outlier_channels"] == fitted
    assert commands.cmd_verify(changed)["ok"]


def corrupt(url: str, shard: str, array: str, edit) -> None:
    import zarr

    target = zarr.open_array(store=url, path=f"shards/{shard}/{array}", mode="r+")
    data = target[...]
    edit(data)
    target[...] = data


@pytest.mark.parametrize(
    "array, edit, message",
    [
        ("hidden_group_scale", lambda a: a.__setitem__((0, 0, 0), 0x7F), "group scales NaN or negative"),
        ("hidden_scale", lambda a: a.__setitem__((0, 0), np.nan), "hidden_scale values not finite"),
        ("hidden_outliers", lambda a: a.__setitem__((0, 0, 0), 0x7FC0), "non-finite hidden values"),
        ("hidden_outlier_channels", lambda a: a.__setitem__((0, 0), (a[0, 0] + 1) % 64), "outlier channels differ"),
        ("hidden", lambda a: a.__setitem__((0, 0, 0), a[0, 0, 0] ^ 0x11), "content checksum differs"),
    ],
)
def test_a_corrupted_fp4_shard_is_caught_by_verify(fp4_store, tmp_path, copy_tree, array, edit, message):
    cfg, _, data, _ = fp4_store
    url = str(copy_tree(Path(cfg.store.url(cfg.run_dir)), tmp_path / "store"))
    shard = read_manifest(url)["shards"][1]["name"]
    corrupt(url, shard, array, edit)
    report = commands.cmd_verify(config(cfg.target.path, data, tmp_path))
    assert not report["ok"] and [b["shard"] for b in report["bad_shards"]] == [shard]
    assert message in report["bad_shards"][0]["error"]


def test_an_fp4_store_never_passes_as_fp8(fp4_store, tmp_path, copy_tree):
    cfg, _, _, _ = fp4_store
    url = copy_tree(Path(cfg.store.url(cfg.run_dir)), tmp_path / "store")
    manifest = json.loads((url / "manifest.json").read_text())
    manifest["storage"] = {k: v for k, v in manifest["storage"].items() if k != "fp4_outlier_channels"} | {"dtype": "fp8"}
    (url / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="hidden states 32 wide as fp8, the manifest says 64"):
        StoreReader(str(url))[0]


@pytest.mark.slow
def test_two_processes_pin_one_channel_set_and_equal_one_process(fp4_store, tmp_path):
    """Rank 0 fits and pins the channels before the barrier; rank 1 encodes its shards with them."""
    import os
    import subprocess
    import sys

    cfg, _, data, _ = fp4_store
    overrides = stage1_overrides(Path(cfg.target.path), data, tmp_path, **{"store.dtype": "fp4", "store.fp4_outlier_channels": 4})
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "stage1_extract", "extract", "--no-progress", *overrides,
    ]
    out = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    one, two = read_manifest(cfg.store.url(cfg.run_dir)), read_manifest(str(tmp_path / "store"))
    assert two["fp4_outlier_channels"] == one["fp4_outlier_channels"]
    assert [(r["name"], r["checksum"]) for r in two["shards"]] == [(r["name"], r["checksum"]) for r in one["shards"]]


def test_no_outlier_channels_is_refused_before_the_target_runs():
    """fp4 with 0 exact channels cannot be written (zarr refuses a [L, 0] array): refused by the
    config, naming the field, not after the whole target forward."""
    from shared.store import StoreConfig

    with pytest.raises(ValueError, match=r"fp4_outlier_channels.*must be in 1\.\.256"):
        StoreConfig(dtype="fp4", fp4_outlier_channels=0)
    assert StoreConfig(dtype="fp4", fp4_outlier_channels=1).fp4_outlier_channels == 1
