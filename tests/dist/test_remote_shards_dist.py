"""Recipe: tiny MAE (tests/launching.py `pretrain_recipe`) with data.train = a list of http:// URLs, 2 steps through
./launch.sh with 2 gloo processes; the shards are served from 127.0.0.1 by a thread of the test process."""

from __future__ import annotations

import functools
import math
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from data.specs import read_index
from tests.launching import launch, losses, pretrain_recipe, write_recipe

pytestmark = pytest.mark.dist


def test_pretraining_streams_shards_over_http(shards, tmp_path):
    requested: list[str] = []

    class Handler(SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args) -> None:  # record requests instead of printing them
            requested.append(self.path)

    handler = functools.partial(Handler, directory=str(shards["train"]))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        urls = [f"{base}/{s['name']}" for s in read_index(str(shards["train"]))["shards"]]
        recipe = pretrain_recipe(
            shards,
            tmp_path / "run",
            data={"train": urls},
            schedule={"steps": 2, "warmup_steps": 1},
            checkpoint={"every_steps": 2},
            logging={"every_steps": 1, "image_every_steps": 0},
        )
        proc = launch(write_recipe(tmp_path / "tiny_mae_http.yaml", recipe))
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stdout[-4000:]
    steps = losses(tmp_path / "run")
    assert sorted(steps) == [1, 2] and all(math.isfinite(v) for v in steps.values())
    assert {path.lstrip("/") for path in requested} <= {url.rsplit("/", 1)[1] for url in urls} and requested
