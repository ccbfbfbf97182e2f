"""The projected feature store, measured before it is built: how much of the target features' second
moment a fitted basis keeps, what the store would weigh, and whether export is exact.

    .venv/bin/python bench/projection.py [--store runs/default/store] [--json out.json] [--png out.png]

Energy kept, reconstruction error, bytes per token and the fold's exactness: docs/benchmarks.md, `projection`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, Row, arguments, emit, figure, fmt, relative_error, yes  # noqa: E402


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--store", default="runs/default/store")
    parser.add_argument("--png", default=str(REPO / "bench" / "results" / "projection-energy.png"))
    args = parser.parse_args()
    import torch

    from shared.codecs import decode_hidden, encode_hidden
    from shared.reader import StoreReader
    from shared.store import bytes_per_token
    from stage2_train.data.projection import basis, energy_kept, second_moment

    torch.set_num_threads(1)
    reader = StoreReader(str(REPO / args.store) if not Path(args.store).is_absolute() else args.store)
    L, H = reader.feature_shape
    shard_of = [reader.locate(i)[0] for i in range(len(reader))]
    fit = [i for i in range(len(reader)) if shard_of[i] % 2 == 0]
    held = [i for i in range(len(reader)) if shard_of[i] % 2 == 1]
    fit_moment, fit_tokens = second_moment(reader, fit)
    held_moment, held_tokens = second_moment(reader, held)
    x_TF = torch.cat([reader[i]["hidden_TLH"].flatten(1).float() for i in held])
    ranks = {"H": H, "H/2": H // 2, "H/4": H // 4}
    energy, error = {}, {}
    for scale in ("none", "rms"):
        for name, r in ranks.items():
            energy[f"{scale} r={name}"] = round(energy_kept(fit_moment, fit_tokens, r, scale, measured_on=held_moment), 4)
            P_RF, s_F = basis(fit_moment, fit_tokens, r, scale)
            back_FR = (s_F[:, None] * (P_RF.double() * s_F[None, :]).T).float()
            x_hat = (x_TF @ P_RF.T) @ back_FR.T
            error[f"{scale} r={name}"] = round(float(relative_error(x_hat, x_TF, eps=0).median()), 4)
    bits, scale_TL = encode_hidden(x_TF.view(-1, L, H), "fp8")
    fp8 = decode_hidden(bits, scale_TL, "fp8").float().flatten(1)
    fp8_error = round(float(relative_error(fp8, x_TF, eps=0).median()), 4)
    bf16 = bytes_per_token("bf16", 5, 4096, 64)
    fp8_only = bytes_per_token("fp8", 5, 4096, 64)
    projected = bytes_per_token("fp8", 1, 4096, 64)  # r = H values per token, one fp8 scale
    # exactness of the fold
    from testkit.drafter import three_sample_batch, tiny_arch, tiny_drafter

    arch = tiny_arch(kv_heads=2)
    a = tiny_drafter(arch, num_layers=2, feature_projection="pca", projection_dim=32)
    batch = three_sample_batch(arch)
    P_RF, _ = basis(batch.context_TF.double().T @ batch.context_TF.double(), batch.context_TF.shape[0], 32, "rms")
    a.set_projection(P_RF)
    b = tiny_drafter(arch, num_layers=2)
    b.load_state_dict(a.folded_state_dict())
    b.set_frozen_parts(a.embed_VH, a.lm_head_VH)
    with torch.no_grad():
        la, lb = a.logits(a(batch)).float(), b.logits(b(batch)).float()
    result = {
        "store": args.store, "feature_shape": [L, H], "fit_tokens": fit_tokens, "heldout_tokens": held_tokens,
        "energy_kept_heldout": energy, "relative_error_median": error, "fp8_relative_error_median": fp8_error,
        "bytes_per_token_qwen3_8b": {"bf16": bf16, "fp8": fp8_only, "fp8+projection r=H": projected,
                                     "fp8_over_bf16": round(fp8_only / bf16, 3), "projected_over_bf16": round(projected / bf16, 3)},
        "fold_exactness": {"max_abs_logit_diff": float((la - lb).abs().max()), "argmax_agreement": float((la.argmax(-1) == lb.argmax(-1)).float().mean())},
    }
    plot(energy, ranks, H, Path(args.png))
    result["png"] = str(Path(args.png).relative_to(REPO)) if Path(args.png).is_relative_to(REPO) else args.png
    return emit(result, args.json)


def plot(energy: dict, ranks: dict, H: int, path: Path) -> None:
    with figure(path, (6, 3.6)) as ax:
        for scale, style in (("none", "o-"), ("rms", "s--")):
            ax.plot(list(ranks.values()), [energy[f"{scale} r={n}"] for n in ranks], style, label=f"scale: {scale}")
        ax.set_xlabel(f"basis rank r (hidden size H = {H})")
        ax.set_ylabel("second moment kept (held-out half)")
        ax.set_title("Target features inside a fitted basis (SmolLM2, layers 1/14/27)", fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)


def rows(r: dict) -> list[Row]:
    b, f = r["bytes_per_token_qwen3_8b"], r["fold_exactness"]
    return [
        *((f"projection {key}: second moment kept on held-out shards / median relative error",
           f"{kept} / {r['relative_error_median'][key]}", "", f"fp8 storage error {r['fp8_relative_error_median']}", "")
          for key, kept in r["energy_kept_heldout"].items()),
        ("bytes/token at Qwen3-8B (5 x 4096, top-64): bf16 / fp8 / fp8 + projection r=H",
         f"{fmt(b['bf16'])} / {fmt(b['fp8'])} / {fmt(b['fp8+projection r=H'])}", "",
         f"fp8 {b['fp8_over_bf16']}x, projected {b['projected_over_bf16']}x of bf16", ""),
        ("export folds the projection into fc: max |logit diff| / argmax agreement", f"{f['max_abs_logit_diff']:.2g} / {f['argmax_agreement']}",
         "argmax 1.0", "", yes(f["argmax_agreement"] == 1.0)),
    ]


if __name__ == "__main__":
    sys.exit(main())
