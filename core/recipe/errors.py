"""A pydantic `ValidationError` of the recipe schema as a `ConfigError` that names each dotted key the way the user
writes it (`data.train[1].shards`, discriminated-union tags dropped), with a close-match hint for an unknown key."""

from __future__ import annotations

import difflib
import typing
from typing import Annotated, Any

from pydantic import BaseModel, Tag, ValidationError


class ConfigError(ValueError):
    """A recipe or override that does not fit the schema; the message names the key."""


def close_matches(word: str, candidates: list[str], n: int = 1, prefix: str = "") -> str:
    """` (did you mean 'x'?)` for the candidates closest to a mistyped `word`, each shown after `prefix`; empty when
    none is close."""
    close = difflib.get_close_matches(word, candidates, n=n)
    return f" (did you mean {' or '.join(repr(prefix + c) for c in close)}?)" if close else ""


def _unwrap(annotation: Any) -> type:
    """`Annotated[X, ...]` -> X; a plain class as it is; anything else -> `object`."""
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation if isinstance(annotation, type) else object


def _union_members(annotation: Any) -> dict[str, type[BaseModel] | None]:
    """A discriminated union's members by the tag pydantic puts into error locations (a `Tag`, else the member's
    `kind`), each as the section it holds (a `list[Section]` member: its items'; None for plain values). Empty
    when `annotation` is not such a union."""
    members: dict[str, type[BaseModel] | None] = {}
    for arg in typing.get_args(annotation):
        tag = None
        if typing.get_origin(arg) is Annotated:
            arg, *metadata = typing.get_args(arg)
            tag = next((m.tag for m in metadata if isinstance(m, Tag)), None)
        if typing.get_origin(arg) is list:
            arg = typing.get_args(arg)[0]
        model = _unwrap(arg)
        model = model if issubclass(model, BaseModel) else None
        if tag is None and model is not None and "kind" in model.model_fields:
            tag = model.model_fields["kind"].default
        if tag is not None:
            members[tag] = model
    return members


def _walk(loc: tuple, root: type[BaseModel]) -> tuple[list[str], type[BaseModel] | None]:
    """An error location as the user writes it (discriminated-union tags such as `mae` dropped, list items as
    `train[1]`), and the section model holding its last key (None when that is not a section)."""
    model: type[BaseModel] | None = root
    members: dict[str, type[BaseModel] | None] = {}
    keys: list[str] = []
    for i, part in enumerate(loc):
        if members:  # pydantic puts the chosen member's tag into the location
            model, members = members.get(part), {}
            continue
        if isinstance(part, int) and keys:
            keys[-1] += f"[{part}]"
            continue
        keys.append(str(part))
        field = model.model_fields.get(part) if model is not None and i < len(loc) - 1 else None
        annotation = field.annotation if field is not None else None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
        else:
            members = _union_members(annotation)
            model = None if i < len(loc) - 1 and not members else model
    return keys, model


def explain(err: ValidationError, source: str, root: type[BaseModel]) -> ConfigError:
    """One line per error of validating `root` from the recipe `source`."""
    lines = []
    for e in err.errors():
        keys, parent = _walk(tuple(e["loc"]), root)
        key = ".".join(keys) or "<root>"
        if e["type"] == "extra_forbidden":
            fields = list(parent.model_fields) if parent is not None else []
            lines.append(f"{key}: unknown key{close_matches(keys[-1], fields)}")
        elif keys:
            lines.append(f"{key}: {e['msg']} (got {e.get('input')!r})")
        else:  # a cross-field check: its message names the keys
            lines.append(e["msg"].removeprefix("Value error, "))
    return ConfigError(f"{source}: invalid recipe\n  " + "\n  ".join(lines))
