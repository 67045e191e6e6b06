"""The untyped layers of a recipe, merged into one plain tree: the YAML file over its optional single `base:`
parent, then the command-line `section.key=value` overrides (values parsed as YAML). core/recipe/config.py validates
the tree against the schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from core.recipe.errors import ConfigError


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys (`engine.zero_stage`); lists stay values."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def recipe_tree(recipe: str | Path | None, overrides: list[str] = ()) -> dict[str, Any]:
    """The recipe (with its parent) and the overrides as one tree; {} plus the overrides without a recipe."""
    tree: dict[str, Any] = {}
    if recipe is not None:
        path = Path(recipe)
        tree = _read_yaml(path)
        if "base" in tree:
            parent = path.parent / str(tree.pop("base"))
            parent_tree = _read_yaml(parent)
            if "base" in parent_tree:
                raise ConfigError(f"{path}: base recipe {parent} has its own base; at most one parent is allowed")
            tree = _merge(parent_tree, tree)
    for override in overrides:
        _set_dotted(tree, override)
    return tree


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"recipe not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of sections")
    return data


def _merge(base: dict, top: dict) -> dict:
    """`top` over `base`, section by section; a section whose `kind` changes is replaced, not merged (the keys of
    the old kind would not fit the new one)."""
    out = dict(base)
    for key, value in top.items():
        below = out.get(key)
        same_kind = (
            isinstance(below, dict)
            and isinstance(value, dict)
            and value.get("kind", below.get("kind")) == below.get("kind")
        )
        out[key] = _merge(below, value) if same_kind else value
    return out


def _set_dotted(tree: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r} is not of the form section.key=value")
    dotted, raw = override.split("=", 1)
    *parents, leaf = dotted.strip().split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
    node[leaf] = yaml.safe_load(raw)
