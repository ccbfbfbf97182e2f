"""Acceptance benchmark: tau of the trained drafter vs an untrained one vs the n-gram baseline, and
offline eal/tau vs online tau, on the same held-out prompts.

    .venv/bin/python bench/eval.py [--json out.json] [--config configs/default.yaml] [--steps 200]

With a trained default run (`runs/default/checkpoints` and its store) it runs `cmd_eval` on it.
Otherwise it builds a tiny stand-in on the spot (2 shared CPU cores: ~4-5 minutes): a random 6-layer,
64-wide Llama target with SmolLM2's tokenizer (init std 0.1, so its greedy text is varied, not one
repeated token), its greedy answers to generated questions as the "store" (features captured from
the same layers stage 1 stores), a 1-layer B=4 drafter trained `--steps` Adam steps on the train
split, then the same offline and online evaluation on the held-out split.
Speedups on CPU are reported, not goals: the tiny target is as cheap as the drafter.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.config import load_run_config  # noqa: E402
from shared.store import StoreConfig  # noqa: E402
from shared.target import TargetArch, TargetConfig, default_target_dir, resolve_layer_ids  # noqa: E402
from shared.target_parts import load_embed_and_head  # noqa: E402
from stage2_train.data.anchors import AnchorSampler  # noqa: E402
from stage2_train.data.loader import collate  # noqa: E402
from stage2_train.data.sampler import SamplerConfig  # noqa: E402
from stage2_train.model.drafter import DrafterConfig  # noqa: E402
from stage2_train.model.loss import LossConfig, dflash_loss  # noqa: E402
from stage2_train.serve.export import build_drafter  # noqa: E402
from stage2_train.serve.speculative import DFlashProposer, NgramProposer, capture_features, target_greedy  # noqa: E402
from stage2_train.train.evaluate import acceptance_gap, cmd_eval, offline_eval, online_eval  # noqa: E402

WORDS = (
    "list dict python tuple loop function class module file error string number sort key value print".split()
)


class MemoryReader:
    """The part of StoreReader the evaluation reads, over samples held in memory."""

    def __init__(self, samples: list[dict]):
        self.samples = samples
        self.lengths = [len(s["input_ids_T"]) for s in samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        return self.samples[index]


def default_run(args: argparse.Namespace) -> dict | None:
    sections = {"target": TargetConfig, "store": StoreConfig, "model": DrafterConfig}
    cfg = load_run_config(args.config, [], sections)
    run_dir = Path(cfg.run_dir)
    store = cfg.store.path or run_dir / "store"
    if not (run_dir / "checkpoints").is_dir() or not (Path(store) / "manifest.json").is_file():
        return None
    # Only target/store/model are built here, so `eval` is the preset's raw dict (or absent).
    cfg.sections["eval"] = {
        **(cfg.sections.get("eval") or {}),
        "online_num_prompts": args.prompts,
        "online_max_new_tokens": args.max_new_tokens,
    }
    return {"mode": "default-run", **cmd_eval(cfg, argparse.Namespace(checkpoint=args.checkpoint))}


def tiny_run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer, LlamaForCausalLM

    from shared.tiny_target import build_tiny_target

    rng = random.Random(0)
    tokenizer = AutoTokenizer.from_pretrained(default_target_dir())
    folder = build_tiny_target(Path(tempfile.mkdtemp(prefix="dflash-bench-")), init_std=0.1)
    target = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    torch.manual_seed(0)
    arch = TargetArch.from_dir(folder)
    layer_ids = resolve_layer_ids(TargetConfig(path=str(folder), num_feature_layers=3), arch)
    mask_token_id = tokenizer.get_vocab()["<empty_output>"]

    t0 = time.perf_counter()
    samples = []
    for sample_id in range(args.samples):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer = target_greedy(
            target, prompt_ids, max_new_tokens=args.max_new_tokens, eos_token_ids=None
        ).tokens
        ids = prompt_ids + answer
        samples.append(
            {
                "sample_id": sample_id,
                "input_ids_T": torch.tensor(ids),
                "loss_mask_T": torch.tensor([False] * len(prompt_ids) + [True] * len(answer)),
                "hidden_TLH": capture_features(target, ids, layer_ids),
            }
        )
    data_s = time.perf_counter() - t0
    reader = MemoryReader(samples)
    heldout = list(range(args.samples - args.prompts, args.samples))
    train = list(range(args.samples - args.prompts))

    cfg_model = DrafterConfig(num_layers=1, block_size=4)
    embed_VH, lm_head_VH = load_embed_and_head(folder)
    common = (cfg_model, arch, len(layer_ids), mask_token_id, embed_VH, lm_head_VH)
    drafter = build_drafter(*common, seed=1).train()
    untrained = build_drafter(*common, seed=1)
    loss_cfg = LossConfig(gamma=4.0)
    anchors = AnchorSampler(SamplerConfig(max_anchors_per_seq=16), block_size=cfg_model.block_size, seed=0)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.0)
    t0 = time.perf_counter()
    losses = []
    for step in range(args.steps):
        picked = rng.sample(train, k=min(8, len(train)))
        batch = collate(
            [reader[i] for i in picked],
            [anchors.anchors(reader[i]["loss_mask_T"], sample_id=i, epoch=step) for i in picked],
            block_size=cfg_model.block_size,
            mask_token_id=mask_token_id,
            gather_topk=False,
        )
        loss, _ = dflash_loss(drafter(batch), drafter.lm_head_VH, batch, loss_cfg)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
    train_s = time.perf_counter() - t0
    drafter.eval()

    offline = offline_eval(drafter, reader, heldout, max_anchors_per_seq=None)
    online = online_eval(
        target,
        {
            "trained": DFlashProposer(drafter, layer_ids, feature_dtype=torch.bfloat16, name="trained"),
            "untrained": DFlashProposer(untrained, layer_ids, feature_dtype=torch.bfloat16, name="untrained"),
            "ngram": NgramProposer(cfg_model.block_size - 1),
        },
        [s["input_ids_T"][~s["loss_mask_T"]].tolist() for s in (reader[i] for i in heldout)],
        max_new_tokens=args.max_new_tokens,
        eos_token_ids=None,
    )
    return {
        "mode": "tiny",
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "data_s": round(data_s, 2),
        "train_s": round(train_s, 2),
        "loss_first_last": [round(sum(losses[:10]) / 10, 4), round(sum(losses[-10:]) / 10, 4)],
        "offline": offline,
        "offline_untrained": offline_eval(untrained, reader, heldout, max_anchors_per_seq=None),
        "online": online,
        "gap": acceptance_gap(offline, online["proposers"]["trained"]["tau"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--checkpoint", default=None, help="default: the run's latest")
    parser.add_argument("--tiny", action="store_true", help="the tiny stand-in even if a default run exists")
    parser.add_argument("--prompts", type=int, default=6, help="held-out prompts decoded online")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--samples", type=int, default=64, help="tiny mode: sequences (prompts among them)")
    parser.add_argument("--steps", type=int, default=200, help="tiny mode: drafter training steps")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = None if args.tiny else default_run(args)
    if result is None:
        result = tiny_run(args)
    online = result["online"]["proposers"]
    for name, p in online.items():
        print(f"{name:>10}: tau {p['tau']:.3f}  exact {p['exact']}  speedup {p['speedup']:.2f}x")
    gap = result["gap"]
    walk = gap["offline_walk_tau"]
    print(
        f"offline: walk tau {'n/a' if walk is None else f'{walk:.3f}'}, block-mean tau {gap['offline_block_tau']:.3f}, "
        f"eal+1 {gap['offline_eal_plus_bonus']:.3f}; online tau {gap['online_tau']:.3f}; "
        f"relative gap {gap['relative']:+.3f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
