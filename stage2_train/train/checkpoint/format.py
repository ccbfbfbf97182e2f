"""The checkpoint format (FORMAT_VERSION 2): the state schema, the files, and their verification.

    ckpt_dir/
      latest                     "step_000500": replaced atomically, after the directory is complete
      step_000500/
        model.safetensors        state["model"] under the model's own names (rank 0; export reads it)
        drafter.json             state["drafter"]: the drafter's description, to rebuild it (rank 0)
        shared.safetensors       the other tensors of SHARED_KEYS, e.g. the optimizer state (rank 0)
        shared.json              the plain values of SHARED_KEYS (rank 0)
        rank_00000.safetensors   tensors of every other component (RNG states, ...), one pair per rank
        rank_00000.json          plain values of every other component (sampler, noise, trainer, config)
        meta.json                version, step, world size, components, every file's size and sha256
      .tmp-step_001000/          a save being written; removed at start-up if a crash left it

The state has a schema. It maps component names to that component's `state_dict()`: nested dicts
with string keys (no "/"), whose leaves are tensors or plain JSON values (None, bool, int, float,
str, and lists of those). Tensors go to safetensors under their path ("optimizer/state/0/exp_avg"),
the rest to JSON; nothing is pickled, and anything else is a TypeError naming its path. Components
whose native state is not of that shape (an optimizer keys its state by int, RNG states are tuples
and numpy arrays) are wrapped: `optimizer_state`, `rng_state`.

DDP keeps model and optimizer identical on every rank, so rank 0 alone writes SHARED_KEYS; sharded
optimizer state (ZeRO, FSDP) is outside this format, and the trainer refuses those modes by name.
Verification (`checkpoint_problem`) checks sizes always and sha256 sums of the files asked for:
the shared files and a rank's own, or a rank's own only (so a resume on many ranks hashes each
file once, `saver.Checkpointer.select`).
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from shared.errors import CheckpointError, DivergedError
from shared.files import file_sha256, fsync_file, write_atomic
from shared.paths import STEP_FORMAT

FORMAT_VERSION = 2

SHARED_KEYS = ("model", "optimizer")  # identical on every DDP rank: written once, by rank 0
DESCRIPTION_KEY = "drafter"  # what the model is (model/description.py): drafter.json, written by rank 0
DESCRIPTION_FILE = "drafter.json"

STEP_DIR = re.compile(r"step_(\d+)")

TMP_PREFIX = ".tmp-"

SAFETENSORS_META = {"format": "pt"}  # what transformers' loaders expect in the header

MODEL_FILE = "model.safetensors"

# How long rank 0 waits for a file another rank reported written before it fails the save naming it:
# NFS may serve a cached view of the folder for up to acdirmax (60 s by default).
RANK_FILE_WAIT_S = 120.0


def step_name(step: int) -> str:
    return STEP_FORMAT.format(step)

def rank_stem(rank: int) -> str:
    return f"rank_{rank:05d}"


# ---- the schema -------------------------------------------------------------------------------
# ---- the schema -------------------------------------------------------------------------------
PLAIN_TYPES = (type(None), bool, int, float, str)

def split_tensors(
    obj: Any,
    path: str,
    tensors: dict[str, torch.Tensor],
    copy: Callable[[str, torch.Tensor], torch.Tensor],
    in_list: bool = False,
) -> Any:
    """The plain part of a component's state; its tensors go to `tensors` under their "/" path."""
    if isinstance(obj, torch.Tensor):
        if in_list:
            raise TypeError(f"checkpoint state {path}: a tensor inside a list (tensors go under string keys)")
        tensors[path] = copy(path, obj)
        return None
    if isinstance(obj, Mapping):
        out = {}
        for key, value in obj.items():
            if not isinstance(key, str) or "/" in key:
                raise TypeError(f"checkpoint state {path}: key {key!r} must be a string without '/'")
            if isinstance(value, torch.Tensor) and not in_list:
                tensors[f"{path}/{key}"] = copy(f"{path}/{key}", value)
            else:
                out[key] = split_tensors(value, f"{path}/{key}", tensors, copy, in_list)
        return out
    if isinstance(obj, (list, tuple)):
        return [split_tensors(v, f"{path}/{i}", tensors, copy, True) for i, v in enumerate(obj)]
    if isinstance(obj, PLAIN_TYPES):
        return obj
    raise TypeError(
        f"checkpoint state {path}: cannot store a {type(obj).__name__} (tensors and plain JSON values only)"
    )

def join_tensors(plain: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Put every "a/b/c" tensor back at plain["a"]["b"]["c"]."""
    for key, tensor in tensors.items():
        node = plain
        *parents, leaf = key.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = tensor
    return plain

def _model_tensors(model_state: Any) -> dict[str, torch.Tensor]:
    if not isinstance(model_state, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model_state.items()
    ):
        raise TypeError("checkpoint state 'model' must map parameter names to tensors")
    return dict(model_state)

def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's state_dict in the schema: its int parameter keys as strings."""
    native = optimizer.state_dict()
    return {"state": {str(k): dict(v) for k, v in native["state"].items()}, "param_groups": native["param_groups"]}

def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    native_state = {}
    for key, value in state["state"].items():
        entry = dict(value)
        if "step" in entry and not isinstance(entry["step"], torch.Tensor):
            entry["step"] = torch.tensor(float(entry["step"]))
        native_state[int(key)] = entry
    optimizer.load_state_dict({"state": native_state, "param_groups": state["param_groups"]})

def rng_state() -> dict[str, Any]:
    """This process's Python, numpy, torch (and CUDA) RNG states, in the schema."""
    version, internal, gauss = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {"name": name, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return state

def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["name"], np.asarray(n["key"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([state["cuda"][str(i)] for i in range(len(state["cuda"]))])

def check_finite_weights(tensors: dict[str, torch.Tensor], step: int) -> None:
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise DivergedError(
                f"refusing to save step {step}: model weight {name} holds {bad} non-finite values; "
                f"the previous checkpoints are kept"
            )


# ---- files ---------------------------------------------------------------------------------------
def write_part(directory: Path, stem: str, plain: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
    """Write `<stem>.safetensors` (unless it is the description) and `<stem>.json` (unless it is the
    model), fsynced. Returns bytes."""
    num_bytes = 0
    if stem != DESCRIPTION_KEY:
        tensor_path = directory / f"{stem}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, tensor_path, metadata=SAFETENSORS_META)
        fsync_file(tensor_path)
        num_bytes = tensor_path.stat().st_size
    if stem != "model":
        data = json.dumps(plain).encode()
        write_atomic(directory / f"{stem}.json", data)
        num_bytes += len(data)
    return num_bytes


def part_files(stem: str) -> list[str]:
    """The names of the files `write_part` writes for `stem`."""
    skip = {("json", "model"), ("safetensors", DESCRIPTION_KEY)}
    return [f"{stem}.{ext}" for ext in ("json", "safetensors") if (ext, stem) not in skip]


def expected_files(rank0_stems: list[str], world_size: int) -> list[str]:
    """Every file of a checkpoint but meta.json: rank 0's parts (model, shared, drafter, rank_00000)
    and each other rank's pair, by name (a directory listing on NFS can miss another node's)."""
    stems = [*rank0_stems, *(rank_stem(r) for r in range(1, world_size))]
    return sorted(name for stem in stems for name in part_files(stem))


def written_sizes(directory: Path, names: list[str]) -> dict[str, int]:
    """name -> size of each file in `directory`, which its rank reported written (and fsynced). One
    not there yet is waited for, up to RANK_FILE_WAIT_S in all (NFS's cached view of the folder: an
    open revalidates it), then the save fails naming it."""
    deadline = time.monotonic() + RANK_FILE_WAIT_S
    sizes = {}
    for name in names:
        while name not in sizes:
            try:
                with open(directory / name, "rb") as fh:
                    sizes[name] = os.fstat(fh.fileno()).st_size
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise CheckpointError(
                        f"checkpoint {directory}: {name} is not there {RANK_FILE_WAIT_S:.0f} s after its rank reported it "
                        f"written: checkpoint.dir ({directory.parent}) must be one folder every node sees; on NFS, mount "
                        f"it with lookupcache=positive (or a shorter actimeo) if the file shows up later"
                    ) from None
                time.sleep(0.2)
    return sizes


def read_meta(path: Path) -> dict[str, Any] | None:
    """meta.json of a complete checkpoint (every listed file present with its size), else None."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        files = meta["files"]
        for name, info in files.items():
            if (path / name).stat().st_size != info["bytes"]:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta


def files_to_verify(meta: dict[str, Any], rank: int, shared: bool = True) -> list[str]:
    """The files whose sha256 `rank` checks: its own rank files, and the shared ones when `shared`."""
    own = [n for n in meta["files"] if n.startswith(rank_stem(rank) + ".")]
    common = [n for n in meta["files"] if not n.startswith("rank_") and n != "meta.json"] if shared else []
    return common + own


def checkpoint_problem(path: Path, rank: int = 0, *, shared: bool = True) -> str | None:
    """Why `rank` cannot use the checkpoint at `path`, or None. Sizes are checked for every file;
    sha256 for the rank's own files, and for the shared ones (model, optimizer) when `shared`: on
    many ranks one rank hashes those and the others trust its verdict (`Checkpointer.select`)."""
    meta = read_meta(path)
    if meta is None:
        return "incomplete: meta.json missing or damaged, or a file missing or truncated"
    if meta.get("format_version") != FORMAT_VERSION:
        return f"format_version {meta.get('format_version')!r}, this code reads {FORMAT_VERSION}"
    if f"{rank_stem(rank)}.json" not in meta["files"]:
        return f"saved by {meta['world_size']} rank(s); it holds no state for rank {rank}"
    for name in files_to_verify(meta, rank, shared):
        if file_sha256(path / name) != meta["files"][name]["sha256"]:
            return f"{name} does not match its checksum (damaged)"
    return None


def load_checkpoint(path: str | os.PathLike, rank: int = 0, *, verified: bool = False) -> dict[str, Any]:
    """The state saved at `path` as seen by `rank`: shared parts plus this rank's own, CPU tensors.
    Every file it reads is checked against meta.json first, unless the caller `verified` it already
    (then sizes only)."""
    path = Path(path)
    problem = None if verified else checkpoint_problem(path, rank)
    meta = read_meta(path)
    if problem is None and meta is None:
        problem = "incomplete: meta.json missing or damaged, or a file missing or truncated"
    if problem is not None:
        raise CheckpointError(f"checkpoint {path}: {problem}")
    state: dict[str, Any] = {}
    if MODEL_FILE in meta["files"]:
        state["model"] = load_file(path / MODEL_FILE)
    if DESCRIPTION_FILE in meta["files"]:
        state[DESCRIPTION_KEY] = json.loads((path / DESCRIPTION_FILE).read_text())
    if "shared.json" in meta["files"]:
        shared = json.loads((path / "shared.json").read_text())
        state.update(join_tensors(shared, load_file(path / "shared.safetensors")))
    stem = rank_stem(rank)
    own = json.loads((path / f"{stem}.json").read_text())
    state.update(join_tensors(own, load_file(path / f"{stem}.safetensors")))
    return {key: state[key] for key in meta["keys"]}


def saved_run_config(path: str | os.PathLike) -> dict[str, Any] | None:
    """The resolved run config a checkpoint saved (its `config` component, in rank 0's JSON), read
    without opening a tensor file; None when it saved none. Not verified: the caller loads (and so
    verifies) the checkpoint too."""
    try:
        config = json.loads((Path(path) / f"{rank_stem(0)}.json").read_text()).get("config")
    except (OSError, ValueError, AttributeError):
        return None
    return config if isinstance(config, dict) else None


def read_weights(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], Path]:
    """(drafter weights, the file read) from a `model.safetensors`, or a folder holding one (a
    checkpoint step or an exported drafter). A training checkpoint is verified against its
    checksums first."""
    path = Path(path)
    folder, file = (path.parent, path) if path.is_file() else (path, path / MODEL_FILE)
    if not file.is_file():
        raise CheckpointError(f"no drafter weights at {path}: expected {MODEL_FILE}")
    if (folder / "meta.json").is_file():
        problem = checkpoint_problem(folder)
        if problem is not None:
            raise CheckpointError(f"checkpoint {folder}: {problem}")
    try:
        return load_file(file), file
    except Exception as exc:  # noqa: BLE001 - a damaged export: name it
        raise CheckpointError(f"{file} cannot be read ({exc})") from exc
