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
overrides and builds every section whose class is registered. Shared code never imports a stage:
each stage registers the sections it owns when it is imported (`stage1_extract/__init__.py`,
`stage2_train/__init__.py` call `register_sections`), and `SECTION_OWNERS` names every section a
file may hold and which stage owns it, so a section of the other stage is kept as given, checked to
be a mapping, and validated by its own entry point (`make extract` / `make train` run both
stages' `check --quiet` first, so a typo in the other stage's section still stops at once). Unknown
keys and bad values raise ConfigError naming the dotted key and the value; a renamed key or section
is refused naming its new name.

A preset is a path, or the name of a file in the project's `configs/` folder (`qwen3-8b`).

Types are strict (pydantic strict mode): `true` is not an integer and `'3'` is not a number, with
two lossless spellings accepted: a YAML list for a tuple field, and "1e-4" (YAML 1.1 reads a
float without a dot as a string) for a float field.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from shared.errors import ConfigError, InputFileError
from shared.files import write_atomic
from shared.section import Section, explained_by, plain_value  # noqa: F401 - Section is re-exported: the stages import it from here

# Every section a config file may hold and the stage whose entry point validates it: names only,
# so shared code knows the file format without importing either stage.
SECTION_OWNERS: dict[str, str] = {
    "target": "shared",
    "store": "shared",
    "data": "stage1_extract",
    "generate": "stage1_extract",
    "extract": "stage1_extract",
    "sampler": "stage2_train",
    "noise": "stage2_train",
    "model": "stage2_train",
    "loss": "stage2_train",
    "optim": "stage2_train",
    "train": "stage2_train",
    "checkpoint": "stage2_train",
    "eval": "stage2_train",
    "log": "stage2_train",
    "detectors": "stage2_train",
}
# A section renamed since configs were written: the old name is refused naming the new one.
RENAMED_SECTIONS: dict[str, str] = {"doctor": "detectors"}
_REGISTERED: dict[str, type[Section]] = {}
# Rules across one stage's sections (gamma against the block size, the global batch), registered by
# the stage that owns them: shared code knows no stage's rules.
_CROSS_WARNINGS: list[Callable[[RunConfig], list[str]]] = []
_NOTES: list[Callable[[RunConfig], list[str]]] = []
PRESETS_DIR = Path(__file__).resolve().parent.parent / "configs"
TOP_LEVEL_SCALARS = {"run_dir": str, "seed": int}
TOP_LEVEL_DOCS = {
    "run_dir": "Root of everything a command writes: data, store (unless store.path), checkpoints, logs.",
    "seed": "Seeds the drafter's initialisation, batching, anchors and noise (generation has its own: generate.seed).",
}


def register_sections(*classes: type[Section]) -> None:
    """Make these sections known to the loader (each stage calls it for the sections it owns)."""
    for cls in classes:
        if cls.section not in SECTION_OWNERS:
            raise ValueError(f"section {cls.section!r} is not listed in SECTION_OWNERS")
        _REGISTERED[cls.section] = cls


def register_rules(
    warnings: Callable[[RunConfig], list[str]] | None = None, notes: Callable[[RunConfig], list[str]] | None = None
) -> None:
    """A stage's rules across its sections: departures from the recipe (`warnings`) and what `check`
    should tell about the config (`notes`); each is called with the composed config."""
    if warnings is not None and warnings not in _CROSS_WARNINGS:
        _CROSS_WARNINGS.append(warnings)
    if notes is not None and notes not in _NOTES:
        _NOTES.append(notes)


def _shared_sections() -> dict[str, type[Section]]:
    from shared.store import StoreConfig
    from shared.target import TargetConfig

    return {"target": TargetConfig, "store": StoreConfig}


def registered_sections() -> dict[str, type[Section]]:
    """The sections this process validates: the shared ones plus those of every imported stage."""
    return {**_shared_sections(), **_REGISTERED}


class RunConfig:
    """The composed config of one command: top-level scalars plus one built section per name."""

    def __init__(
        self,
        run_dir: str,
        seed: int,
        sections: dict[str, Section],
        source: str | None,
        foreign: dict[str, dict[str, Any]] | None = None,
        overridden: frozenset[str] = frozenset(),
    ):
        self.run_dir = run_dir
        self.seed = seed
        self.sections = sections
        self.source = source
        self.foreign = foreign or {}  # other stages' sections, as given (their entry point validates them)
        self.overridden = overridden  # dotted keys given on the command line (key=value), not in a file

    def __getattr__(self, name: str) -> Any:
        sections = self.__dict__.get("sections", {})
        if name in sections:
            return sections[name]
        raise AttributeError(name)

    def value(self, dotted: str, default: Any = None) -> Any:
        """`section.key` as this process sees it: the validated section's value when this stage owns
        the section, else the value given in the file (another stage's section), else `default`
        (which must be that stage's own default: shared.identity lists the ones stage 2 reads)."""
        name, key = dotted.split(".", 1)
        if name in self.sections:
            return getattr(self.sections[name], key)
        return self.foreign.get(name, {}).get(key, default)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"run_dir": self.run_dir, "seed": self.seed}
        for name in SECTION_OWNERS:
            if name in self.sections:
                out[name] = self.sections[name].to_dict()
            elif name in self.foreign:
                out[name] = self.foreign[name]
        return out

    def unvalidated(self) -> list[str]:
        """Sections present in the file that this process does not validate (another stage's)."""
        return sorted(self.foreign)

    def unvalidated_by_owner(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name in self.unvalidated():
            out.setdefault(SECTION_OWNERS[name], []).append(name)
        return out

    def notes(self) -> list[str]:
        """What the stages' rules tell about this config (`check` prints them)."""
        return [line for rule in _NOTES for line in rule(self)]

    def recipe_warnings(self) -> list[str]:
        """Every section's departures from the published recipe, then the stages' rules across sections."""
        warnings = [w for value in self.sections.values() for w in value.recipe_warnings()]
        return warnings + [w for rule in _CROSS_WARNINGS for w in rule(self)]

    def alternatives(self) -> list[str]:
        """Every section's measured options beyond the recipe that this config does not use."""
        return [line for value in self.sections.values() for line in value.alternatives()]

    def write_resolved(self, path: str | os.PathLike) -> Path:
        """Save the resolved config beside an output, atomically, so it always says what made it."""
        return write_atomic(path, yaml.safe_dump(self.to_dict(), sort_keys=False))


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

    `inherit` names one file or a list of files (relative to this one, or a preset of the project by
    name), merged in order, then this file on top. A loop (a file inheriting itself through others)
    is a ConfigError naming the chain."""
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
        # A file beside this one, else a preset of the project by name (a user's config anywhere can
        # say `inherit: qwen3-8b`).
        beside = path.parent / base
        try:
            found = beside if beside.is_file() else resolve_preset(base)
        except InputFileError as exc:  # the typo is in this file, which the bare "not found" would not name
            raise InputFileError(f"{path}: inherit: {exc}") from None
        _merge(merged, load_yaml(found, (*_chain, resolved)))
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
        if key in RENAMED_SECTIONS:
            new = RENAMED_SECTIONS[key]
            raise ConfigError(
                f"{key}: section renamed to {new} ({explained_by(new)} says what it holds); write {new}: "
                f"(or {new}.KEY=VALUE on the command line)"
            )
        if key not in SECTION_OWNERS and key not in TOP_LEVEL_SCALARS:
            known = ", ".join(list(TOP_LEVEL_SCALARS) + list(SECTION_OWNERS))
            raise ConfigError(f"{key}: unknown top-level key (known: {known})")
    run_dir = data.get("run_dir", "runs/default")
    seed = data.get("seed", 0)
    if not isinstance(run_dir, str) or not run_dir:
        raise ConfigError(f"run_dir must be a non-empty string, got {run_dir!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    classes = registered_sections()
    built: dict[str, Section] = {}
    foreign: dict[str, dict[str, Any]] = {}
    for name in SECTION_OWNERS:
        raw = data.get(name)
        if raw is not None and not isinstance(raw, dict):
            raise ConfigError(f"{name} must be a mapping of keys, got {raw!r}")
        if name in classes:
            built[name] = classes[name].from_dict(raw)
        elif raw:
            foreign[name] = raw
    return RunConfig(run_dir=run_dir, seed=seed, sections=built, source=source, foreign=foreign)


def resolve_preset(path: str | os.PathLike) -> Path:
    """A config path as given, or the name of a preset in the project's configs/ ('qwen3-8b')."""
    given = Path(path)
    if given.is_file():
        return given
    for candidate in (PRESETS_DIR / given.name, PRESETS_DIR / f"{given.name}.yaml"):
        if given.parent == Path(".") and candidate.is_file():
            return candidate
    presets = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
    close = difflib.get_close_matches(given.name.removesuffix(".yaml"), presets, n=1)
    raise InputFileError(f"config file not found: {path} (a path, or a preset name: {', '.join(presets)}"
                         + (f"; did you mean {close[0]}?)" if close else ")"))


def load_run_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    data = load_yaml(resolve_preset(path)) if path is not None else {}
    data = apply_overrides(data, list(overrides))
    cfg = build_run_config(data, source=str(path) if path else None)
    cfg.overridden = frozenset(".".join(parse_override(text)[0]) for text in overrides)
    return cfg


def explain(cfg: RunConfig) -> str:
    """Every key with its value, type, default and documentation (`check --explain`)."""
    lines = []
    for key, doc in TOP_LEVEL_DOCS.items():
        lines.append(f"{key} = {getattr(cfg, key)!r}\n    {doc}")
    for name, section in cfg.sections.items():
        lines.append(f"\n[{name}]")
        for key, kind, default, doc in type(section).explain():
            value = plain_value(getattr(section, key.split(".", 1)[1]))
            changed = "" if value == default else f"   (default {default!r})"
            lines.append(f"{key} = {value!r}   : {kind}{changed}")
            if doc:
                lines.append(f"    {doc}")
    for owner in sorted({SECTION_OWNERS[name] for name in cfg.unvalidated()}):
        names = ", ".join(n for n in cfg.unvalidated() if SECTION_OWNERS[n] == owner)
        lines.append(f"\n# [{names}]: {owner}'s sections, documented by `python -m {owner} check --explain`")
    return "\n".join(lines)


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and tuples are leaves (as lists)."""
    if not isinstance(data, dict):
        return {prefix: plain_value(data)} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, name))
        else:
            out[name] = plain_value(value)
    return out


def dotted_differences(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]]:
    """Dotted key -> [old value, new value] for every leaf that differs (None where absent): the one
    config diff behind store staleness, resume checks and the `resume` event."""
    a, b = flatten(old), flatten(new)
    return {key: [a.get(key), b.get(key)] for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)}
