"""The recipe reference, read from the schema itself: every key's type, default and description.

    python -m core.recipe.reference > docs/recipe-reference.md   # the generated page (a test keeps it current)
    python -m core.recipe.reference --explain objective.mask_ratio   # one key (also `./launch.sh --explain KEY`)

Each section is one table. A section chosen by `kind` (objective, objective.mask) gets one table per kind, and a
key that several kinds share (objective.mask_ratio: mae and simmim) is explained once per kind.
"""

from __future__ import annotations

import re
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from core.compat.closed_pipe import quiet_on_closed_pipe
from core.recipe.config import Config
from core.recipe.errors import ConfigError, close_matches

REGENERATE = "python -m core.recipe.reference > docs/recipe-reference.md"

_BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}  # pydantic's constraint names


@dataclass(frozen=True)
class KeyDoc:
    """One recipe key as the reference shows it."""

    key: str
    """Dotted, as a recipe or an override writes it (`data.train[].weight` for a key of each list item)."""
    kind: str | None
    """The `kind` that has this key (`objective.kind: mae`), None for a key of every kind."""
    type: str
    default: str
    description: str


@dataclass(frozen=True)
class Table:
    """One section: its title, what the section is (its class docstring) and its keys."""

    title: str
    intro: str
    keys: list[KeyDoc]


def tables(model: type[BaseModel] = Config, prefix: str = "", kind: str | None = None) -> Iterator[Table]:
    """Every section under `model` as tables, the section's own first and its sub-sections after it."""
    keys, below = [], []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        keys.append(_key_doc(key, kind, field))
        for variant_kind, section, sub_prefix in _sections_of(key, field.annotation):
            below.extend(tables(section, sub_prefix, ", ".join(filter(None, (kind, variant_kind))) or None))
    title = prefix.rstrip(".") or "top level"
    yield Table(f"{title} ({kind})" if kind else title, _clean(model.__doc__ or ""), keys)
    yield from below


def all_keys() -> list[KeyDoc]:
    """Every key of the recipe, in the reference's order."""
    return [doc for table in tables() for doc in table.keys]


def _sections_of(key: str, annotation: Any) -> Iterator[tuple[str | None, type[BaseModel], str]]:
    """The sections a field holds as (kind, section, key prefix of its keys): one for a plain section, one per
    member of a union chosen by `kind`, the item section of a list of sections (`data.train[]`)."""
    for member in _members(annotation):
        if typing.get_origin(member) is list:
            member = typing.get_args(member)[0]
            if _is_section(member):
                yield None, member, f"{key}[]."
        elif _is_section(member):
            kind = f"{key}.kind: {member.model_fields['kind'].default}" if _is_choice(annotation) else None
            yield kind, member, f"{key}."


def _members(annotation: Any) -> list[Any]:
    """A union's members (Annotated wrappers dropped), or the annotation alone."""
    annotation = _strip(annotation)
    args = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    return [_strip(arg) for arg in args]


def _strip(annotation: Any) -> Any:
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _is_choice(annotation: Any) -> bool:
    """Whether a field holds one of several sections, chosen by their `kind`."""
    return sum(_is_section(member) for member in _members(annotation)) > 1


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _key_doc(key: str, kind: str | None, field: FieldInfo) -> KeyDoc:
    bounds = [
        f"{sign} {getattr(m, name)}" for m in field.metadata for name, sign in _BOUNDS.items() if hasattr(m, name)
    ]
    type_text = _type_name(field.annotation) + (f" ({', '.join(bounds)})" if bounds else "")
    return KeyDoc(key, kind, type_text, _default(field), _clean(field.description or ""))


def _type_name(annotation: Any) -> str:
    """The annotation the way a recipe writes the value."""
    annotation = _strip(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if _is_choice(annotation):
        return "section, by kind"
    if _is_union(annotation):
        return " | ".join(dict.fromkeys(_type_name(arg) for arg in args))
    if origin is Literal:
        return " | ".join(str(arg) for arg in args)
    if origin is tuple:
        return f"[{', '.join(_type_name(arg) for arg in args)}]"
    if origin is list:
        return "list of sections" if _is_section(args[0]) else f"list of {_type_name(args[0])}"
    if _is_section(annotation):
        return "section"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if _is_choice(field.annotation):  # the kind picks the table of the section's keys
        return f"{{kind: {field.default.kind}}}"
    return _value_text(field.default)


def _value_text(value: Any) -> str:
    """A default as YAML writes it; a section as the keys where it differs from its own table's defaults."""
    if isinstance(value, BaseModel):
        fields = type(value).model_fields
        changed = {k: v for k, v in value if v != fields[k].default}
        if not changed:
            return "its keys' defaults"
        return "{" + ", ".join(f"{k}: {_value_text(v).strip(chr(34))}" for k, v in changed.items()) + "}"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple | list):
        return f"[{', '.join(_value_text(v) for v in value)}]"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def _clean(text: str) -> str:
    """Docstring text on one line."""
    return " ".join(text.split())


def markdown() -> str:
    """The page docs/recipe-reference.md."""
    lines = [
        "# Recipe reference",
        "",
        f"Generated from the recipe schema by `{REGENERATE}`; do not edit it by hand (a test",
        "compares it with the schema). A recipe sets any of these keys, section by section, over the defaults; the",
        "command line overrides any of them as `section.key=value`. `./launch.sh --explain KEY` prints one key.",
        "",
        "Where a section is chosen by `kind` (`objective`, `objective.mask`), each kind has its own table: its keys",
        "are valid only with that kind. A `data.train[]` key belongs to each source of a training mixture.",
    ]
    for table in tables():
        lines += ["", f"## {table.title}", ""]
        if table.intro:
            lines += [table.intro, ""]
        lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        lines += [
            "| " + " | ".join(_cell(text) for text in (f"`{d.key}`", d.type, d.default, d.description)) + " |"
            for d in table.keys
        ]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def explain(key: str) -> str:
    """What `./launch.sh --explain KEY` prints: the key's type, default and description, once per kind that has
    it (and a section's keys). Raises ConfigError for an unknown key, with the closest keys."""
    docs = all_keys()
    wanted = _normalise(key)
    found = [d for d in docs if _normalise(d.key) == wanted]
    if not found:
        raise ConfigError(f"{key}: unknown recipe key{_hint(wanted, docs)}")
    lines = []
    for d in found:
        lines.append(d.key + (f"  ({d.kind})" if d.kind else ""))
        lines += [f"  type:    {d.type}", f"  default: {d.default}"]
        lines += ["  " + line for line in textwrap.wrap(d.description, width=100)]
        inner = dict.fromkeys(k.key for k in docs if k.key.rpartition(".")[0] == d.key)
        if inner:
            lines += textwrap.wrap(
                "keys: " + ", ".join(inner), width=100, initial_indent="  ", subsequent_indent="    "
            )
    return "\n".join(lines)


def _hint(key: str, docs: list[KeyDoc]) -> str:
    """The closest keys of the same section (a typo in the last part), else of the whole recipe."""
    keys = list(dict.fromkeys(_normalise(d.key) for d in docs))
    parent, _, leaf = key.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
    if siblings:
        return close_matches(leaf, siblings, n=2, prefix=f"{parent}." if parent else "")
    return close_matches(key, keys, n=3)


def _normalise(key: str) -> str:
    """A key as the reference spells it, from `data.train[2].weight` or `data.train.weight`."""
    return re.sub(r"\[\d*\]", "", key.strip())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.stdout.write(markdown())
        return 0
    if argv[0] != "--explain" or len(argv) != 2:
        print(f"usage: {REGENERATE}\n       python -m core.recipe.reference --explain KEY", file=sys.stderr)
        return 2
    try:
        print(explain(argv[1]))
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(quiet_on_closed_pipe(main))  # `| head -1`: no traceback, exit code 141 (core/compat/closed_pipe.py)
