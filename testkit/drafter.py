"""A tiny drafter, its target's architecture and packed batches built by hand, for tests and benchmarks.

    arch = tiny_arch(kv_heads=2)
    drafter = tiny_drafter(arch, num_layers=2)               # random frozen embedding and LM head
    batch = three_sample_batch(arch)                         # three samples packed, shuffled
    graphs, worst = compiled_flex_over_packs(packs, kind, heads=4, kv_heads=2, head_dim=16)
"""

from __future__ import annotations

import torch

from shared.target import TargetArch
from stage2_train.data.batch import DrafterBatch
from stage2_train.model.config import DrafterConfig
from stage2_train.model.drafter import DFlashDrafter

MASK_ID = 99


def tiny_arch(hidden=64, heads=4, kv_heads=4, head_dim=16, vocab=100, inter=96) -> TargetArch:
    return TargetArch(
        model_type="qwen3",
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=8,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def tiny_drafter(
    arch: TargetArch, num_layers=2, block_size=4, num_feature_layers=2, seed=0, **cfg
) -> DFlashDrafter:
    torch.manual_seed(seed)
    model = DFlashDrafter(
        DrafterConfig(num_layers=num_layers, block_size=block_size, init_std=0.2, **cfg),
        arch,
        num_feature_layers,
        MASK_ID,
    )
    model.set_frozen_parts(
        torch.randn(arch.vocab_size, arch.hidden_size), torch.randn(arch.vocab_size, arch.hidden_size)
    )
    return model


def make_packed_batch(
    tokens: list[list[int]],
    anchors: list[list[int]],
    block_size: int,
    feat_dim: int,
    shuffle: bool = False,
    top_k: int = 0,
    seed: int = 0,
) -> DrafterBatch:
    """Context = every token of every sample; one block per anchor; slot k labelled tokens[a + k]."""
    gen = torch.Generator().manual_seed(seed)
    ctx_seq, ctx_pos, blocks, labels, blk_seq, blk_anchor = [], [], [], [], [], []
    for s, (toks, anc) in enumerate(zip(tokens, anchors)):
        ctx_seq += [s] * len(toks)
        ctx_pos += list(range(len(toks)))
        for a in anc:
            blocks.append([toks[a]] + [MASK_ID] * (block_size - 1))
            labels.append([-100] + [toks[a + k] if a + k < len(toks) else -100 for k in range(1, block_size)])
            blk_seq.append(s)
            blk_anchor.append(a)
    T, N = len(ctx_seq), len(blocks)
    ctx_perm = torch.randperm(T, generator=gen) if shuffle else torch.arange(T)
    blk_perm = torch.randperm(N, generator=gen) if shuffle else torch.arange(N)
    batch = DrafterBatch(
        context_TF=torch.randn(T, feat_dim, generator=gen),
        context_pos_T=torch.tensor(ctx_pos)[ctx_perm],
        context_seq_T=torch.tensor(ctx_seq)[ctx_perm],
        block_ids_NB=torch.tensor(blocks)[blk_perm],
        block_seq_N=torch.tensor(blk_seq)[blk_perm],
        anchor_pos_N=torch.tensor(blk_anchor)[blk_perm],
        labels_NB=torch.tensor(labels)[blk_perm],
        num_samples=len(tokens),
        num_tokens=T,
    )
    if top_k:
        batch.topk_logprobs_NBK = torch.randn(N, block_size, top_k, generator=gen).log_softmax(-1)
        batch.topk_ids_NBK = torch.randint(0, MASK_ID, (N, block_size, top_k), generator=gen)
    return batch


def compiled_flex_over_packs(
    packs: list[DrafterBatch], kind, heads: int, kv_heads: int, head_dim: int, dtype=torch.float32, check: int | None = None
) -> tuple[list[int], float]:
    """Compiled flex attention (attention.COMPILE_BACKEND, from a fresh dynamo) over packs of different
    shapes, each on its own device, with random q/k/v: dynamo's graph count after each pack, and the
    largest |difference| from the rule written out (the naive plan) over the first `check` packs (all
    when None). tests/test_attention.py runs it on CPU, bench/gpu_check.py with inductor on a GPU."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from stage2_train.model import attention

    def reset() -> None:
        attention._flex_attention.cache_clear()
        attention._block_mask_builder.cache_clear()
        torch._dynamo.reset()

    reset()
    counters.clear()
    graphs, worst, scale = [], 0.0, head_dim**-0.5
    try:
        with torch.no_grad():
            for i, batch in enumerate(packs):
                (N, B), T, device = batch.block_ids_NB.shape, batch.context_TF.shape[0], batch.anchor_pos_N.device
                q = torch.randn(N, B, heads, head_dim, device=device, dtype=dtype)
                k_ctx, v_ctx = (torch.randn(T, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2))
                k_blk, v_blk = (torch.randn(N, B, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2))
                plan = attention._plan_flex(batch, B, kind, compiled=True)
                out = attention.packed_attention(q, k_ctx, v_ctx, k_blk, v_blk, plan, scale=scale)
                if check is None or i < check:  # the rule is quadratic: a few packs on large shapes
                    naive = attention.AttentionPlan("naive", B, kind, batch=batch)
                    ref = attention.packed_attention(q, k_ctx, v_ctx, k_blk, v_blk, naive, scale=scale)
                    worst = max(worst, float((out.float() - ref.float()).abs().max()))
                graphs.append(counters["stats"]["unique_graphs"])
    finally:
        reset()
    return graphs, worst


def three_sample_batch(arch, block_size=4, shuffle=True, num_feature_layers=2) -> DrafterBatch:
    gen = torch.Generator().manual_seed(1)
    lengths = [23, 9, 31]
    tokens = [torch.randint(0, MASK_ID, (n,), generator=gen).tolist() for n in lengths]
    anchors = [[0, 5, 11, 20], [0, 3, 7], [2, 9, 10, 17, 29]]
    return make_packed_batch(
        tokens, anchors, block_size, num_feature_layers * arch.hidden_size, shuffle=shuffle
    )
