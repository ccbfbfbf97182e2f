"""Validated configuration: one section per component, YAML presets, dotted overrides.

Each component declares its own section next to its class:

    @dataclass(kw_only=True)
    class StoreConfig(Section):
        section: ClassVar[str] = "store"
        shard_mb: int = 256
        def validate(self) -> None:
            self.require(self.shard_mb > 0, "shard_mb", "must be > 0")

`load_run_config(path, overrides, sections)` reads a preset, applies `key=value` overrides,
rejects unknown keys and bad values with a ValueError naming the dotted key, and returns a
`RunConfig` whose attributes are the built sections. Sections owned by the other stage are
kept as raw dicts (stage 1 must not import stage 2) but their names must still be known.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

# Every section name either stage may own. A key outside this set is a typo, whichever stage reads it.
ALL_SECTIONS = (
    "target",
    "data",
    "generate",
    "extract",
    "store",
    "sampler",
    "noise",
    "model",
    "loss",
    "optim",
    "train",
    "checkpoint",
    "eval",
    "log",
    "doctor",
)
TOP_LEVEL_SCALARS = {"run_dir": str, "seed": int}


@dataclass(kw_only=True)
class Section:
    """Base of every component config. Subclasses set `section` and may override `validate`."""

    section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError (through `require`) for values that cannot work."""

    def recipe_warnings(self) -> list[str]:
        """Values that are legal but depart from the published DFlash recipe."""
        return []

    def require(self, ok: bool, key: str, what: str) -> None:
        if not ok:
            raise ValueError(f"{self.section}.{key} {what}, got {getattr(self, key)!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Section:
        data = dict(data or {})
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(
                f"{cls.section}.{unknown[0]}: unknown key (known keys: {', '.join(sorted(fields))})"
            )
        kwargs = {k: coerce(v, hints[k], f"{cls.section}.{k}") for k, v in data.items()}
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.init}


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return value


def coerce(value: Any, hint: Any, key: str) -> Any:
    """Check `value` against a type hint, converting only lossless spellings (int -> float, '1e-4')."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, key)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {hint}")
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{key} must be one of {list(args)}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key} must be a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ValueError(f"{key} must have {len(args)} items, got {value!r}")
            return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool):
            raise ValueError(f"{key} must be a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads "1e-4" as a string
            except ValueError:
                pass
        raise ValueError(f"{key} must be a number, got {value!r}")
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {value!r}")
        return value
    raise TypeError(f"{key}: unsupported config type {hint!r}")


class RunConfig:
    """The composed config of one command: top-level scalars plus one object per section."""

    def __init__(self, run_dir: str, seed: int, sections: dict[str, Any], source: str | None):
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
        for name, value in self.sections.items():
            out[name] = value.to_dict() if isinstance(value, Section) else value
        return out

    def recipe_warnings(self) -> list[str]:
        warnings: list[str] = []
        for value in self.sections.values():
            if isinstance(value, Section):
                warnings.extend(value.recipe_warnings())
        return warnings

    def write_resolved(self, path: str | os.PathLike) -> Path:
        """Save the resolved config beside an output, atomically, so it always says what made it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        os.replace(tmp, path)
        return path


def parse_override(text: str) -> tuple[list[str], Any]:
    """'train.lr=6e-4' -> (['train', 'lr'], 6e-4). Values are YAML scalars or lists."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like key=value (for example train.max_steps=10)")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts) or len(parts) > 2:
        raise ValueError(f"override key {key!r} must be a top-level key or section.key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ValueError(f"override {text!r}: value is not valid YAML ({exc})") from None
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
                raise ValueError(f"override {text!r}: {parts[0]} is not a section")
            section[parts[1]] = value
    return data


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a mapping of sections")
    base = data.pop("inherit", None)
    if base is not None:
        # Presets differ from a base in a few fields: `inherit: default.yaml` merges section by section.
        parent = load_yaml(path.parent / base)
        for key, value in data.items():
            if isinstance(value, dict) and isinstance(parent.get(key), dict):
                parent[key] = {**parent[key], **value}
            else:
                parent[key] = value
        data = parent
    return data


def build_run_config(
    data: dict[str, Any], sections: dict[str, type[Section]], source: str | None = None
) -> RunConfig:
    for key in data:
        if key not in ALL_SECTIONS and key not in TOP_LEVEL_SCALARS:
            known = ", ".join(list(TOP_LEVEL_SCALARS) + list(ALL_SECTIONS))
            raise ValueError(f"{key}: unknown top-level key (known: {known})")
    run_dir = coerce(data.get("run_dir", "runs/default"), str, "run_dir")
    seed = coerce(data.get("seed", 0), int, "seed")
    built: dict[str, Any] = {}
    for name in ALL_SECTIONS:
        raw = data.get(name)
        if raw is not None and not isinstance(raw, dict):
            raise ValueError(f"{name} must be a mapping of keys, got {raw!r}")
        if name in sections:
            built[name] = sections[name].from_dict(raw)
        elif raw is not None:
            built[name] = raw  # owned by the other stage, which validates it
    return RunConfig(run_dir=run_dir, seed=seed, sections=built, source=source)


def load_run_config(
    path: str | os.PathLike | None, overrides: list[str], sections: dict[str, type[Section]]
) -> RunConfig:
    data = load_yaml(path) if path is not None else {}
    data = apply_overrides(data, overrides)
    return build_run_config(data, sections, source=str(path) if path else None)
