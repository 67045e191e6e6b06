"""benchmarks/encoders_table.py (`make encoders-table`): the commands it runs and the table it assembles from the
runs' metrics.jsonl (fake ones here; the real runs take ~1.5 h)."""

import json
from pathlib import Path

import pytest
import torch

from benchmarks.encoders_table import ROWS, main, plan
from core.models.build import build_model
from core.recipe.config import load_config
from finetune.checkpoints import Checkpoint
from finetune.handoff import fit_problems

REPO = Path(__file__).resolve().parents[2]
BY_NAME = {row.name: row for row in ROWS}


def config_of(command: list[str]):
    """The resolved recipe a `./launch.sh RECIPE overrides...` command runs."""
    launcher, recipe, *overrides = command
    assert launcher == "./launch.sh"
    return load_config(REPO / recipe, overrides)


def test_simmim_rows_fine_tune_from_their_own_pretraining_export(tmp_path):
    pretrain, finetune = plan(BY_NAME["t2t_simmim"], tmp_path)
    assert pretrain[1] == "recipes/quickstart_simmim.yaml" and finetune[1] == "recipes/quickstart_t2t.yaml"
    assert f"run_dir={tmp_path / 't2t_simmim_pretrain'}" in pretrain
    assert f"model.init={tmp_path / 't2t_simmim_pretrain' / 'export'}" in finetune
    (scratch,) = plan(BY_NAME["vit"], tmp_path)
    assert config_of(scratch).model.init is None and config_of(scratch).run_dir == str(tmp_path / "vit")


@pytest.mark.parametrize("name", [row.name for row in ROWS])
def test_every_command_is_a_valid_recipe_and_a_simmim_encoder_fits_its_fine_tuning(name, tmp_path):
    commands = plan(BY_NAME[name], tmp_path)
    configs = [config_of(command) for command in commands]
    assert [c.stage for c in configs] == ["pretrain"] * (len(configs) - 1) + ["finetune"]
    assert configs[-1].schedule.steps == 1000 and configs[-1].data.global_batch_size == 128  # the quickstart budget
    if len(configs) == 2:
        pretrain, finetune = configs
        assert pretrain.objective.kind == "simmim" and pretrain.model.arch == finetune.model.arch
        with torch.device("meta"):
            encoder = build_model(pretrain).state_dict()
            classifier = build_model(finetune, num_classes=10)
        export = Checkpoint(state=dict(encoder), source=tmp_path / "export", format="mimpipe-export")
        assert fit_problems(classifier, export) == []  # the hand-off's own check (launch.sh's pre-flight runs it)
        same_grid = all(classifier.state_dict()[k].shape == v.shape for k, v in encoder.items() if "pos_embed" in k)
        assert same_grid  # pretrained at the fine-tuning grid: nothing to resize


def write_run(run_dir: Path, start: float, lines: list[dict]) -> None:
    run_dir.mkdir(parents=True)
    text = "".join(json.dumps({"time": start + 60 * minute, **values}) + "\n" for minute, values in lines)
    (run_dir / "metrics.jsonl").write_text(text)


def test_table_assembled_from_the_runs_metrics(tmp_path, capsys):
    runs, out = tmp_path / "runs", tmp_path / "encoders.md"
    vit = [(0, {"step": 1, "train/loss": 2.3}), (3, {"step": 1000, "val/top1": 0.84}), (6.5, {"step": 2000})]
    vit.append((6.5, {"step": 2000, "val/top1": 0.8312}))  # the last evaluation is not the best one
    write_run(runs / "vit", 1000.0, vit)
    write_run(runs / "t2t_simmim_pretrain", 0.0, [(0, {"step": 1, "train/loss": 1.0}), (5.25, {"step": 700})])
    t2t = [(0, {"step": 1}), (2, {"step": 1000, "val/top1": 0.8}), (8, {"step": 2000, "val/top1": 0.86})]
    write_run(runs / "t2t_simmim", 0.0, t2t)

    assert main(["--assemble-only", "--runs-dir", str(runs), "--out", str(out)]) == 0

    rows = {line.split(" | ")[-1].strip("` |"): line for line in out.read_text().splitlines() if line.endswith("` |")}
    assert set(rows) == {row.name for row in ROWS}
    assert "| 0.8312 (step 2000) | 0.8400 (step 1000) | 6.5 |" in rows["vit"]
    assert "| SimMIM (quickstart budget) | 0.8600 (step 2000) | 0.8600 (step 2000) | 5.2 + 8.0 |" in rows["t2t_simmim"]
    assert "| none (from scratch) | not run |" in rows["hybrid"]
    assert "| not run |" in rows["hybrid_simmim"] and "[encoders] written to" in capsys.readouterr().out


def test_unknown_rows_are_refused_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--rows", "vit,deit", "--dry-run"])
    assert exit_info.value.code == 2
    assert "unknown rows ['deit']; known: vit, hybrid, t2t, vt, hybrid_simmim, t2t_simmim" in capsys.readouterr().err
