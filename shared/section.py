"""The base of every component config (`Section`) and how its validation errors read.

Its own module so that the sections of `shared` (store, target) and the loader in `config.py`
import it without importing each other.
"""

from __future__ import annotations

import types
import typing
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from shared.errors import ConfigError


class Section(BaseModel):
    """Base of every component config. Subclasses set `section` and may override `validate`."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)
    section: ClassVar[str] = ""
    renamed: ClassVar[dict[str, str]] = {}
    """Old key -> its new name: an old config is refused naming the key to use instead."""

    def validate(self) -> None:  # type: ignore[override]  # pydantic's deprecated classmethod of that name
        """Raise ValueError (through `require`) for values that cannot work together."""

    def recipe_warnings(self) -> list[str]:
        """Values that are legal but depart from the published DFlash recipe."""
        return []

    def alternatives(self) -> list[str]:
        """Options this section offers beyond the recipe, with what was measured, while the recipe's
        setting is in use (`check` lists them, so a user choosing a run sees every lever)."""
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
        return {name: plain_value(getattr(self, name)) for name in type(self).model_fields}

    @classmethod
    def explain(cls) -> list[tuple[str, str, Any, str]]:
        """(key, type, default, documentation) of every field, for `check --explain`."""
        out = []
        for name, field in cls.model_fields.items():
            default = None if field.default_factory is not None else field.default
            out.append((f"{cls.section}.{name}", _type_name(field.annotation), plain_value(default), field.description or ""))
        return out


def _lossless(value: Any, hint: Any) -> Any:
    """A YAML list for a tuple field becomes a tuple; a numeric string for a float field a float; a
    bare on/off (a boolean to YAML 1.1) for an on/off choice the word it was."""
    if isinstance(value, bool) and typing.get_origin(hint) is typing.Literal and {"on", "off"} <= set(typing.get_args(hint)):
        return "on" if value else "off"
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


def explained_by(section: str) -> str:
    """The command that documents `section`'s keys: its stage's `check --explain` (stage 1's for a shared one)."""
    from shared.config import SECTION_OWNERS  # shared.config imports this module

    owner = SECTION_OWNERS.get(section, "shared")
    return f"`python -m {'stage1_extract' if owner == 'shared' else owner} check --explain`"


def _describe(cls: type[Section], exc: ValidationError) -> str:
    """One line for the first error: the dotted key, what is wrong, and the value given."""
    error = exc.errors(include_url=False)[0]
    if error["type"] == "value_error":  # raised by `require` with the whole message
        return str(error["ctx"]["error"])
    loc = ".".join(str(p) for p in error["loc"] if not isinstance(p, int) or len(error["loc"]) == 1)
    key = f"{cls.section}.{loc}" if loc else cls.section
    if error["type"] == "extra_forbidden":
        old = str(error["loc"][0])
        if old in cls.renamed:
            new = cls.renamed[old]
            if "." in new:  # moved to another section
                return f"{key}: moved to {new}; write {new}"
            return f"{key}: renamed to {cls.section}.{new} ({explained_by(cls.section)} says what it holds); write {cls.section}.{new}"
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


def plain_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return [plain_value(v) for v in value]
    if isinstance(value, list):
        return [plain_value(v) for v in value]
    return value
