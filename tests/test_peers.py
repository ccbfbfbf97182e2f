"""Parity with the peers' own code: z-lab `dflash==0.1.0`, SpecForge `0.2.0`, speculators `0.9.0`.

    bash tests/peers_install.sh          # once: installs them outside the venv, prints DFLASH_PEERS
    DFLASH_PEERS=/tmp/dflash-peers/zlab:/tmp/dflash-peers/specforge:/tmp/dflash-peers/speculators \
        .venv/bin/python -m pytest -q tests/test_peers.py

Skipped without DFLASH_PEERS (CI): the peers are never project dependencies. Each test imports its
peer lazily, so a missing peer skips only its own tests. Everything runs in fp32 on tiny shapes;
every test compares numbers, not "it ran":

- z-lab: our folder (export format "zlab") loaded by `dflash.model.DFlashDraftModel.from_pretrained`,
  its inference forward for one anchor at a time (context = features of positions < anchor) against
  our packed training forward: full, sliding (W shorter than the context) and causal layouts, and a
  window shorter than the block (z-lab windows the block's own slots too; so do we).
- SpecForge: the same folder in its `DFlashDraftModel`, driven by its training wrapper
  (`OnlineDFlashModel._forward_draft_blocks`: its noise blocks, position ids and per-layer-type
  masks from `create_dflash_sdpa_mask`) for several anchors at once. Only where block_size <= W:
  beyond that SpecForge never windows a block's own slots while z-lab does, so the two references
  disagree there and z-lab (what serves the drafter) is the one compared.
- speculators: export format "speculators" loaded by its `DFlashDraftModel.from_pretrained` (verifier
  parts refilled from a local verifier folder), its training backbone on a packed row of two
  documents against ours; then its folders read back by our `folder_description` / `init_weights_for`.
  Full attention only: speculators fixes a sliding window at the block's anchor (our export refuses).
- speculators' `dpace_loss_decay` against our `dpace_weights`, and its Muon/AdamW split against ours.

The DSpark and DFlash2 variants' parity (speculators' classes, z-lab's DFlash2) is in
tests/test_peers_variants.py, which uses the helpers here.

Shape legend: T tokens of a sample, L feature layers, H hidden, N blocks, B block size, V vocab.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shared.target_parts import load_embed_and_head
from stage2_train.data.batch import DrafterBatch, collate
from stage2_train.model.description import describe_parts
from stage2_train.model.drafter import DFlashDrafter, build_drafter
from stage2_train.model.loss import dpace_weights
from stage2_train.serve.export import export_drafter
from stage2_train.serve.load import folder_description, init_weights_for, load_exported
from stage2_train.train.schedules import muon_params
from testkit.drafter import MASK_ID, tiny_arch, tiny_drafter

PEERS = [p for p in os.environ.get("DFLASH_PEERS", "").split(":") if p]
pytestmark = pytest.mark.skipif(
    not PEERS,
    reason="peer packages not installed: run `bash tests/peers_install.sh` and export the DFLASH_PEERS it prints",
)
for _folder in PEERS:  # appended: the venv's torch / transformers always win over a peer folder
    if _folder not in sys.path:
        sys.path.append(_folder)

LAYER_IDS = [1, 3]  # two feature layers of an 8-layer target
BLOCK = 4
ATOL = 1e-5
SLIDING_MIXED = ("sliding_attention", "sliding_attention", "full_attention")
FULL3 = ("full_attention",) * 3


# ---------------------------------------------------------------------------------------------
# Our side


def our_drafter(layer_types=None, sliding_window=None, is_causal=None, seed=0) -> DFlashDrafter:
    """A 3-layer drafter (GQA 4/2 heads) with every weight random, the norms included (so a swapped
    q_norm/k_norm or hidden_norm/norm could not pass)."""
    drafter = tiny_drafter(
        tiny_arch(kv_heads=2),
        num_layers=3,
        block_size=BLOCK,
        num_feature_layers=len(LAYER_IDS),
        seed=seed,
        layer_types=layer_types,
        sliding_window=sliding_window,
        is_causal=is_causal,
        attention="sdpa",
    )
    randomize_norms(drafter, seed)
    return drafter.eval()


def randomize_norms(drafter: DFlashDrafter, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))


def make_samples(lengths: list[int], hidden: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Samples as the store gives them: ids, loss mask, hidden_TLH (feature layers in id order)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids_T": torch.randint(0, MASK_ID, (T,), generator=gen),
            "loss_mask_T": torch.ones(T, dtype=torch.bool),
            "hidden_TLH": torch.randn(T, len(LAYER_IDS), hidden, generator=gen),
        }
        for T in lengths
    ]


def pack(samples, anchors: list[list[int]]) -> DrafterBatch:
    """Our packed micro-batch, built by the trainer's own collate."""
    return collate(
        samples,
        [torch.tensor(a) for a in anchors],
        block_size=BLOCK,
        mask_token_id=MASK_ID,
        gather_topk=False,
    )


def export(drafter: DFlashDrafter, out: Path, format: str = "zlab", target_info: dict | None = None) -> Path:
    description = describe_parts(drafter.cfg, drafter.arch, LAYER_IDS, MASK_ID)
    return export_drafter(drafter, description, target_info or {"path": "unused"}, out, dtype="float32", format=format)


def head_module(weight_VH: torch.Tensor) -> nn.Linear:
    head = nn.Linear(weight_VH.shape[1], weight_VH.shape[0], bias=False)
    head.weight.data = weight_VH
    return head


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


# ---------------------------------------------------------------------------------------------
# z-lab dflash 0.1.0 (PyPI wheel: its torch model builds the sliding / causal mask itself)


def zlab_load(folder: Path):
    zlab = pytest.importorskip("dflash.model", reason="z-lab dflash not on DFLASH_PEERS")
    model, info = zlab.DFlashDraftModel.from_pretrained(
        str(folder), dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


def zlab_block(model, context_CF: torch.Tensor, noise_BH: torch.Tensor, anchor: int) -> torch.Tensor:
    """z-lab's forward for one block, as dflash_generate calls it without a cache: target_hidden =
    raw concatenated features of positions 0..anchor-1, position_ids = 0 .. anchor + B - 1."""
    with torch.no_grad():
        out = model(
            position_ids=torch.arange(anchor + noise_BH.shape[0])[None],
            noise_embedding=noise_BH[None],
            target_hidden=context_CF[None],
        )
    return out[0]


@pytest.mark.parametrize(
    "layer_types, window, is_causal, expected_layers",
    [
        (SLIDING_MIXED, 5, None, [(5, True), (5, True), (None, False)]),  # z-lab's default: sliding causal
        (FULL3, None, None, [(None, False)] * 3),
        (SLIDING_MIXED, 5, True, [(5, True), (5, True), (None, True)]),  # is_causal applies to every layer
        (SLIDING_MIXED, 5, False, [(5, False), (5, False), (None, False)]),
        (FULL3, None, True, [(None, True)] * 3),
        (SLIDING_MIXED, 3, None, [(3, True), (3, True), (None, False)]),  # W < block: own slots windowed
    ],
    ids=[
        "sliding-default",
        "full",
        "sliding-causal",
        "sliding-bidirectional",
        "full-causal",
        "window-below-block",
    ],
)
def test_zlab_from_pretrained_computes_our_blocks(tmp_path, layer_types, window, is_causal, expected_layers):
    drafter = our_drafter(layer_types, window, is_causal)
    folder = export(drafter, tmp_path / "zlab")
    model, info = zlab_load(folder)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys

    # The exported config.json is what drives z-lab's layers (not defaults that happen to agree).
    got_layers = [(layer.self_attn.sliding_window, layer.self_attn.is_causal) for layer in model.layers]
    assert got_layers == expected_layers
    assert [(k.window, k.causal) for k in drafter.kinds] == expected_layers
    assert (model.block_size, model.mask_token_id, list(model.target_layer_ids)) == (
        BLOCK,
        MASK_ID,
        LAYER_IDS,
    )
    ours = drafter.state_dict()
    theirs = model.state_dict()
    assert set(theirs) - {"rotary_emb.inv_freq", "rotary_emb.original_inv_freq"} == set(ours)
    assert all(torch.equal(theirs[k], v) for k, v in ours.items())

    # Two samples packed; contexts of 3 to 12 tokens, shorter and longer than the window.
    samples = make_samples([16, 13], drafter.arch.hidden_size)
    anchors = [[3, 7, 12], [5, 9]]
    batch = pack(samples, anchors)
    with torch.no_grad():
        hidden_NBH = drafter(batch)
        logits_NBV = drafter.logits(hidden_NBH)
    head = head_module(drafter.lm_head_VH)
    n, worst_hidden, worst_logits = 0, 0.0, 0.0
    for sample, sample_anchors in zip(samples, anchors):
        context_TF = sample["hidden_TLH"].reshape(sample["hidden_TLH"].shape[0], -1)
        for a in sample_anchors:
            noise_BH = F.embedding(batch.block_ids_NB[n], drafter.embed_VH)
            assert batch.block_ids_NB[n].tolist() == [int(sample["input_ids_T"][a])] + [MASK_ID] * (BLOCK - 1)
            theirs_BH = zlab_block(model, context_TF[:a], noise_BH, a)
            with torch.no_grad():
                their_logits = model.compute_logits(theirs_BH, head)
            worst_hidden = max(worst_hidden, max_diff(theirs_BH, hidden_NBH[n]))
            worst_logits = max(worst_logits, max_diff(their_logits, logits_NBV[n]))
            n += 1
    print(
        f"z-lab {layer_types} W={window} is_causal={is_causal}: max|diff| hidden {worst_hidden:.2e}, logits {worst_logits:.2e}"
    )
    assert worst_hidden <= ATOL
    assert worst_logits <= 10 * ATOL  # logits ~ +-10 here (random head): fp32 rounding scales with them


# ---------------------------------------------------------------------------------------------
# SpecForge 0.2.0 (= PR #731: per-layer-type training masks)


def specforge_blocks(folder: Path, drafter: DFlashDrafter, samples, anchors: list[list[int]]):
    """SpecForge's training forward over a batch of equal-length sequences. Its anchors are random
    among positions a with loss_mask[a] and loss_mask[a + 1]; a loss mask that is 1 exactly at the
    wanted anchors and the token after each (no other such pair), with num_anchors = their count,
    leaves it one choice, which is checked."""
    draft_mod = pytest.importorskip("specforge.modeling.draft.dflash", reason="SpecForge not on DFLASH_PEERS")
    online = pytest.importorskip("specforge.algorithms.common.dflash_family_model")
    model = draft_mod.DFlashDraftModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    model.config._attn_implementation = "sdpa"
    wrapper = online.OnlineDFlashModel(
        draft_model=model,
        target_lm_head=head_module(drafter.lm_head_VH),
        target_embed_tokens=nn.Embedding.from_pretrained(drafter.embed_VH),
        mask_token_id=MASK_ID,
        block_size=BLOCK,
        attention_backend="sdpa",
        num_anchors=len(anchors[0]),
    )
    input_ids = torch.stack([s["input_ids_T"] for s in samples])
    hidden = torch.stack([s["hidden_TLH"].reshape(s["hidden_TLH"].shape[0], -1) for s in samples])
    loss_mask = torch.zeros(input_ids.shape)
    for row, sample_anchors in enumerate(anchors):
        for a in sample_anchors:
            loss_mask[row, a] = loss_mask[row, a + 1] = 1.0
    with torch.no_grad():
        anchor_pos, keep, out = wrapper._forward_draft_blocks(input_ids, hidden, loss_mask)
    assert anchor_pos.tolist() == anchors and bool(keep.all())
    return model, out.reshape(len(samples), -1, BLOCK, out.shape[-1])


def test_specforge_training_forward_computes_our_blocks(tmp_path):
    drafter = our_drafter(SLIDING_MIXED, 5)
    samples = make_samples([20, 20], drafter.arch.hidden_size, seed=2)
    anchors = [[3, 9, 14], [0, 6, 15]]  # anchor 0: no context at all
    model, theirs_SNBH = specforge_blocks(export(drafter, tmp_path / "zlab"), drafter, samples, anchors)
    assert (tuple(model.layer_types), model.sliding_window) == (SLIDING_MIXED, 5)
    assert [layer.self_attn.sliding_window for layer in model.layers] == [5, 5, None]
    with torch.no_grad():
        ours_NBH = drafter(pack(samples, anchors))
    diff = max_diff(theirs_SNBH.reshape(ours_NBH.shape), ours_NBH)
    print(f"SpecForge sliding W=5 B=4, 6 blocks: max|hidden diff| {diff:.2e}")
    assert diff <= ATOL


# ---------------------------------------------------------------------------------------------
# speculators 0.9.0


def write_verifier(folder: Path, arch, seed: int = 3) -> Path:
    """What speculators reads from a verifier: a local config.json and the embedding, LM head and
    final norm in model.safetensors (a local folder: speculators reaches for the Hub otherwise)."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    gen = torch.Generator().manual_seed(seed)
    config = Qwen3Config(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(folder)
    V, H = arch.vocab_size, arch.hidden_size
    save_file(
        {
            "model.embed_tokens.weight": torch.randn(V, H, generator=gen),
            "lm_head.weight": torch.randn(V, H, generator=gen),
            "model.norm.weight": 1.0 + 0.1 * torch.randn(H, generator=gen),
        },
        str(folder / "model.safetensors"),
    )
    return folder


def speculators_load(folder: Path):
    """speculators' DFlashDraftModel from a folder, switched to its eager float-mask path (the
    default flex path compiles create_block_mask, which CPU tests cannot afford)."""
    pytest.importorskip("speculators", reason="speculators not on DFLASH_PEERS")
    from speculators.models.attention import create_float_mask
    from speculators.models.dflash import DFlashDraftModel

    model = DFlashDraftModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    model.config.transformer_layer_config._attn_implementation = "eager"
    model._attn_impl = "eager"
    model._create_mask_fn = create_float_mask
    return model


@pytest.fixture
def speculators_export(tmp_path):
    """Our full-attention drafter whose frozen parts are a local verifier's, exported in the
    speculators format pointing at that verifier."""
    arch = tiny_arch(kv_heads=2)
    verifier = write_verifier(tmp_path / "verifier", arch)
    embed_VH, head_VH = load_embed_and_head(verifier)
    base = our_drafter()
    description = describe_parts(base.cfg, arch, LAYER_IDS, MASK_ID)
    drafter = build_drafter(description, embed_VH, head_VH, runtime=base.cfg, weights=base.state_dict()).eval()
    info = {"verifier": str(verifier), "architectures": ["Qwen3ForCausalLM"]}  # a local verifier: speculators refills its parts
    folder = export(drafter, tmp_path / "spec", format="speculators", target_info=info)
    return drafter, folder, verifier


def test_speculators_loads_our_export_and_computes_our_blocks(speculators_export):
    from safetensors.torch import load_file

    drafter, folder, _ = speculators_export
    model = speculators_load(folder)

    # Keys: the checkpoint holds exactly what speculators expects from one, with our values; what it
    # refilled from the verifier is our frozen embedding and head.
    saved = load_file(str(folder / "model.safetensors"))
    theirs = model.state_dict()
    refilled = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    assert set(saved) == set(theirs) - refilled == set(drafter.state_dict())
    assert set(model._keys_to_ignore_on_load_missing) >= refilled  # what HF lets a checkpoint omit
    assert all(torch.equal(theirs[k], v) for k, v in saved.items())
    assert all(torch.equal(saved[k], v) for k, v in drafter.state_dict().items())
    assert torch.equal(theirs["embed_tokens.weight"], drafter.embed_VH)
    assert torch.equal(theirs["lm_head.weight"], drafter.lm_head_VH)
    # (SpeculatorModel.from_pretrained hands back HF's (model, info) as is when asked for the info.)
    _, loading = type(model).from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    assert not any(loading.values()), loading
    assert model.target_layer_ids == [i + 1 for i in LAYER_IDS]
    assert (model.block_size, model.mask_token_id) == (BLOCK, MASK_ID)

    # Forward: two documents packed in one row (document_ids, positions restarting per document).
    # select_anchors draws max_anchors among loss_mask=1 positions outside the row's last B: with
    # exactly max_anchors such positions it has one choice (checked through the returned indices).
    samples = make_samples([12, 14], drafter.arch.hidden_size, seed=4)
    anchors = [[2, 6], [3, 8]]
    row_anchors = [2, 6, 12 + 3, 12 + 8]
    lengths = [s["input_ids_T"].shape[0] for s in samples]
    T = sum(lengths)
    loss_mask = torch.zeros(1, T, dtype=torch.long)
    loss_mask[0, row_anchors] = 1
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        hidden, logits, _, _, block_idx = model._backbone_forward(
            torch.cat([s["hidden_TLH"].reshape(len(s["input_ids_T"]), -1) for s in samples])[None],
            torch.cat([s["input_ids_T"] for s in samples])[None],
            loss_mask,
            torch.randn(1, T, drafter.arch.hidden_size, generator=gen),  # verifier's last layer: targets only
            torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None],
            position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
            max_anchors=len(row_anchors),
        )
        ours_NBH = drafter(pack(samples, anchors))
        our_logits_NBV = drafter.logits(ours_NBH)
    assert block_idx.tolist() == [a + k for a in row_anchors for k in range(BLOCK)]
    hidden_diff = max_diff(hidden[0].reshape(ours_NBH.shape), ours_NBH)
    logit_diff = max_diff(logits[0].reshape(our_logits_NBV.shape), our_logits_NBV)
    print(
        f"speculators, 4 blocks over 2 documents: max|diff| hidden {hidden_diff:.2e}, logits {logit_diff:.2e}"
    )
    assert hidden_diff <= ATOL
    assert logit_diff <= 10 * ATOL


def test_our_reader_takes_speculators_folders(speculators_export, tmp_path):
    """Ours (format="speculators") and one speculators itself wrote (save_pretrained of what it
    loaded): the same spec, the same weights for init_from, the same drafter."""
    from shared.target import TargetInfo

    drafter, folder, verifier = speculators_export
    resaved = tmp_path / "spec_resaved"
    speculators_load(folder).save_pretrained(resaved)
    assert json.loads((resaved / "config.json").read_text())["aux_hidden_state_layer_ids"] == [
        i + 1 for i in LAYER_IDS
    ]
    target = TargetInfo("", verifier, drafter.arch, LAYER_IDS, MASK_ID, "", "", "")
    batch = pack(make_samples([12, 14], drafter.arch.hidden_size, seed=4), [[2, 6], [3, 8]])
    with torch.no_grad():
        ours_NBH = drafter(batch)
    for where in (folder, resaved):
        spec = folder_description(where)
        assert (spec.target_layer_ids, spec.mask_token_id) == (tuple(LAYER_IDS), MASK_ID)
        assert (spec.block_size, spec.num_layers, spec.layer_types) == (BLOCK, 3, FULL3)
        weights = init_weights_for(where, drafter.cfg, target)
        assert set(weights) == set(drafter.state_dict())
        assert all(torch.equal(weights[k], v) for k, v in drafter.state_dict().items()), where
        with torch.no_grad():
            again = load_exported(where, drafter.embed_VH, drafter.lm_head_VH)
            again.attention_backend = "sdpa"
            assert torch.equal(again(batch), ours_NBH), where


def test_dpace_weights_equal_speculators_on_random_batches():
    pytest.importorskip("speculators", reason="speculators not on DFLASH_PEERS")
    from speculators.losses.utils import dpace_loss_decay

    gen = torch.Generator().manual_seed(6)
    N, B = 32, 8
    ce_NB = torch.empty(N, B).exponential_(0.7, generator=gen)  # CE in nats, a long tail
    masks = {
        "random": torch.rand(N, B, generator=gen) < 0.7,
        "all": torch.ones(N, B, dtype=torch.bool),
        # blocks running past a sample's end: the first few slots only
        "tails": torch.arange(B)[None, :] < torch.randint(1, B + 1, (N, 1), generator=gen),
    }
    worst = 0.0
    for name, mask_NB in masks.items():
        mask_NB = mask_NB.clone()
        mask_NB[:, 0] = False  # slot 0 (the anchor) is never scored, in both
        mask_NB[0] = False  # one block with nothing scored
        for alpha in (0.05, 0.3, 0.5, 0.9, 1.0):
            ours = dpace_weights(ce_NB, mask_NB, alpha)
            # as speculators' loss_function calls it: one packed row, CE masked first
            theirs = dpace_loss_decay(
                None,
                loss_mask=mask_NB.reshape(1, -1).long(),
                block_size=B,
                dpace_alpha=alpha,
                elementwise_loss=(ce_NB * mask_NB).reshape(1, -1),
            ).reshape(N, B)
            diff = max_diff(ours, theirs)
            worst = max(worst, diff)
            assert diff <= 1e-6, (name, alpha, diff)
            assert not ours.requires_grad and bool((ours[~mask_NB] == 0).all())
    print(f"D-PACE weights, 3 masks x 5 alphas: max|diff| {worst:.2e}")


def test_muon_split_equals_speculators():
    pytest.importorskip("speculators", reason="speculators not on DFLASH_PEERS")
    from speculators.train.optimizers import split_named_params_for_muon

    drafter = our_drafter(SLIDING_MIXED, 5)
    # Our drafter, plus the cases the rule exists for: an embedding and an LM head by name, a
    # degenerate [1, n] matrix, a 3-D tensor, a frozen matrix.
    holder = nn.Module()
    holder.drafter = drafter
    holder.embed_tokens = nn.Embedding(10, 8)
    holder.lm_head = nn.Linear(8, 10, bias=False)
    holder.gate = nn.Parameter(torch.zeros(1, 8))
    holder.kernel = nn.Parameter(torch.zeros(2, 3, 8))
    holder.frozen = nn.Parameter(torch.zeros(8, 8), requires_grad=False)
    for model in (drafter, holder):
        ours, theirs = muon_params(model), split_named_params_for_muon(model)
        for group_ours, group_theirs in zip(ours, theirs):
            assert [n for n, _ in group_ours] == [n for n, _ in group_theirs]
            assert all(a is b for (_, a), (_, b) in zip(group_ours, group_theirs))
    muon, adamw, _ = muon_params(drafter)
    assert "fc.weight" in dict(muon) and "norm.weight" in dict(adamw) and len(muon) == 3 * 7 + 1


def test_accept_len_equals_speculators_eal_except_where_a_response_ends():
    """speculators' `eal` adds the bonus token to every block; accept_len does not where the run of
    correct drafts reaches the end of the response (decoding gets no token past it). Everywhere
    else the per-block lengths are equal; the pooled numbers say how far apart they are."""
    pytest.importorskip("speculators", reason="speculators not on DFLASH_PEERS")
    from speculators.models.metrics import compute_accepted_length_counts

    from stage2_train.model.loss import accept_lengths

    gen = torch.Generator().manual_seed(7)
    N, B = 4096, 16
    correct_NB = torch.rand(N, B, generator=gen) < 0.85  # a strong drafter: long runs reach the ends
    valid_NB = torch.arange(B)[None, :] <= torch.where(
        torch.rand(N, 1, generator=gen) < 0.2, torch.randint(1, B, (N, 1), generator=gen), torch.full((N, 1), B - 1)
    )  # 20% of the blocks run past the response's end
    valid_NB[:, 0] = False
    ours_N = accept_lengths(correct_NB, valid_NB)
    per_block = []
    for n in range(N):
        s, t = compute_accepted_length_counts(correct_NB[n : n + 1, 1:], valid_NB[n : n + 1, 1:])
        per_block.append(float(s / t))
    theirs_N = torch.tensor(per_block)
    run_N = (correct_NB[:, 1:] & valid_NB[:, 1:]).long().cumprod(1).sum(1)
    ends_N = valid_NB[:, 1:].sum(1)
    ran_out_N = (run_N == ends_N) & (ends_N < B - 1)
    assert torch.equal(ours_N[~ran_out_N].float(), theirs_N[~ran_out_N])
    assert torch.equal(ours_N[ran_out_N].float(), theirs_N[ran_out_N] - 1)
    total_s, total_t = compute_accepted_length_counts(correct_NB[:, 1:], valid_NB[:, 1:])
    print(f"accept_len {ours_N.float().mean():.3f} vs eal {float(total_s / total_t):.3f}; "
          f"{int(ran_out_N.sum())} of {N} blocks ran out at a response end")
