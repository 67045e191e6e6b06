"""Remote shards: `http://` URLs (webdataset's gopen runs curl) and `pipe:` commands stream the same samples as local
files. The `shards` fixture's train directory is served from 127.0.0.1 by a thread of this process."""

from __future__ import annotations

import contextlib
import functools
import itertools
import socket
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from data.pipeline import make_eval_loader, make_train_loader
from data.shard_read import ShardReadError, ShardReadPolicy
from data.specs import read_index, resolve_shards
from data.transforms import eval_transform, pretrain_transform

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
RETRY = ShardReadPolicy(retries=1, backoff_s=0.0)


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # one line per request would drown the test output
        pass


@contextlib.contextmanager
def serve_directory(directory: Path) -> Iterator[str]:
    """Serve `directory` over HTTP on 127.0.0.1 from a background thread; yields the base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def base_url(shards) -> Iterator[str]:
    with serve_directory(shards["train"]) as url:
        yield url


def _brace_pattern(base_url: str, train_dir: Path) -> str:
    """`BASE/train-{000000..000007}.tar`, checked against the shard names in index.json."""
    names = [s["name"] for s in read_index(str(train_dir))["shards"]]
    assert names == [f"train-{i:06d}.tar" for i in range(len(names))]
    return f"{base_url}/train-{{000000..{len(names) - 1:06d}}}.tar"


def _train_batches(shards: list[str], num_workers: int, num_batches: int = 6) -> list[dict]:
    loader = make_train_loader(
        shards,
        transform=pretrain_transform(16, MEAN, STD),
        batch_size=16,
        seed=3,
        rank=0,
        world_size=1,
        num_workers=num_workers,
        shuffle_buffer=32,
        resampled=False,
    )
    return list(itertools.islice(iter(loader), num_batches))


def _eval_batches(shards: list[str], num_workers: int) -> list[dict]:
    transform = eval_transform(16, MEAN, STD, crop_pct=1.0)
    loader = make_eval_loader(
        shards, transform=transform, batch_size=50, rank=0, world_size=1, num_workers=num_workers, read_policy=RETRY
    )
    return list(loader)


def _assert_same(a: list[dict], b: list[dict]) -> None:
    assert [x["key"] for x in a] == [y["key"] for y in b]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x["image"], y["image"], rtol=0, atol=0)
        assert torch.equal(x["label"], y["label"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_http_shards_give_the_same_batches_as_local_files(shards, base_url, num_workers):
    local = resolve_shards(str(shards["train"]))
    urls = resolve_shards(_brace_pattern(base_url, shards["train"]))
    assert urls == [f"{base_url}/{Path(p).name}" for p in local]
    _assert_same(_train_batches(urls, num_workers), _train_batches(local, num_workers))
    over_http = _eval_batches(urls, num_workers)
    _assert_same(over_http, _eval_batches(local, num_workers))
    assert sum(len(b["key"]) for b in over_http) == 512  # one full pass, every sample once


def test_pipe_command_shards_stream_like_local_files(shards):
    local = resolve_shards(str(shards["train"]))
    piped = [f"pipe:cat {p}" for p in local]
    assert resolve_shards(piped) == piped
    _assert_same(_eval_batches(piped, num_workers=2), _eval_batches(local, num_workers=2))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_missing_url_raises_naming_the_url_and_why(base_url, num_workers):
    url = f"{base_url}/train-999999.tar"  # the server answers 404; curl -f exits 22 with nothing read
    with pytest.raises(ShardReadError, match=f"cannot read shard {url}: the server answered with an HTTP error .404"):
        _eval_batches([url], num_workers)


def test_a_port_nobody_listens_on_is_named(base_url):
    with socket.socket() as sock:  # a free port, closed again: nothing accepts connections there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/train-000000.tar"
    with pytest.raises(ShardReadError, match=f"cannot read shard {url}: nothing accepts connections .*curl exit 7"):
        _eval_batches([url], 0)


def test_fsspec_urls_stream_like_local_files(shards):
    """Schemes webdataset has no handler for (s3://, az://, ...) open through fsspec; its in-process `memory://`
    filesystem stands in for an object store."""
    import fsspec

    local = resolve_shards(str(shards["train"]))
    memory = fsspec.filesystem("memory")
    urls = []
    for path in local:
        url = f"memory://mimpipe-test/{Path(path).name}"
        memory.pipe(url, Path(path).read_bytes())
        urls.append(url)
    assert resolve_shards(urls) == urls
    _assert_same(_eval_batches(urls, num_workers=0), _eval_batches(local, num_workers=0))
    _assert_same(_train_batches(urls, num_workers=0), _train_batches(local, num_workers=0))


def test_an_object_store_without_its_fsspec_package_names_the_url_and_the_fix(monkeypatch):
    import fsspec

    tries = []

    def missing(url, mode):
        tries.append(url)
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec, "open", missing)
    fix = r"pip install 'mimpipe\[s3\]'"
    with pytest.raises(ShardReadError, match=rf"cannot read shard s3://bucket/train-000000.tar.*{fix}"):
        _eval_batches(["s3://bucket/train-000000.tar"], num_workers=0)
    assert len(tries) == 1  # no retry can install a package
