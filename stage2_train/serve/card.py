"""What a published drafter folder says to the people who find it: its model card, readable files,
no machine paths, and the push to the Hub when asked.

    write_card(out_dir, description, facts)     # README.md: target, revision, layers, block, data, tau, serving
    publishable(out_dir)                        # files readable as any file the user creates (0644 under umask 022)
    push_to_hub(out_dir, "org/name")            # huggingface_hub's upload_folder: the only network call

The card's figures come from what the run recorded: the evaluation of that checkpoint (`stage2_train
eval`, run_dir/eval/<step>.json) with its interval and the data it used (held-out only when it was the
drafter's own split of the store it was trained on), or says none was run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from shared.files import write_atomic
from stage2_train.model.description import DrafterDescription
from stage2_train.serve.online_eval import interval_text

CARD_NAME = "README.md"
STALE_WEIGHTS = ["*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt"]
LOCAL_ONLY = "dflash_pipeline_config.yaml"  # the resolved run config, written beside the export, never pushed


def write_card(out_dir: Path, description: DrafterDescription, facts: dict[str, Any]) -> Path:
    """README.md of an exported drafter. `facts`: target (name, revision), data (what the store was
    made from, samples, tokens; or `other_store`, why the store at hand is not the one trained on),
    steps, the held-out eval when one was run, and the chat template's variables the data was rendered with
    (`chat_template_kwargs`, the drafter's own record: whatever store is configured)."""
    d = description
    target = facts.get("target") or {}
    target_name = target.get("hub_id") or target.get("name") or "the target"
    revision = f" at revision `{target['commit']}`" if target.get("commit") else ""
    eval_line = "No held-out evaluation was recorded for this checkpoint (`python -m stage2_train eval` makes one)."
    online = facts.get("eval")
    if online:
        # The eval says how many outputs equalled the target's greedy ones (bf16 ties can break it).
        exact = online.get("num_exact")
        equal = ("every output equal to the target's own" if exact == online["prompts"] else
                 f"{exact} of {online['prompts']} outputs equal to the target's own" if exact is not None else "greedy")
        title, used = eval_data(online.get("split") or {})
        stop = online.get("confidence_stop")
        # An early stop drafts fewer tokens than the engines' DSpark method below: its tau is another decoder's.
        stopped = (f", each block ended early by the confidence head (eval.confidence_stop={stop}: before the slot where the "
                   f"predicted chance that every draft so far is accepted falls below it)" if stop is not None else "")
        eval_line = (
            f"{title}, on {used}. {online['prompts']} prompt{'' if online['prompts'] == 1 else 's'} x {online['max_new_tokens']} new tokens, greedy{stopped}, {equal}: "
            f"tau **{interval_text(online)}**"
            + (" (95% bootstrap interval over prompts)" if online.get("lo") is not None else "")
            + f"; untrained drafter {online.get('untrained', float('nan')):.3f}, "
            f"n-gram drafter {online.get('ngram', float('nan')):.3f}. Harness: dflash-pipeline's `python -m stage2_train eval`, "
            f"so compare with figures of the same harness only."
        )
    data = facts.get("data") or {}
    if data.get("other_store"):  # the config's store is not the one trained on: nothing about it is stated
        data_line = f"not stated: the configured store is not the one trained on ({data['other_store']})"
    else:
        data_line = f"{data.get('source', 'unknown')}: {data.get('num_samples', '?')} samples, {data.get('num_tokens', '?')} tokens"
        if data and not data.get("verified"):
            data_line += " (the checkpoint recorded no store digest to check this store against)"
    sliding = "sliding_attention" in d.layer_types
    lines = [
        "---",
        "library_name: transformers",
        "tags: [speculative-decoding, dflash, drafter]",
        *([f"base_model: {target['hub_id']}"] if target.get("hub_id") else []),
        "---",
        "",
        f"# {d.variant.upper() if d.variant != 'dflash' else 'DFlash'} drafter for {target_name}",
        "",
        f"A block-diffusion drafter ({d.variant}) that drafts {d.max_draft} tokens per step for `{target_name}`{revision}, "
        f"conditioned on the outputs of its decoder layers {list(d.target_layer_ids)} (HF `hidden_states[i + 1]`). "
        "Trained with dflash-pipeline from stored target features.",
        "",
        "| | |",
        "|---|---|",
        f"| target | `{target_name}`{revision} ({d.num_target_layers} layers, hidden {d.hidden_size}, vocab {d.vocab_size}) |",
        f"| drafter | {d.num_layers} layer(s), block size {d.block_size}, mask token id {d.mask_token_id}"
        + (f", sliding window {d.sliding_window}" if sliding else "") + " |",
        f"| data | {data_line} |",
        f"| training | {facts.get('steps', '?')} optimizer steps"
        + (f", started from `{facts['init_from']}` (its own steps not counted)" if facts.get("init_from") else "") + " |",
        "",
        "## Acceptance",
        "",
        eval_line,
        "",
        "## Serving",
        "",
        *serving_lines(d, target_name),
        "Serve it with the same chat template (and thinking mode) the training data was rendered with: a different "
        "template is the most common cause of low acceptance in serving."
        + (f" The data was rendered with `chat_template_kwargs={json.dumps(template_kwargs)}` (`data.chat_template_kwargs`): "
           "pass the same in each request (vLLM / SGLang)." if (template_kwargs := facts.get("chat_template_kwargs")) else ""),
        "",
    ]
    return write_atomic(out_dir / CARD_NAME, "\n".join(lines))


def eval_data(split: dict[str, Any]) -> tuple[str, str]:
    """(title, the data it used) of an eval from its recorded `split`: held-out only when it was the
    drafter's own split of the store it was trained on (`trained_on_store`, `serve/trained_on.py`)."""
    source = split.get("data_source") or "a store"
    cut = (f"eval.holdout_fraction {split['holdout_fraction']}, eval.split_seed {split['split_seed']}"
           if "holdout_fraction" in split else "")
    if split.get("trained_on_store") is True:
        return "Held-out speculative decoding", f"the drafter's own held-out split ({cut}) of the store it was trained on, {source}"
    if split.get("trained_on_store") is False:
        return ("Speculative decoding on another store than the one trained on",
                f"prompts of {source} (store digest {split.get('store_digest')}, evaluated with eval.allow_other_store), "
                f"so these are not held-out figures of this training")
    if not split:
        return "Speculative decoding", "data the eval did not record (an eval from an older dflash-pipeline)"
    return ("Speculative decoding", f"the split ({cut}) of {source}, a store not checked against the one trained on "
            f"(the checkpoint recorded no store digest), so whether these prompts were held out is not known")


def serving_lines(d: DrafterDescription, target_name: str) -> list[str]:
    """How the engines serve this variant: DFlash in vLLM and SGLang; DSpark in vLLM only, as method
    dspark with B speculative tokens (vLLM refuses fewer) and its vanilla Markov head only; DFlash2
    nowhere yet (vLLM's loader drops its convolution; vllm #53428, #53612)."""
    if d.variant == "dflash2":
        return ["No engine serves DFlash2 drafters as released (vLLM's loader drops the attention convolution: vllm "
                "#53428, #53612); evaluate it with `python -m stage2_train eval`.", ""]
    method = "dspark" if d.variant == "dspark" else "dflash"
    vllm = [
        "vLLM:", "```bash",
        f"vllm serve {target_name} --speculative-config '{{\"method\": \"{method}\", \"model\": \"<this folder or repo>\", "
        f"\"num_speculative_tokens\": {d.max_draft}}}'", "```",
    ]
    if d.variant == "dspark":
        head = "" if d.markov_head == "vanilla" else f" This drafter's {d.markov_head} head is not one of them: vLLM would serve it wrongly."
        return [*vllm, f"vLLM serves DSpark's vanilla Markov head only.{head} (SGLang's DSpark support is not stated here.)", ""]
    return [*vllm, "SGLang:", "```bash",
            f"python -m sglang.launch_server --model-path {target_name} --speculative-algorithm DFLASH "
            "--speculative-draft-model-path <this folder or repo> --dtype bfloat16", "```"]


def publishable(out_dir: Path) -> None:
    """Every file of the folder readable as any file the user creates (safetensors writes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in out_dir.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def push_to_hub(out_dir: Path, repo_id: str) -> str:
    """Upload the folder to a Hub model repo (created if missing): the one network call of export."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, repo_type="model", exist_ok=True)
    # The resolved run config stays local: it names this machine's paths (data, store, run folder).
    # Weights a repo holds from an earlier push (another drafter's shards and their index) go in the
    # same commit: vLLM and SGLang load the shards an index lists, and would serve the old drafter.
    info = api.upload_folder(
        folder_path=str(out_dir), repo_id=repo_id, repo_type="model", commit_message="dflash-pipeline export",
        ignore_patterns=[LOCAL_ONLY], delete_patterns=STALE_WEIGHTS,
    )
    return str(getattr(info, "commit_url", info))
