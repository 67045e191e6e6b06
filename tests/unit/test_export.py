"""Encoder export: timm loads it offline with identical keys, tensors and features; the write is atomic; every file is
readable as a new file under the umask is."""

import json
import os
import stat

import pytest
import safetensors.torch
import timm
import torch

from core.export import folder as export_module
from core.export.folder import export_model
from tests.helpers.models import WIDE, wide_vit

ARGS = {**WIDE, "mlp_ratio": 4.0}  # the export's model_args for wide_vit()


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def export_tiny(model, out_dir, step: int = 100, **kwargs):
    args = {**ARGS, "global_pool": model.global_pool}
    manifest = {"method": "mae", "step": step, "recipe": "recipes/mae_tiny.yaml", "pooling": model.global_pool}
    return export_model(model, out_dir, model_args=args, manifest=manifest, **kwargs)


@pytest.mark.parametrize("global_pool", ["token", "avg"])
def test_timm_loads_export_offline_with_identical_keys_tensors_and_features(tmp_path, global_pool):
    model = wide_vit(global_pool=global_pool)
    out_dir = export_tiny(model, tmp_path / "export", data_config={"mean": (0.2, 0.3, 0.4), "std": (0.5, 0.6, 0.7)})

    loaded = timm.create_model(f"local-dir:{out_dir}", pretrained=True).eval()

    source_state, loaded_state = model.state_dict(), loaded.state_dict()
    assert list(loaded_state) == list(source_state)
    for key, tensor in source_state.items():
        assert torch.equal(loaded_state[key], tensor), key
    images = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        assert torch.equal(loaded.forward_features(images), model.forward_features(images))
    config = json.loads((out_dir / "config.json").read_text())
    assert config["num_classes"] == 0
    expected_args = {**ARGS, "img_size": [28, 28], "in_chans": 3, "num_classes": 0, "global_pool": global_pool}
    assert config["model_args"] == expected_args
    assert config["pretrained_cfg"]["mean"] == [0.2, 0.3, 0.4]
    assert config["pretrained_cfg"]["std"] == [0.5, 0.6, 0.7]
    assert config["pretrained_cfg"]["input_size"] == [3, 28, 28]
    assert config["pretrained_cfg"]["interpolation"] == "bicubic"


def test_manifest_holds_callers_facts_and_export_facts(tmp_path):
    model = wide_vit()
    out_dir = export_tiny(model, tmp_path / "export", step=123)

    manifest = json.loads((out_dir / "mimpipe.json").read_text())
    assert manifest["method"] == "mae" and manifest["step"] == 123 and manifest["pooling"] == "token"
    assert manifest["num_tensors"] == len(model.state_dict())
    assert manifest["num_params"] == sum(p.numel() for p in model.state_dict().values())
    assert manifest["versions"] == {
        "torch": torch.__version__,
        "timm": timm.__version__,
        "safetensors": safetensors.__version__,
    }
    assert manifest["created"].endswith("+00:00")


def test_drop_path_rate_is_not_exported(tmp_path):
    model = wide_vit(drop_path_rate=0.1)
    args = {**ARGS, "drop_path_rate": 0.1, "proj_drop_rate": 0.1}
    out_dir = export_model(model, tmp_path / "export", model_args=args, manifest={})

    config = json.loads((out_dir / "config.json").read_text())
    assert not any("drop" in key for key in config["model_args"])


def test_bf16_and_shared_storage_tensors_are_written_as_given(tmp_path):
    model = wide_vit().to(torch.bfloat16)
    # Parameters as views into one flat buffer, as an optimizer's flat partition leaves them, and one tied pair.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    offset = 0
    for param in model.parameters():
        param.data = flat[offset : offset + param.numel()].view_as(param)
        offset += param.numel()
    model.blocks[1].norm1.weight = model.blocks[0].norm1.weight
    with pytest.raises(RuntimeError, match="share memory"):  # what a plain save does
        safetensors.torch.save_file(model.state_dict(), tmp_path / "plain.safetensors")

    out_dir = export_tiny(model, tmp_path / "export")

    written = safetensors.torch.load_file(out_dir / "model.safetensors")
    assert sorted(written) == sorted(model.state_dict())
    for key, tensor in model.state_dict().items():
        assert written[key].dtype == torch.bfloat16 and torch.equal(written[key], tensor), key
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_file_of_an_export_has_the_mode_of_a_new_file_under_the_umask(tmp_path, umask):
    """safetensors writes through a private temporary file (0600): on a shared file system nobody else could load the
    weights. Every file gets what a plain new file gets (0644 under umask 022), whoever wrote it."""

    def private(path):  # a writer that keeps its file to itself, as tempfile.mkstemp does
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))

    extra = {"seg_head.safetensors": lambda path: safetensors.torch.save_file({"w": torch.zeros(2)}, path),
             "notes.txt": private}  # fmt: skip
    old = os.umask(umask)
    try:
        out_dir = export_tiny(wide_vit(), tmp_path / "export", extra_files=extra)
        export_tiny(wide_vit(seed=1), out_dir, extra_files=extra)  # a re-export, swapped in over the first
    finally:
        os.umask(old)

    modes = {p.name: stat.S_IMODE(os.stat(p).st_mode) for p in out_dir.iterdir()}
    names = ["README.md", "config.json", "mimpipe.json", "model.safetensors", "notes.txt", "seg_head.safetensors"]
    assert modes == dict.fromkeys(names, 0o666 & ~umask)
    assert stat.S_IMODE(os.stat(out_dir).st_mode) == 0o777 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # the mode probe is not left behind


def test_failure_mid_write_keeps_the_previous_export(tmp_path, monkeypatch):
    first = wide_vit(seed=1)
    out_dir = export_tiny(first, tmp_path / "export", step=1)

    def write_half_then_crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(export_module.safetensors.torch, "save_file", write_half_then_crash)
    with pytest.raises(OSError, match="disk full"):
        export_tiny(wide_vit(seed=2), out_dir, step=2)
    monkeypatch.undo()

    assert json.loads((out_dir / "mimpipe.json").read_text())["step"] == 1
    written = safetensors.torch.load_file(out_dir / "model.safetensors")
    assert all(torch.equal(written[k], v) for k, v in first.state_dict().items())
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temporary folder left behind


def test_reexport_replaces_the_previous_export(tmp_path):
    out_dir = export_tiny(wide_vit(seed=1), tmp_path / "export", step=1)
    second = wide_vit(seed=2)

    export_tiny(second, out_dir, step=2)

    assert json.loads((out_dir / "mimpipe.json").read_text())["step"] == 2
    written = safetensors.torch.load_file(out_dir / "model.safetensors")
    assert all(torch.equal(written[k], v) for k, v in second.state_dict().items())
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_refuses_to_replace_a_folder_that_is_not_an_export(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("{}\n")

    with pytest.raises(ValueError, match="refusing to replace"):
        export_tiny(wide_vit(), run_dir)
    assert (run_dir / "metrics.jsonl").read_text() == "{}\n"


@pytest.mark.parametrize(
    ("model_args", "manifest", "match"),
    [
        ({**ARGS, "num_heads": 2}, {}, "num_heads: config builds 2 vs model 4"),
        ({**ARGS, "depth": 3}, {}, "blocks.2.norm1.weight: config builds"),
        (ARGS, {"versions": "mine"}, "reserved"),
        (ARGS, {"when": object()}, "not JSON-serialisable"),
    ],
)
def test_bad_arguments_are_value_errors_and_write_nothing(tmp_path, model_args, manifest, match):
    with pytest.raises(ValueError, match=match):
        export_model(wide_vit(), tmp_path / "export", model_args=model_args, manifest=manifest)
    assert list(tmp_path.iterdir()) == []
