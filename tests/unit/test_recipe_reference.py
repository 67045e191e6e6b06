"""The recipe reference: every key described, docs/recipe-reference.md current, `./launch.sh --explain KEY`."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field

from core.recipe.config import Config, ConfigError
from core.recipe.reference import REGENERATE, all_keys, explain, main, markdown, tables
from core.recipe.sections import MAEObjective, Section

ROOT = Path(__file__).resolve().parents[2]


def _sections(cls: type[Section]) -> list[type[Section]]:
    return [cls, *(sub for child in cls.__subclasses__() for sub in _sections(child))]


def test_every_recipe_key_has_a_description():
    missing = [d.key + (f" ({d.kind})" if d.kind else "") for d in all_keys() if not d.description]
    assert not missing, f"recipe keys without a description (write a docstring under the field): {missing}"


def test_every_section_field_has_a_description():
    """Also the fields of sections the reference does not reach (a section added but not yet wired in)."""
    missing = [
        f"{cls.__name__}.{name}"
        for cls in _sections(Section)
        for name, field in cls.model_fields.items()
        if not field.description
    ]
    assert not missing, f"section fields without a description: {missing}"


def test_reference_page_is_current():
    page = (ROOT / "docs" / "recipe-reference.md").read_text()
    assert page == markdown(), f"docs/recipe-reference.md is stale: regenerate it with `{REGENERATE}`"


def test_a_field_without_docstring_is_found():
    class Probe(Section):
        described: int = Field(1, gt=0)
        """Has one."""
        bare: Literal["a", "b"] = "a"

    (table,) = tables(Probe)
    assert [(d.key, d.type, d.default, d.description) for d in table.keys] == [
        ("described", "int (> 0)", "1", "Has one."),
        ("bare", "a | b", '"a"', ""),
    ]


def test_reference_walks_kinds_and_mixture_sources():
    docs = {(d.key, d.kind): d for d in all_keys()}
    mae = docs["objective.mask_ratio", "objective.kind: mae"]
    assert (mae.type, mae.default) == ("float (> 0.0, < 1.0)", "0.75")
    assert docs["objective.mask_ratio", "objective.kind: simmim"].default == "0.6"
    random_mask = docs["objective.mask.ratio", "objective.kind: beit, objective.mask.kind: random"]
    assert random_mask.default == "0.5"
    assert docs["data.train[].shards", None].default == "required"
    assert docs["schedule", None].default == "{steps: 1000}"  # the default section differs from its keys' defaults
    assert docs["objective", None].default == "{kind: mae}"
    # every key of the schema appears: the sections of Config, one table per objective kind
    assert {d.key for d in all_keys() if "." not in d.key} == set(Config.model_fields)


def test_explain_prints_each_kind_with_the_key():
    text = explain("objective.mask_ratio")
    assert "objective.mask_ratio  (objective.kind: mae)\n  type:    float (> 0.0, < 1.0)\n  default: 0.75" in text
    assert "default: 0.6" in text  # simmim's
    assert "data.train[].weight" in explain("data.train[2].weight")  # a list item's index is dropped
    assert "keys: eval.knn.bank.shards, eval.knn.bank.max_samples" in explain("eval.knn.bank")


def test_explain_unknown_key_names_close_matches():
    with pytest.raises(
        ConfigError, match=r"^objective.mask_rato: unknown recipe key \(did you mean 'objective.mask_ratio'"
    ):
        explain("objective.mask_rato")


def test_launch_explain():
    """Through launch.sh, which answers before it looks for GPUs or a recipe."""
    done = subprocess.run(
        [str(ROOT / "launch.sh"), "--explain", "objective.mask_ratio"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    description = " ".join(MAEObjective.model_fields["mask_ratio"].description.split())
    assert description in done.stdout
    assert "default: 0.75" in done.stdout
    assert done.stderr == ""


def test_explain_exit_codes(capsys):
    """What `python -m core.recipe.reference` (and `./launch.sh --explain`, which runs it) prints and returns."""
    assert main(["--explain", "optim.base_lrr"]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", "optim.base_lrr: unknown recipe key (did you mean 'optim.base_lr'?)\n")
    assert main(["--explain"]) == 2
    assert main(["--explain", "optim.base_lr"]) == 0
    assert capsys.readouterr().out.startswith("optim.base_lr\n  type:    float (> 0.0)\n  default: 0.00015\n")
    assert main([]) == 0
    assert capsys.readouterr().out == markdown()
