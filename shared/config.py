"""Validated configuration: one pydantic section per component, YAML presets, dotted overrides.

Each component declares its own section next to its class; the docstring under a field is its
documentation (`python -m stage2_train check --explain` prints it):

    class StoreConfig(Section):
        section: ClassVar[str] = "store"
        shard_mb: int = 256
        \"\"\"Target size of one shard group.\"\"\"

        def validate(self) -> None:
            self.require(self.shard_mb > 0, "shard_mb", "must be > 0")

`load_run_config(path, overrides)` reads a preset (following `inherit:`), applies `key=value`
overrides and builds EVERY section of the file, whichever stage runs, so a typo in the other
stage's section stops at once too. Unknown keys and bad values raise ConfigError naming the dotted
key and the value. `SECTION_CLASSES` names the class that owns each section by import path: shared
code never imports a stage at import time, and a config load imports only the section classes.

Types are strict (pydantic strict mode): `true` is not an integer and `'3'` is not a number, with
two lossless spellings accepted: a YAML list for a tuple field, and "1e-4" (YAML 1.1 reads a
float without a dot as a string) for a float field.
"""

from __future__ import annotations

import importlib
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from shared.errors import ConfigError, InputFileError

# Every section a config file may hold, and the class that validates it ("module:Class").
SECTION_CLASSES: dict[str, str] = {
    "target": "shared.target:TargetConfig",
    "data": "stage1_extract.data:DataConfig",
    "generate": "stage1_extract.generate:GenerateConfig",
    "extract": "stage1_extract.extract:ExtractConfig",
    "store": "shared.store:StoreConfig",
    "sampler": "stage2_train.data.sampler:SamplerConfig",
    "noise": "stage2_train.train.schedules:NoiseConfig",
    "model": "stage2_train.model.drafter:DrafterConfig",
    "loss": "stage2_train.model.loss:LossConfig",
    "optim": "stage2_train.train.schedules:OptimConfig",
    "train": "stage2_train.train.trainer:TrainConfig",
    "checkpoint": "stage2_train.train.checkpoint:CheckpointConfig",
    "eval": "stage2_train.train.evaluate:EvalConfig",
    "log": "stage2_train.observe.metrics:LogConfig",
    "doctor": "stage2_train.observe.detectors:DetectorConfig",
}
TOP_LEVEL_SCALARS = {"run_dir": str, "seed": int}
TOP_LEVEL_DOCS = {
    "run_dir": "Root of everything a command writes: data, store (unless store.path), checkpoints, logs.",
    "seed": "Seeds generation, the drafter's initialisation, batching, anchors and noise.",
}


class Section(BaseModel):
    """Base of every component config. Subclasses set `section` and may override `validate`."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)
    section: ClassVar[str] = ""

    def validate(self) -> None:  # type: ignore[override]  # pydantic's deprecated classmethod of that name
        """Raise ValueError (through `require`) for values that cannot work together."""

    def recipe_warnings(self) -> list[str]:
        """Values that are legal but depart from the published DFlash recipe."""
        return []

    def require(self, ok: bool, key: str, what: str) -> None:
        if not ok:
            raise ValueError(f"{self.section}.{key} {what}, got {getattr(self, key)!r}")

    @model_validator(mode="before")
    @classmethod
    def _lossless_spellings(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, value in data.items():
            field = cls.model_fields.get(name)
            if field is not None:
                out[name] = _lossless(value, field.annotation)
        return out

    @model_validator(mode="after")
    def _check(self) -> Section:
        self.validate()
        return self

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Section:
        """The section built from plain (YAML) data; ConfigError naming the dotted key on any problem."""
        try:
            return cls.model_validate(dict(data or {}))
        except ValidationError as exc:
            raise ConfigError(_describe(cls, exc)) from None

    def to_dict(self) -> dict[str, Any]:
        return {name: _plain(getattr(self, name)) for name in type(self).model_fields}

    @classmethod
    def explain(cls) -> list[tuple[str, str, Any, str]]:
        """(key, type, default, documentation) of every field, for `check --explain`."""
        out = []
        for name, field in cls.model_fields.items():
            default = None if field.default_factory is not None else field.default
            out.append((f"{cls.section}.{name}", _type_name(field.annotation), _plain(default), field.description or ""))
        return out


def _lossless(value: Any, hint: Any) -> Any:
    """A YAML list for a tuple field becomes a tuple; a numeric string for a float field a float."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if isinstance(value, list) and any(typing.get_origin(o) is tuple for o in options):
        return tuple(value)
    if isinstance(value, str) and float in options:
        try:
            return float(value)
        except ValueError:
            return value
    return value


_TYPE_WORDS = {
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "tuple_type": "must be a list",
    "dict_type": "must be a mapping",
    "too_short": "has too few items",
    "too_long": "has too many items",
    "missing": "is required",
}


def _describe(cls: type[Section], exc: ValidationError) -> str:
    """One line for the first error: the dotted key, what is wrong, and the value given."""
    error = exc.errors(include_url=False)[0]
    if error["type"] == "value_error":  # raised by `require` with the whole message
        return str(error["ctx"]["error"])
    loc = ".".join(str(p) for p in error["loc"] if not isinstance(p, int) or len(error["loc"]) == 1)
    key = f"{cls.section}.{loc}" if loc else cls.section
    if error["type"] == "extra_forbidden":
        return f"{key}: unknown key (known keys: {', '.join(cls.model_fields)})"
    if error["type"] == "literal_error":
        top = cls.model_fields[str(error["loc"][0])].annotation
        choices = [a for o in _options(top) if typing.get_origin(o) is Literal for a in typing.get_args(o)]
        return f"{key} must be one of {choices}, got {error['input']!r}"
    what = _TYPE_WORDS.get(error["type"], error["msg"])
    if error["loc"] and isinstance(error["loc"][-1], int):
        key = f"{key}[{error['loc'][-1]}]"
    return f"{key} {what}, got {error['input']!r}"


def _options(hint: Any) -> tuple[Any, ...]:
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def _type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def section_class(name: str) -> type[Section]:
    module, cls = SECTION_CLASSES[name].split(":")
    return getattr(importlib.import_module(module), cls)


class RunConfig:
    """The composed config of one command: top-level scalars plus one built section per name."""

    def __init__(self, run_dir: str, seed: int, sections: dict[str, Section], source: str | None):
        self.run_dir = run_dir
        self.seed = seed
        self.sections = sections
        self.source = source

    def __getattr__(self, name: str) -> Any:
        sections = self.__dict__.get("sections", {})
        if name in sections:
            return sections[name]
        raise AttributeError(name)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"run_dir": self.run_dir, "seed": self.seed}
        out.update({name: value.to_dict() for name, value in self.sections.items()})
        return out

    def recipe_warnings(self) -> list[str]:
        """Every section's departures from the published recipe; gamma is checked against the block size."""
        warnings: list[str] = []
        for name, value in self.sections.items():
            if name == "loss":
                warnings.extend(value.recipe_warnings(block_size=self.model.block_size))
            else:
                warnings.extend(value.recipe_warnings())
        return warnings

    def write_resolved(self, path: str | os.PathLike) -> Path:
        """Save the resolved config beside an output, atomically, so it always says what made it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        os.replace(tmp, path)
        return path


def parse_override(text: str) -> tuple[list[str], Any]:
    """'train.lr=6e-4' -> (['train', 'lr'], '6e-4'). Values are YAML scalars or lists."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key=value (for example train.max_steps=10)")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts) or len(parts) > 2:
        raise ConfigError(f"override key {key!r} must be a top-level key or section.key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc})") from None
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    data = json.loads(json.dumps(data))  # deep copy of plain YAML data
    for text in overrides:
        parts, value = parse_override(text)
        if len(parts) == 1:
            data[parts[0]] = value
        else:
            section = data.setdefault(parts[0], {})
            if not isinstance(section, dict):
                raise ConfigError(f"override {text!r}: {parts[0]} is not a section")
            section[parts[1]] = value
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""


def _mapping_without_duplicates(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(
                f"{loader.name}: key {key!r} appears twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1}); "
                f"keep one"
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def load_yaml(path: str | os.PathLike, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A preset with its `inherit:` bases merged in, section by section.

    `inherit` names one file or a list of files (relative to this one), merged in order, then this
    file on top. A loop (a file inheriting itself through others) is a ConfigError naming the chain."""
    path = Path(path)
    if not path.is_file():
        raise InputFileError(f"config file not found: {path}")
    resolved = path.resolve()
    if resolved in _chain:
        loop = " -> ".join(p.name for p in (*_chain, resolved))
        raise ConfigError(f"{path}: `inherit` loops back to itself ({loop})")
    text = path.read_text()
    try:
        data = _load_unique(text, path)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    bases = data.pop("inherit", None)
    if bases is None:
        return data
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases) or not bases:
        raise ConfigError(f"{path}: inherit must name a file or a list of files, got {bases!r}")
    merged: dict[str, Any] = {}
    for base in bases:
        _merge(merged, load_yaml(path.parent / base, (*_chain, resolved)))
    return _merge(merged, data)


def _load_unique(text: str, path: Path) -> Any:
    loader = _UniqueKeyLoader(text)
    loader.name = str(path)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _merge(into: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            into[key] = {**into[key], **value}
        else:
            into[key] = value
    return into


def build_run_config(data: dict[str, Any], source: str | None = None) -> RunConfig:
    for key in data:
        if key not in SECTION_CLASSES and key not in TOP_LEVEL_SCALARS:
            known = ", ".join(list(TOP_LEVEL_SCALARS) + list(SECTION_CLASSES))
            raise ConfigError(f"{key}: unknown top-level key (known: {known})")
    run_dir = data.get("run_dir", "runs/default")
    seed = data.get("seed", 0)
    if not isinstance(run_dir, str) or not run_dir:
        raise ConfigError(f"run_dir must be a non-empty string, got {run_dir!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    built: dict[str, Section] = {}
    for name in SECTION_CLASSES:
        raw = data.get(name)
        if raw is not None and not isinstance(raw, dict):
            raise ConfigError(f"{name} must be a mapping of keys, got {raw!r}")
        built[name] = section_class(name).from_dict(raw)
    return RunConfig(run_dir=run_dir, seed=seed, sections=built, source=source)


def load_run_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    data = load_yaml(path) if path is not None else {}
    data = apply_overrides(data, list(overrides))
    return build_run_config(data, source=str(path) if path else None)


def explain(cfg: RunConfig) -> str:
    """Every key with its value, type, default and documentation (`check --explain`)."""
    lines = []
    for key, doc in TOP_LEVEL_DOCS.items():
        lines.append(f"{key} = {getattr(cfg, key)!r}\n    {doc}")
    for name, section in cfg.sections.items():
        lines.append(f"\n[{name}]")
        for key, kind, default, doc in type(section).explain():
            value = _plain(getattr(section, key.split(".", 1)[1]))
            changed = "" if value == default else f"   (default {default!r})"
            lines.append(f"{key} = {value!r}   : {kind}{changed}")
            if doc:
                lines.append(f"    {doc}")
    return "\n".join(lines)
