"""The target as a model: the compute dtype and attention kernel a device gets, loading the frozen
target for generation and extraction, and the hooks that capture its layers' outputs.

    model = load_target_model(cfg.target, "cuda:3")
    capture = LayerCapture(model, layer_ids)          # decoder layer i's output = HF hidden_states[i + 1]
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from shared.errors import ConfigError
from shared.target import TargetConfig, resolve_target_dir


def resolve_device(setting: str) -> str:
    """A device setting (`extract.device`, `train.device`) as a device kind: auto = cuda when torch
    sees a GPU, else cpu."""
    if setting != "auto":
        return setting
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"



TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(requested: str, device: str) -> str:
    if requested != "auto":
        return requested
    return "bf16" if device.startswith("cuda") or cpu_has_native_bf16() else "fp32"


def pick_attn_implementation(requested: str, device: str, dtype: str | None = None) -> str:
    """flash-attn when asked, or when it is installed on a GPU and the target computes in 16 bits
    (flash-attn refuses fp32: transformers only warns at load, the first forward raises); SDPA
    everywhere else. Asking for flash-attn in fp32 is refused here, naming both settings."""
    if requested == "flash_attention_2" and dtype == "fp32":
        raise ConfigError(
            "target.attn_implementation=flash_attention_2 cannot run an fp32 target (flash-attn computes in "
            "fp16/bf16 only): set target.attn_implementation=sdpa, or a bf16 dtype (target.dtype, or "
            "eval.online_dtype for online evaluation)"
        )
    if requested != "auto":
        return requested
    if device.startswith("cuda") and dtype != "fp32" and flash_attn_importable():
        return "flash_attention_2"
    return "sdpa"


def flash_attn_importable() -> bool:
    """flash-attn installed and importable. A build for another torch or CUDA is found on the path but
    fails at import (an undefined symbol), which transformers meets only when it loads the target,
    after `auto` had pinned flash-attn (and packed batches) into a new store's header."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        importlib.import_module("flash_attn")
    except Exception:  # noqa: BLE001 - any import failure: SDPA runs instead
        return False
    return True


def load_target_model(
    cfg: TargetConfig,
    device: str = "cpu",
    *,
    dtype: str | None = None,
    attn_implementation: str | None = None,
    split: dict[str, Any] | None = None,
) -> Any:
    """The full frozen target in eval mode, for generation and extraction. `dtype` and
    `attn_implementation` (an existing store's settings) replace the config's `auto` choice. `split`:
    from_pretrained's tensor-parallel arguments (stage1_extract/tensor_parallel.py), which place each
    rank's share of the weights on its own device."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = resolve_target_dir(cfg)
    safetensors = any(model_dir.glob("*.safetensors"))
    if not safetensors and not cfg.allow_pickle_weights:
        raise ConfigError(
            f"target.path={cfg.path!r} holds only pickle (.bin) weights, which run code when loaded; convert "
            f"them to safetensors, or set target.allow_pickle_weights=true if you trust the files"
        )
    dtype = dtype or resolve_dtype(cfg.dtype, device)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        use_safetensors=safetensors,
        dtype=getattr(torch, TORCH_DTYPES[dtype]),
        attn_implementation=pick_attn_implementation(attn_implementation or cfg.attn_implementation, device, dtype),
        # Straight onto the GPU: an 8B target would otherwise pass 16 GB through host memory per rank.
        **(split or {"device_map": device if device.startswith("cuda") else None}),
    )
    if split is None:
        model.to(device)
    model.eval().requires_grad_(False)
    return model


def runnable_problem(settings: dict[str, Any], device: str) -> str | None:
    """Why a store's extraction settings cannot run on `device` (flash-attn off a GPU, or not
    installed), or None."""
    if settings.get("attn_implementation") == "flash_attention_2":
        if not device.startswith("cuda"):
            return f"attention flash_attention_2 needs a GPU, this command runs on {device}"
        if not flash_attn_importable():
            return "attention flash_attention_2 needs the flash-attn package, importable (`pip install -e '.[gpu]'`)"
    return None


class LayerCapture:
    """Forward hooks keeping the outputs of the chosen decoder layers, and nothing else.

    Decoder layer i's output is HF `hidden_states[i + 1]`, taken from the layer itself: for
    i = L - 1 that differs from `hidden_states[L]`, which HF takes after the final norm. Stage 1
    stores these features; speculative decoding feeds the same ones to the drafter."""

    def __init__(self, model: Any, layer_ids: list[int]):
        layers = model.get_decoder().layers
        if not layer_ids or max(layer_ids) >= len(layers):
            raise ValueError(f"layer ids {layer_ids} must name some of the target's {len(layers)} layers")
        self.layer_ids = list(layer_ids)
        self.outputs: dict[int, Any] = {}
        self.handles = [layers[i].register_forward_hook(self._hook(i)) for i in self.layer_ids]

    def _hook(self, layer_id: int):
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            self.outputs[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def stacked(self) -> Any:
        """[..., L, H] of the last forward, layers in id order; clears what was captured."""
        import torch

        out = torch.stack([self.outputs[i] for i in self.layer_ids], dim=-2)
        self.outputs.clear()
        return out

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
