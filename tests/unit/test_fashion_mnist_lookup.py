"""Fashion-MNIST on any machine (data/fashion_mnist.py, data/quickstart.py): the sources in order, the download
through torchvision's own code against a local HTTP server that stands in for its mirror (small IDX files generated
here, their MD5s given to torchvision as its resource list), its failures (404, a truncated file, a wrong checksum)
each leading on with a line naming what went wrong and nothing half-written in the cache, and the synthetic fallback
said loudly."""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import threading
from pathlib import Path

import numpy as np
import pytest
from torchvision.datasets import FashionMNIST

from core.recipe.sections import TrainSource
from data import fashion_mnist, quickstart
from data.__main__ import main as data_main
from data.fashion_mnist import FILES, find
from data.quickstart import write_quickstart
from data.specs import is_synthetic, read_index
from tests.unit.test_data_write import _read_tar

SIZES = {"train": 30, "test": 12}


def idx_files(folder: Path) -> dict[str, bytes]:
    """The four gzipped IDX files of a tiny Fashion-MNIST-shaped set, written into `folder`: {name: bytes}."""
    rng, files = np.random.default_rng(0), {}
    for split, (images_name, labels_name) in FILES.items():
        n = SIZES[split]
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        header = (0x803).to_bytes(4, "big") + n.to_bytes(4, "big") + (28).to_bytes(4, "big") * 2
        files[images_name] = gzip.compress(header + images.tobytes(), mtime=0)
        files[labels_name] = gzip.compress(
            (0x801).to_bytes(4, "big") + n.to_bytes(4, "big") + labels.tobytes(), mtime=0
        )
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """A local HTTP server as torchvision's only mirror, serving `tmp_path/served`; torchvision's resources carry the
    generated files' MD5s. No local source holds the files, and downloading is allowed (the tests forbid it)."""
    served = tmp_path / "served"
    files = idx_files(served)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(FashionMNIST, "mirrors", [f"http://127.0.0.1:{server.server_port}/"])
    resources = [(name, hashlib.md5(data).hexdigest()) for name, data in files.items()]
    monkeypatch.setattr(FashionMNIST, "resources", resources)
    monkeypatch.setenv("MIMPIPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(fashion_mnist.OFFLINE, raising=False)
    monkeypatch.delenv(fashion_mnist.ENV, raising=False)
    monkeypatch.setattr(fashion_mnist, "DEBIAN_DIR", str(tmp_path / "no-debian-package"))
    yield served
    server.shutdown()


def _samples(shard: Path) -> list[dict]:
    """The samples of a shard, without where it was read from."""
    return [{k: v for k, v in sample.items() if k != "__url__"} for sample in _read_tar(str(shard))]


def _cache_entries(tmp_path: Path) -> list[str]:
    cache = tmp_path / "cache" / "fashion-mnist"
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*")) if cache.exists() else []


def test_a_download_writes_the_same_shards_as_the_files_at_a_local_path(mirror, tmp_path):
    found = find(download=True)
    assert found.source == "a download into the cache" and Path(found.path) == fashion_mnist.raw_folder()
    assert len(found.tried) == 2 and "Debian's dataset-fashion-mnist" in found.tried[0]  # then the empty cache
    assert sorted(p.name for p in Path(found.path).iterdir()) == sorted(FILES["train"] + FILES["test"])
    assert find().source == "the download cache"  # the next lookup finds the cache, downloads nothing
    for split in ("train", "test"):
        data_main(["write", "--source", "fashion-mnist", "--split", split, "--out", str(tmp_path / "got" / split)])
        data_main(["write", "--source", "fashion-mnist", "--split", split, "--out", str(tmp_path / "want" / split),
                   "--path", str(mirror)])  # fmt: skip
        got, want = (_samples(tmp_path / kind / split / f"{split}-000000.tar") for kind in ("got", "want"))
        assert len(got) == SIZES[split] and got == want  # sample for sample, byte for byte


@pytest.mark.parametrize(
    ("fault", "named"),
    [
        ("missing", "HTTP Error 404"),
        ("truncated", "not found or corrupted"),
        ("checksum", "not found or corrupted"),
    ],
)
def test_a_failed_download_names_what_went_wrong_and_leaves_nothing_in_the_cache(mirror, tmp_path, fault, named):
    name = FILES["test"][0]
    if fault == "missing":
        (mirror / name).unlink()
    elif fault == "truncated":
        (mirror / name).write_bytes((mirror / name).read_bytes()[:100])
    else:
        FashionMNIST.resources = [(n, "0" * 32 if n == name else md5) for n, md5 in FashionMNIST.resources]
    found = find(download=True)
    assert found.path is None and found.tried[-1].startswith(f"download into {fashion_mnist.raw_folder()}: ")
    assert named in found.tried[-1] and name in found.tried[-1]
    assert not any(entry.startswith("FashionMNIST/raw/") for entry in _cache_entries(tmp_path))  # nothing half-done
    assert not any(entry.startswith(".download-") for entry in _cache_entries(tmp_path))


def test_a_named_folder_is_the_one_meant_and_offline_means_no_download(mirror, tmp_path, monkeypatch):
    named = find(str(tmp_path / "elsewhere"), download=True)
    assert named.path is None and named.tried == [f"--path ({tmp_path / 'elsewhere'}): no such folder"]
    monkeypatch.setenv(fashion_mnist.ENV, str(mirror))
    assert find().path == str(mirror) and find().source == "$MIMPIPE_FASHION_MNIST"
    monkeypatch.delenv(fashion_mnist.ENV)
    monkeypatch.setenv(fashion_mnist.OFFLINE, "1")
    offline = find(download=True)
    assert offline.path is None and offline.tried[-1] == "download: $MIMPIPE_OFFLINE is set"
    assert _cache_entries(tmp_path) == []


def test_the_quickstart_falls_back_to_synthetic_images_loudly_then_takes_the_real_set(
    mirror, tmp_path, monkeypatch, capsys
):
    small = {"train": ["--num-samples", "40", "--image-size", "28", "--shard-size", "20"],
             "test": ["--num-samples", "10", "--image-size", "28", "--seed", "1", "--shard-size", "10"]}  # fmt: skip
    monkeypatch.setitem(quickstart.SPLITS, "synthetic", small)
    monkeypatch.setenv(fashion_mnist.OFFLINE, "1")  # no network: every source fails
    out = tmp_path / "shards"
    assert write_quickstart(out, None, data_main) == "synthetic"
    warning = capsys.readouterr().err
    assert "WARNING: Fashion-MNIST was not found and could not be downloaded:" in warning
    assert f"WARNING:   Debian's dataset-fashion-mnist ({fashion_mnist.DEBIAN_DIR}): no such folder" in warning
    assert "WARNING:   download: $MIMPIPE_OFFLINE is set" in warning and "SYNTHETIC images" in warning
    assert (
        read_index(str(out / "train"))["source"] == "synthetic" and read_index(str(out / "train"))["num_samples"] == 40
    )
    monkeypatch.delenv(fashion_mnist.OFFLINE)  # the network is back: the real set replaces the synthetic shards
    assert write_quickstart(out, None, data_main) == "fashion-mnist"
    assert [read_index(str(out / s))["num_samples"] for s in ("train", "test")] == [SIZES["train"], SIZES["test"]]
    assert write_quickstart(out, None, data_main) == "fashion-mnist"  # written already: kept


def test_synthetic_shards_are_told_apart_by_their_index(mirror, tmp_path):
    synthetic, real = tmp_path / "synthetic", tmp_path / "real"
    data_main(["write", "--source", "synthetic", "--num-samples", "8", "--out", str(synthetic), "--shard-size", "4"])
    data_main(["write", "--source", "fashion-mnist", "--split", "test", "--path", str(mirror), "--out", str(real)])
    assert is_synthetic(str(synthetic)) and is_synthetic(str(synthetic / "train-000000.tar"))
    assert not is_synthetic(str(real)) and not is_synthetic("https://example.com/shards/{0..3}.tar")
    mixture = [TrainSource(shards=str(real), weight=3.0), TrainSource(shards=str(synthetic), weight=1.0)]
    assert is_synthetic(mixture) and is_synthetic([source.model_dump() for source in mixture])  # a config.yaml's
    assert not is_synthetic([TrainSource(shards=str(real), weight=1.0)])
