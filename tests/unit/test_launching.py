"""tests/launching.py pins every test run to its device: the recipes its helpers build say `engine.device: cpu`,
`write_recipe` and `launch` refuse one that leaves the device to the host, and the processes get the DeepSpeed
accelerator of the recipe's device. On a GPU host `make test` then runs what CI runs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from core.recipe.config import load_config
from tests.launching import (
    finetune_recipe,
    launch,
    launch_env,
    pinned_device,
    pretrain_recipe,
    run_in_session,
    wait_gone,
    write_recipe,
)

SHARDS = {"train": Path("/shards/train"), "val": Path("/shards/val")}


@pytest.mark.parametrize(
    "recipe",
    [
        pretrain_recipe(SHARDS, Path("/runs/a")),
        pretrain_recipe(SHARDS, Path("/runs/a"), engine={"zero_stage": 3, "precision": "fp16"}),
        finetune_recipe(SHARDS, Path("/runs/b"), Path("/runs/a/export")),
        finetune_recipe(SHARDS, Path("/runs/b"), Path("/runs/a/export"), zero_stage=2, compile=True),
    ],
    ids=["pretrain", "pretrain-engine-overrides", "finetune", "finetune-engine-overrides"],
)
def test_the_helpers_recipes_pin_the_cpu_and_load_with_it(recipe, tmp_path):
    path = write_recipe(tmp_path / "tiny.yaml", recipe)
    assert yaml.safe_load(path.read_text())["engine"]["device"] == "cpu"
    assert load_config(path).engine.device == "cpu"
    assert pinned_device(path) == "cpu"


def test_a_test_that_is_about_cuda_names_it():
    recipe = pretrain_recipe(SHARDS, Path("/runs/a"), engine={"device": "cuda", "precision": "bf16"})
    assert recipe["engine"] == {"device": "cuda", "zero_stage": 2, "precision": "bf16"}


@pytest.mark.parametrize("engine", [{"zero_stage": 2}, {"device": "auto"}, None], ids=["unset", "auto", "no-engine"])
def test_write_recipe_refuses_a_recipe_that_leaves_the_device_to_the_host(engine, tmp_path):
    recipe = {"stage": "pretrain", "run_dir": "/runs/a", **({"engine": engine} if engine is not None else {})}
    with pytest.raises(ValueError, match=r"tiny\.yaml: engine\.device is .*pins it to 'cpu'"):
        write_recipe(tmp_path / "tiny.yaml", recipe)
    assert not (tmp_path / "tiny.yaml").exists()


def test_the_last_device_override_wins_and_auto_is_refused(tmp_path):
    path = write_recipe(tmp_path / "tiny.yaml", pretrain_recipe(SHARDS, tmp_path / "run"))
    assert pinned_device(path, ["engine.device=cuda"]) == "cuda"
    assert pinned_device(path, ["engine.device=cuda", "engine.zero_stage=1", "engine.device=cpu"]) == "cpu"
    with pytest.raises(ValueError, match="engine.device is 'auto'"):
        pinned_device(path, ["engine.device=auto"])


def test_launch_refuses_an_unpinned_recipe_before_starting_anything(tmp_path):
    """A recipe written some other way (a published one, a copied config) must be pinned on the command line."""
    path = tmp_path / "published.yaml"
    path.write_text(yaml.safe_dump({"stage": "pretrain", "run_dir": str(tmp_path / "run")}))
    with pytest.raises(ValueError, match="published.yaml: engine.device is None"):
        launch(path)
    assert not (tmp_path / "run").exists()


def test_the_processes_get_the_accelerator_of_the_device(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # what a GPU host's user may have set
    assert launch_env(nproc=1)["DS_ACCELERATOR"] == "cpu"
    assert launch_env(nproc=1, device="cuda")["DS_ACCELERATOR"] == "cuda"


def test_a_timed_out_run_is_killed_with_everything_it_started():
    """`launch` and `torchrun` run their command through `run_in_session`: on timeout the whole process group goes,
    here a shell and the `sleep` it left in the background (as torchrun leaves its ranks)."""
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        run_in_session(["sh", "-c", "sleep 300 & echo $!; sleep 300"], timeout=1)
    background = int(expired.value.stdout.split()[0])
    assert wait_gone([background]) == set()
