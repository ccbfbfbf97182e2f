"""Stage 2 commands: check, batches (the dry run), train, eval, export, doctor, report.

Each takes the composed RunConfig and returns a JSON-able value; `__main__` only parses and prints.
This is the one module that composes the rooms (data, model, train, observe, serve); the heavier
ones are imported inside the command that needs them, so the log `doctor` never loads torch models and
`train` never loads the speculative decoder. Stage 2 never imports stage 1: the stages talk only
through the store.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from shared.config import RunConfig
from shared.errors import ConfigError, StoreError
from shared.files import write_atomic
from shared.paths import RunPaths
from stage2_train.model.config import DrafterConfig

# ---------------------------------------------------------------------------------------------
# batches and train


def cmd_batches(cfg: RunConfig, num_steps: int, world_size: int = 1) -> list[dict[str, Any]]:
    """The next `num_steps` optimizer steps the training run would take (all ranks), nothing trained."""
    from stage2_train.data.run_data import open_run_data
    from stage2_train.data.steps import describe_steps

    return describe_steps(open_run_data(cfg, world_size=world_size).sampler, num_steps)


def cmd_train(cfg: RunConfig, *, progress: bool = True) -> dict[str, Any]:
    from shared.network import check_gloo_network
    from shared.paths import RunPaths
    from shared.store import read_manifest
    from stage2_train.serve.load import run_init_weights
    from stage2_train.train.launch import make_accelerator
    from stage2_train.train.trainer import Trainer

    check_gloo_network()  # the checkpoint agreement group is gloo: a hostname on loopback hangs its first save
    manifest = read_manifest(RunPaths.of(cfg).store)  # no store yet: refused naming extract, before anything is created
    init_weights = run_init_weights(cfg, manifest) if cfg.model.init_from else None
    accelerator = make_accelerator(cfg.train)
    trainer = None
    try:
        with ExitStack() as stack:
            lock = run_dir_lock(stack, accelerator, str(cfg.run_dir))
            trainer = Trainer(cfg, accelerator, init_weights=init_weights, progress=progress, initialised=bool(cfg.model.init_from))
            summary = trainer.fit()
        rank, world = accelerator.process_index, accelerator.num_processes
        where = {"rank": rank, "world_size": world, "run_dir": str(cfg.run_dir)}
        return {**summary, **where, "lock": lock, "store_claim": trainer.data.reader.claim}
    finally:
        if trainer is not None:
            trainer.close()
        accelerator.end_training()  # destroys the process group: a clean exit under torchrun


def run_dir_lock(stack: ExitStack, accelerator: Any, run_dir: str) -> str | None:
    """Rank 0 holds run_dir's lock while training; every rank learns at once if another command has it
    (two trainings would interleave one log, one config and one checkpoint folder). Returns the
    lock's kind on rank 0 ("flock", or "lease" where the file system has no flock)."""
    import torch

    from shared.lock import exclusive_on_rank0

    def all_ok(ok: bool) -> bool:
        if accelerator.num_processes == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], device=accelerator.device)
        return int(accelerator.reduce(flag, reduction="sum").item()) == accelerator.num_processes

    return stack.enter_context(exclusive_on_rank0(run_dir, "stage2_train train", accelerator.process_index, all_ok))


def cmd_plan(cfg: RunConfig, search: bool = False, world_size: int = 8) -> dict[str, Any]:
    """The GPU memory of this config's worst training step (the densest micro-batch its sampler
    budgets allow), traced with fake tensors (`train/memory_plan.py`), at the target's shape."""
    from stage2_train.train.memory_plan import plan

    inputs, source = plan_inputs(cfg)
    out = plan(inputs, world_size=world_size, search=search)
    return {"config": cfg.source, "shape_from": source, **out}


def plan_inputs(cfg: RunConfig) -> tuple[Any, str]:
    """What the memory plan reads of a run config (PlanInputs) and where the target's shape came from:
    its folder's config.json, or the published shape of a known target named by target.path
    (planning needs no weights)."""
    import os
    from pathlib import PurePath

    from shared.errors import ConfigError
    from shared.hub import DOWNLOAD, hub_cache, is_hub_id, resolve_hub
    from shared.identity import stage1_value
    from shared.target import EMBEDDED_DEFAULT, TargetArch, resolve_target_dir
    from stage2_train.train.launch import resolve_mixed_precision
    from stage2_train.train.memory_plan import KNOWN_TARGETS, PlanInputs

    folder = Path(cfg.target.path).expanduser()
    if is_hub_id(cfg.target.path):  # its snapshot's config.json when the cache holds it (only that file is read)
        try:
            folder = resolve_hub(cfg.target.path, "target.path").folder
        except FileNotFoundError:
            pass
    if cfg.target.path == EMBEDDED_DEFAULT or (folder / "config.json").is_file():
        arch, source = TargetArch.from_dir(resolve_target_dir(cfg.target)), "config.json"
    else:
        folder_name = PurePath(cfg.target.path).name.lower()
        # A folder named after its model: Llama-3.1-8B-Instruct, Meta-Llama-3.1-8B-Instruct, Qwen3-8B
        name = next((known for known in KNOWN_TARGETS if known in folder_name), None)
        if name is None and is_hub_id(cfg.target.path):
            raise ConfigError(
                f"target.path={cfg.target.path}: not in the Hugging Face cache at {hub_cache()} and not a known shape "
                f"({', '.join(KNOWN_TARGETS)}); fetch it with `{DOWNLOAD} --config ...` to plan for it"
            )
        if name is None:
            raise ConfigError(
                f"target.path={cfg.target.path!r}: no config.json there and not a known shape ({', '.join(KNOWN_TARGETS)}); "
                f"copy the target's config.json into that folder to plan for it"
            )
        arch, source = KNOWN_TARGETS[name], f"the published {name} shape"
    if cfg.model.attention not in ("auto", "flex"):
        raise ConfigError(
            f"model.attention={cfg.model.attention!r}: the memory plan traces compiled flex (what `auto` runs on CUDA); "
            f"{cfg.model.attention} keeps each chunk group's mask and scores (bench/attention.py), which it does not trace. "
            f"Plan and train with model.attention=auto"
        )
    from stage2_train.model.attention import flex_importable

    if not flex_importable():  # `auto` would then run sdpa on the GPU, with the memory the message above names
        import torch

        raise ConfigError(
            f"this torch ({torch.__version__}) has no flex_attention: model.attention=auto would run sdpa on the GPU, which "
            f"keeps each chunk group's mask and scores and which the memory plan does not trace; install torch >= 2.5"
        )
    layers = len(cfg.target.layer_ids) if cfg.target.layer_ids else cfg.target.num_feature_layers
    # The compute dtype the trainer takes on a GPU (train.mixed_precision, or accelerate launch's choice under auto).
    bf16 = resolve_mixed_precision(cfg.train, True, os.environ.get("ACCELERATE_MIXED_PRECISION")) == "bf16"
    # The final eval packs held-out samples up to eval.offline_batch_tokens, a longer one alone.
    eval_tokens = max(cfg.eval.offline_batch_tokens, stage1_value(cfg, "data.max_length")) if cfg.eval.holdout_fraction > 0 else None
    inputs = PlanInputs(cfg.model, cfg.loss, cfg.sampler, cfg.noise, cfg.optim, cfg.train.grad_accum, arch, layers, bf16, eval_tokens)
    return inputs, source


# ---------------------------------------------------------------------------------------------
# eval and export


def _saved_drafter_path(cfg: RunConfig, checkpoint_arg: str | None) -> Path:
    """The folder eval and export read: `checkpoint_arg` (`best`, a checkpoint, a drafter folder) or the
    run's newest checkpoint that verifies."""
    from shared.errors import CheckpointError
    from stage2_train.serve.load import saved_drafter_path
    from stage2_train.train.checkpoint.select import resolve_checkpoint

    checkpoints = RunPaths.of(cfg).checkpoints
    if checkpoint_arg is None and not Path(checkpoints).exists():  # read as a weights file, it would say "no drafter weights"
        raise CheckpointError(f"no checkpoint in {checkpoints} (no such folder: this run has not trained yet); train first "
                              f"(`python -m stage2_train train`), or name one with --checkpoint")
    return saved_drafter_path(resolve_checkpoint(checkpoint_arg, checkpoints))


def _saved_drafter(cfg: RunConfig, heldout_or_target: Any, path: Path, device: Any = "cpu") -> Any:
    """The drafter saved at `path` (`_saved_drafter_path`), as its saved description says. A `model.*`
    value given on the command line that contradicts it is refused naming both; the config file's
    model section only says how to run it (a note names what it would have changed)."""
    import sys

    from stage2_train.serve.evaluation import HeldoutSet
    from stage2_train.serve.load import load_drafter

    if isinstance(heldout_or_target, HeldoutSet):
        loaded = heldout_or_target.load(path, cfg.model, device)
    else:
        loaded = load_drafter(path, heldout_or_target, runtime=cfg.model)
    given = {k for k in cfg.overridden if k.startswith("model.")}
    contradictions = loaded.description.contradictions(cfg.model, given)
    described = loaded.description
    for key, ours, theirs in (("target.layer_ids", list(described.target_layer_ids), cfg.target.layer_ids),
                              ("target.mask_token_id", described.mask_token_id, cfg.target.mask_token_id),
                              ("target.num_feature_layers", len(described.target_layer_ids), cfg.target.num_feature_layers)):
        theirs = list(theirs) if isinstance(theirs, tuple) else theirs  # a YAML list is read as a tuple
        if key in cfg.overridden and theirs is not None and theirs != ours:
            contradictions.append(f"{key}: the drafter has {ours}, the command line gives {theirs}")
    if contradictions:
        raise ConfigError(
            f"{loaded.weights_file.parent} holds another drafter than the command line describes: "
            + "; ".join(contradictions)
            + ". The drafter is rebuilt from its own description: drop those overrides (or train another drafter)"
        )
    ignored = loaded.description.contradictions(cfg.model, {f"model.{k}" for k in DrafterConfig.model_fields})
    for line in ignored:
        print(f"note: {line.replace('the command line gives', 'the config gives (ignored)')}", file=sys.stderr)
    return loaded


def cmd_eval(cfg: RunConfig, checkpoint: str | None = None) -> dict[str, Any]:
    """Offline and online evaluation of the newest (or given) checkpoint on the held-out split it was
    trained with (`serve/trained_on.py`), beside an untrained drafter of the same description and the
    n-gram drafter, on the GPU when there is one (`serve/evaluation.py`); also written to
    run_dir/eval/<checkpoint>.json."""
    import sys

    from stage2_train.serve.evaluation import HeldoutSet, evaluate_drafters, one_line
    from stage2_train.serve.trained_on import drafter_gamma, read_trained_on
    from stage2_train.train.launch import train_device

    path = _saved_drafter_path(cfg, checkpoint)
    heldout = HeldoutSet.open(cfg, read_trained_on(path))  # the trainer's checks: target, tokenizer, layers
    for note in heldout.notes:
        print(f"note: {note}", file=sys.stderr)
    if len(heldout.heldout) == 0:
        # The split is the one the drafter was trained with: a larger fraction now would measure trained samples.
        share = round(min(0.5, max(0.05, 3 / max(1, len(heldout.reader)))), 2)
        raise StoreError(
            f"eval.holdout_fraction={heldout.split['holdout_fraction']} leaves no held-out sample among {len(heldout.reader)}, "
            f"and the drafter was trained on every other one: train a new run (another run_dir) with "
            f"eval.holdout_fraction={share} on the same store: `python -m stage2_train train eval.holdout_fraction={share} "
            f"run_dir=NEW_RUN_DIR store.path={cfg.store.url(cfg.run_dir)}`, or extract more data"
        )
    device = train_device(cfg.train)
    loaded = _saved_drafter(cfg, heldout, path, device)
    described = loaded.description
    if "eval.confidence_stop" in cfg.overridden and cfg.eval.confidence_stop is not None and not described.confidence_head:
        # Only DSpark's confidence head stops a block early: whole blocks would be decoded and the stop reported null.
        raise ConfigError(
            f"eval.confidence_stop: the drafter {loaded.weights_file.parent} has no confidence head (a {described.variant} "
            f"drafter{' trained with model.confidence_head=false' if described.variant == 'dspark' else ''}), the command line "
            f"gives {cfg.eval.confidence_stop}: it would decode whole blocks; drop eval.confidence_stop"
        )
    drafters = {"trained": loaded.drafter, "untrained": heldout.untrained(cfg, loaded.description, device, trained=loaded.drafter)}
    gamma, notes = drafter_gamma(cfg, loaded.trained_on, loaded.drafter.block_size)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    prompts = heldout.prompts(cfg.eval.online_num_prompts)
    report = evaluate_drafters(
        drafters, heldout, prompts=[p for _, p in prompts], cfg=cfg, baseline="trained", offline=["trained"], device=device,
        num_prompts_asked=cfg.eval.online_num_prompts, gamma=gamma,
    )
    if report["online"] is not None:
        report["online"]["sample_ids"] = [sid for sid, _ in prompts]
    source = loaded.weights_file
    result = {
        "checkpoint": str(source),
        "weights_sha256": _weights_sha256(source),
        "num_heldout": int(len(heldout.heldout)),
        "split": heldout.split,
        "offline": {**report["offline"]["trained"], "gamma": gamma},
        "online": report["online"],
        "gap": report["gap"].get("trained"),
        "summary": one_line(report),
    }
    name = source.parent.name if source.name == "model.safetensors" else source.stem
    result["written_to"] = str(write_json(RunPaths.of(cfg).eval_dir / f"{name}.json", result))
    return result


def _weights_sha256(weights_file: Path) -> str | None:
    """The sha256 its checkpoint's meta.json records for the weights file (no re-hash); None for a
    drafter folder (an export), which holds no such record."""
    from stage2_train.train.checkpoint.format import read_meta

    meta = read_meta(weights_file.parent) if weights_file.name == "model.safetensors" else None
    return ((meta or {}).get("files") or {}).get(weights_file.name, {}).get("sha256")


def verifier_name(hub_id: str | None, target_config: dict[str, Any], folder_name: str, format: str) -> str:
    """What an export names its verifier by: speculators loads the verifier's embedding and LM head
    from it, so a bare local folder name resolves nowhere. The Hub id the target came from, else the
    one its config.json was saved from, else the folder's name with a warning (speculators format)."""
    import sys

    from shared.hub import is_hub_id

    saved_from = str(target_config.get("_name_or_path") or "")
    if hub_id:
        return hub_id
    if is_hub_id(saved_from):
        # A fine-tune keeps the _name_or_path of the model it was saved from: its head is not that one's.
        if format == "speculators":
            print(f"warning: speculators_config.verifier.name_or_path is {saved_from!r}, read from the config.json of the "
                  f"local target {folder_name!r} (saved from it): speculators loads the verifier's embedding and LM head "
                  f"from there, so if {folder_name!r} is another model (a fine-tune of it), serve with the target's own "
                  f"Hub id set there by hand, or load the target by its Hub id (target.path={saved_from})", file=sys.stderr)
        return saved_from
    if format == "speculators":
        print(f"warning: speculators_config.verifier.name_or_path is {folder_name!r}, a local folder's name that speculators "
              f"cannot load the verifier from; set it to the target's Hub id by hand (the target was not loaded from the Hub)",
              file=sys.stderr)
    return folder_name


def cmd_export(
    cfg: RunConfig, checkpoint: str | None = None, out: str | None = None, format: str = "zlab", push_to_hub: str | None = None
) -> dict[str, Any]:
    """The newest (or given) checkpoint as a servable DFlash folder (default run_dir/export), weights
    in bfloat16 as the published drafters; `format` zlab (default) or speculators. What is written is
    the drafter the checkpoint describes, with a model card, files readable by others and no machine
    paths in config.json; `push_to_hub` uploads it to that Hub repo."""
    from shared.target import cached_tokenizer, resolve_target
    from stage2_train.serve.card import LOCAL_ONLY, publishable, write_card
    from stage2_train.serve.card import push_to_hub as push
    from stage2_train.serve.export import WEIGHTS_NAME, export_drafter, mask_token_string
    from stage2_train.serve.load import read_export_config

    target = resolve_target(cfg.target)
    loaded = _saved_drafter(cfg, target, _saved_drafter_path(cfg, checkpoint))
    tokenizer, _ = cached_tokenizer(str(target.target_dir))
    out_dir = Path(out or RunPaths.of(cfg).export)
    name = target.source.get("hub_id") or Path(cfg.target.path).name  # never this machine's path
    target_config = json.loads((target.target_dir / "config.json").read_text())
    verifier = verifier_name(target.source.get("hub_id"), target_config, name, format)
    target_info = {
        "name": name,
        **{k: v for k, v in target.source.items() if k in ("hub_id", "revision", "commit")},
        "verifier": verifier,
        "weights_sha256": target.weights_sha256,
        "mask_token": mask_token_string(tokenizer, loaded.description.mask_token_id),  # the drafter's, never the config's
        "architectures": target_config.get("architectures") or [],
    }
    training = loaded.trained_on.to_dict() if loaded.trained_on is not None else None
    export_drafter(loaded.drafter, loaded.description, target_info, out_dir, format=format, training=training)
    cfg.write_resolved(out_dir / LOCAL_ONLY)
    write_card(out_dir, loaded.description, _card_facts(cfg, target_info, loaded))
    publishable(out_dir)
    config = read_export_config(out_dir)
    source = loaded.weights_file
    if push_to_hub:
        pushed = push(out_dir, push_to_hub)
        return {"out_dir": str(out_dir), "checkpoint": str(source), "format": format, "pushed_to": push_to_hub, "commit": pushed}
    if format == "speculators":
        return {"out_dir": str(out_dir), "checkpoint": str(source), "format": format,
                "aux_hidden_state_layer_ids": config["aux_hidden_state_layer_ids"], "block_size": config["block_size"]}
    return {
        "out_dir": str(out_dir),
        "checkpoint": str(source),
        "num_tensors": len(loaded.drafter.folded_state_dict()),
        "bytes": (out_dir / WEIGHTS_NAME).stat().st_size,
        "block_size": config["block_size"],
        "num_target_layers": config["num_target_layers"],
        "dflash_config": config["dflash_config"],
    }


def _card_facts(cfg: RunConfig, target_info: dict[str, Any], loaded: Any) -> dict[str, Any]:
    """What the model card states, from what the run recorded: the store's manifest (only when it is
    the store the checkpoint was trained on), the checkpoint's step, and that checkpoint's eval
    (run_dir/eval/<step>.json) when `eval` made one, with the split and store it used: the card calls
    it held-out only when it was the drafter's own split of the store it was trained on."""
    from shared.store import StoreFiles, load_manifest
    from stage2_train.serve.trained_on import other_store

    paths = RunPaths.of(cfg)
    # The drafter's own record, not the store's: serving must render prompts as its data was, whichever store is configured.
    facts: dict[str, Any] = {"target": target_info, "chat_template_kwargs": loaded.trained_on and loaded.trained_on.chat_template_kwargs}
    step_dir = loaded.weights_file.parent
    if step_dir.name.startswith("step_"):
        facts["steps"] = int(step_dir.name[len("step_"):])
        from stage2_train.train.checkpoint.format import saved_run_config

        # This run's steps only: a drafter started from another (model.init_from) carries that one's too.
        facts["init_from"] = ((saved_run_config(step_dir) or {}).get("model") or {}).get("init_from")
    files = StoreFiles(paths.store)
    if files.exists("manifest.json"):
        manifest = load_manifest(files)
        other = other_store(loaded.trained_on, manifest)
        if other is not None:
            facts["data"] = {"other_store": other}
        else:
            facts["data"] = {"source": Path(str((manifest.get("data") or {}).get("source", "unknown"))).name,
                             "num_samples": manifest.get("num_samples"), "num_tokens": manifest.get("num_tokens"),
                             "verified": bool(loaded.trained_on and loaded.trained_on.store_digest)}
    evaluated = paths.eval_dir / f"{step_dir.name}.json"
    recorded = json.loads(evaluated.read_text()) if evaluated.is_file() else {}
    # Named by step only: an eval of another run's checkpoint of the same step (`eval --checkpoint`) writes
    # there too, and a run trained again from scratch in this run_dir saves its own step_N where one was.
    weights, scored = _weights_sha256(loaded.weights_file), recorded.get("weights_sha256")
    if scored is None and recorded and evaluated.stat().st_mtime >= loaded.weights_file.stat().st_mtime:
        scored = weights  # an eval written before it recorded the weights: of these when written after them
    if Path(str(recorded.get("checkpoint", ""))).resolve() != loaded.weights_file.resolve() or (
        weights is not None and scored != weights
    ):
        recorded = {}
    online = recorded.get("online")
    if online is not None:
        trained = online["proposers"]["trained"]["interval"]
        facts["eval"] = {
            # an eval written before `split` was recorded: which data it used is not known
            "split": recorded.get("split") or {},
            **{k: trained.get(k) for k in ("tau", "lo", "hi", "num_prompts")}, "prompts": online["num_prompts"],
            "max_new_tokens": online["max_new_tokens"], "num_exact": online["proposers"]["trained"]["num_exact"],
            "confidence_stop": online["proposers"]["trained"].get("confidence_stop"),
            **{n: online["proposers"][n]["tau"] for n in ("untrained", "ngram") if n in online["proposers"]},
        }
    return facts


# ---------------------------------------------------------------------------------------------
# Commands over a training log (no config needed)


def cmd_doctor(log_path: Path, as_json: bool, cfg: RunConfig | None = None) -> tuple[str, int]:
    from stage2_train.observe.doctor import doctor
    from stage2_train.train.curves import expected_at

    return doctor(log_path, as_json, cfg.detectors if cfg is not None else None, schedule=expected_at)


def cmd_doctor_export(
    cfg: RunConfig, export: str, target: str | None, store: str | None, data: str | None, num_prompts: int, as_json: bool
) -> tuple[str, int]:
    """The export doctor (`serve/diagnose.py`): the drafter folder against `target` (default the config's
    target.path, its other target settings kept), and against `store` (default the config's store, when
    it has a manifest); the `eval` section says how the drafter that passes is decoded."""
    from shared.store import StoreFiles
    from stage2_train.serve.diagnose import DecodeSettings, doctor_export
    from stage2_train.train.launch import train_device

    target_cfg = cfg.target.model_copy(update={"path": target}) if target else cfg.target
    if store is None:
        configured = RunPaths.of(cfg).store
        store = configured if StoreFiles(configured).exists("manifest.json") else None
    if num_prompts < 0:
        raise ConfigError(f"--prompts must be >= 0, got {num_prompts}")
    settings = DecodeSettings(
        num_prompts=num_prompts, max_new_tokens=cfg.eval.online_max_new_tokens, dtype=cfg.eval.online_dtype,
        holdout_fraction=cfg.eval.holdout_fraction, split_seed=cfg.eval.split_seed, device=train_device(cfg.train),
    )
    return doctor_export(as_json, export=export, target_cfg=target_cfg, store=store, data=data, settings=settings)


def cmd_report(log_path: Path, out_dir: Path | None) -> dict[str, Any]:
    from stage2_train.observe.report import report
    from stage2_train.train.curves import expected_at

    return report(log_path, out_dir, schedule=expected_at)


def write_json(path: Path, data: Any) -> Path:
    return write_atomic(path, json.dumps(data, indent=1, default=str))
