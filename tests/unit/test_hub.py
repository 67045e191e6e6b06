"""The Hugging Face Hub without a network: `--push-to-hub` against a local stand-in for the Hub's endpoints
(tests/helpers/fake_hub.py: the requests that arrive and the files committed), its one-line refusals before any work,
and `model.init: hf-hub:ORG/NAME` read from a Hub cache laid out as huggingface_hub lays it out, offline, with a
missing entry refused by the pre-flight in one line."""

import hashlib
import os
from pathlib import Path

import pytest
import safetensors.torch
import timm
import torch
import yaml
from huggingface_hub import ModelCard, constants

from core.entry.launch_check import main as launch_check
from core.export.card import CARD_NAME
from core.export.folder import export_model
from core.export.handoff import load_encoder, read_pooling_hint
from core.models.build import model_args
from data.__main__ import main as data_main
from finetune.convert import main as convert_main
from pretrain.export import main as export_main
from tests.helpers.fake_hub import TOKEN, FakeHub
from tests.helpers.models import tiny_vit
from tests.launching import TINY_MODEL

REPO = "org/tiny-mae"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """No token, no saved login, online; each test sets what it needs (huggingface_hub reads some of these once, at
    import: its constants are set too)."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no_saved_token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return monkeypatch


def offline_cache(monkeypatch, cache: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # what timm's own Hub loading reads
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))


def populate_hub_cache(cache: Path, repo_id: str, folder: Path, commit: str = COMMIT) -> Path:
    """Lay `folder`'s files out as huggingface_hub caches a download of `repo_id` at `commit`: blobs named by their
    hash, the snapshot's files links to them, refs/main naming the commit. Returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot, blobs = repo / "snapshots" / commit, repo / "blobs"
    for path in (snapshot, blobs, repo / "refs"):
        path.mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def tiny_export(path: Path, **manifest) -> Path:
    model = tiny_vit(global_pool="avg")
    return export_model(model, path, model_args=model_args(model), manifest={"method": "mae", **manifest})


def test_convert_pushes_the_export_with_its_card(hub_env, tmp_path):
    source = tmp_path / "timm.safetensors"
    safetensors.torch.save_file(tiny_vit().state_dict(), source)
    with FakeHub() as hub:
        hub_env.setenv("HF_ENDPOINT", hub.endpoint)
        hub_env.setenv("HF_TOKEN", TOKEN)
        code = convert_main([str(source), str(tmp_path / "export"), "--num-heads", "2", "--push-to-hub", REPO])

    assert code == 0
    api = f"/api/models/{REPO}"
    assert hub.requests == [
        ("GET", "/api/whoami-v2"),  # checked before the conversion
        ("POST", "/api/repos/create"),
        ("POST", "/api/validate-yaml"),  # the card's metadata, as the Hub validates it
        ("POST", f"{api}/preupload/main"),
        ("POST", f"{api}/commit/main"),
    ]
    assert hub.created == [{"name": "tiny-mae", "organization": "org", "visibility": "public"}]
    written = {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()}
    assert hub.files == written and sorted(written) == [CARD_NAME, "config.json", "mimpipe.json", "model.safetensors"]
    card = ModelCard(hub.files[CARD_NAME].decode())
    assert f'timm.create_model("hf-hub:{REPO}", pretrained=True)' in card.text
    assert hub.commits[0]["summary"].startswith("mimpipe convert: timm from ")


def test_private_push_creates_a_private_repo(hub_env, tmp_path):
    export = tiny_export(tmp_path / "export")
    with FakeHub() as hub:
        hub_env.setenv("HF_ENDPOINT", hub.endpoint)
        hub_env.setenv("HF_TOKEN", TOKEN)
        assert convert_main([str(export), str(tmp_path / "again"), "--push-to-hub", REPO, "--private"]) == 0
    assert hub.created[0]["visibility"] == "private"


def test_a_failed_upload_is_one_line_and_leaves_the_export(hub_env, tmp_path, capsys):
    export = tiny_export(tmp_path / "export")
    with FakeHub(reject_card='"license" must be one of [apache-2.0, ...]') as hub:
        hub_env.setenv("HF_ENDPOINT", hub.endpoint)
        hub_env.setenv("HF_TOKEN", TOKEN)
        code = convert_main([str(export), str(tmp_path / "out"), "--push-to-hub", REPO])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{tmp_path / 'out'} is written, but its upload to {REPO} failed (" in err
    assert f"`hf upload {REPO} {tmp_path / 'out'}`" in err and (tmp_path / "out" / CARD_NAME).is_file()
    assert hub.files == {}


def no_token(env, hub):
    return "no Hugging Face token: set HF_TOKEN or log in with `hf auth login`"


def offline(env, hub):
    env.setenv("HF_TOKEN", TOKEN)
    env.setenv("HF_HUB_OFFLINE", "1")
    return "HF_HUB_OFFLINE is set (no network)"


def unreachable(env, hub):
    env.setenv("HF_TOKEN", TOKEN)
    env.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard: nothing listens
    return "cannot reach http://127.0.0.1:9 ("


def refused_token(env, hub):
    env.setenv("HF_TOKEN", "hf_wrong")
    return "refused the token (401)"


def bad_repo_id(env, hub):
    env.setenv("HF_TOKEN", TOKEN)
    return "not a Hub repo id ORG/NAME"


@pytest.mark.parametrize("case", [no_token, offline, unreachable, refused_token, bad_repo_id])
@pytest.mark.parametrize("command", ["convert", "export"])
def test_push_fails_in_one_line_before_any_work(hub_env, tmp_path, capsys, case, command):
    with FakeHub() as hub:
        hub_env.setenv("HF_ENDPOINT", hub.endpoint)
        words = case(hub_env, hub)
        repo = "org/a/b" if case is bad_repo_id else REPO
        # The source does not exist: any work before the check would fail on it first.
        if command == "convert":
            code = convert_main([str(tmp_path / "missing.pth"), str(tmp_path / "out"), "--push-to-hub", repo])
        else:
            with pytest.raises(SystemExit) as exit_info:
                export_main([str(tmp_path / "no_run"), "--push-to-hub", repo])
            code = exit_info.value.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert words in err and "missing.pth" not in err and "checkpoint" not in err, err
    assert not (tmp_path / "out").exists()
    assert [r for r in hub.requests if r[1] != "/api/whoami-v2"] == []


def test_private_needs_a_repo(capsys, tmp_path):
    with pytest.raises(SystemExit):
        convert_main([str(tmp_path / "a"), str(tmp_path / "b"), "--private"])
    assert "--private needs --push-to-hub ORG/NAME" in capsys.readouterr().err


def test_hf_hub_init_loads_from_the_offline_cache(hub_env, tmp_path):
    source = tiny_export(tmp_path / "export", pooling_hint="avg")
    populate_hub_cache(tmp_path / "cache", REPO, source)
    offline_cache(hub_env, tmp_path / "cache")

    target = tiny_vit(seed=3, global_pool="avg", patch_size=8, num_classes=5)  # another patch size and a head
    report = load_encoder(target, f"hf-hub:{REPO}")
    assert report.checkpoint_format == "mimpipe-export" and report.manifest["pooling_hint"] == "avg"
    assert report.resized and report.notes[0].startswith(f"hf-hub:{REPO} from the Hugging Face cache:")
    assert read_pooling_hint(f"hf-hub:{REPO}@{COMMIT}") == "avg"
    # timm's own Hub loading reads the same cache entry
    via_timm = timm.create_model(f"hf-hub:{REPO}", pretrained=True)
    source_state = timm.create_model(f"local-dir:{source}", pretrained=True).state_dict()
    assert all(torch.equal(via_timm.state_dict()[k], v) for k, v in source_state.items())

    with pytest.raises(ValueError, match=r"^hf-hub:org/other: config\.json is not in the Hugging Face cache") as info:
        load_encoder(target, "hf-hub:org/other")
    assert str(tmp_path / "cache") in str(info.value) and "\n" not in str(info.value)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "train"
    args = ["--num-samples", "32", "--image-size", "16", "--num-classes", "4", "--shard-size", "16"]
    data_main(["write", "--source", "synthetic", "--out", str(out), *args])
    return out


@pytest.mark.parametrize("stage", ["finetune", "pretrain"])
def test_preflight_passes_a_cached_repo_and_refuses_a_missing_one_in_one_line(hub_env, tmp_path, capsys, shards, stage):
    populate_hub_cache(tmp_path / "cache", REPO, tiny_export(tmp_path / "export"))
    offline_cache(hub_env, tmp_path / "cache")
    recipe = {
        "stage": stage,
        "run_dir": str(tmp_path / "run"),
        "model": TINY_MODEL,
        "data": {"train": str(shards), "global_batch_size": 8},
        "schedule": {"steps": 4},
        **({"objective": {"kind": "classification"}} if stage == "finetune" else {}),
        **({"eval": {"knn": {"enabled": False}, "features": {"enabled": False}}} if stage == "pretrain" else {}),
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))

    def check(init: str) -> tuple[int, list[str], str]:
        code = launch_check([str(tmp_path / "recipe.yaml"), f"model.init={init}", "--nproc-per-node", "1"])
        out = capsys.readouterr()
        return code, [line for line in out.err.splitlines() if line.startswith("launch.sh:")], out.out + out.err

    code, lines, printed = check(f"hf-hub:{REPO}")
    assert code == 0 and lines == [], printed
    passed = {"finetune": "model.init: mimpipe-export, ViT 32 wide", "pretrain": f"model.init: hf-hub:{REPO} in"}
    assert passed[stage] in printed, printed
    # the repo's config.json completes the recipe as a local export's does: here only its normalisation is left out
    assert f"[mimpipe] model from hf-hub:{REPO}: mean/std (config.json)\n" in printed, printed
    code, lines, printed = check("hf-hub:org/absent")
    assert code == 2 and len(lines) == 1, printed
    assert lines[0].startswith("launch.sh: model.init: hf-hub:org/absent: config.json is not in the Hugging Face cache")
    assert "HF_HUB_OFFLINE=1" in lines[0] and "hf download org/absent" in lines[0] and "Traceback" not in printed
