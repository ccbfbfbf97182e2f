"""A tiny random target with the embedded tokenizer, for tests, benchmarks and CPU smoke runs.

A 6-layer, 64-wide Llama carrying the embedded SmolLM2's tokenizer, chat template and 49K vocab:
everything that depends on them is real while the forward costs almost nothing. The pipeline
itself never uses it.
"""

from __future__ import annotations

from pathlib import Path


def build_tiny_target(out: Path, *, seed: int = 0, max_positions: int = 2048, init_std: float = 0.02) -> Path:
    """Write the model and tokenizer to `out` (a local HF folder usable as target.path)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from shared.embedded import default_target_dir

    tokenizer = AutoTokenizer.from_pretrained(default_target_dir())
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
