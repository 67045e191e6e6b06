"""A stand-in for the Hugging Face Hub's HTTP endpoints, on 127.0.0.1, for tests that push without a network.

It answers what `HfApi.whoami`, `create_repo` and `upload_folder` ask (whoami-v2, repos/create, validate-yaml,
preupload, commit), records every request as (method, path), and keeps the files each commit carried (huggingface_hub
sends small files base64-encoded inside the commit's NDJSON: the preupload answer makes every file "regular", so no LFS
or Xet upload is asked for). validate-yaml checks a README's front matter the way the Hub's schema types it (strings
where strings go, lists of strings for tags and datasets, a known pipeline tag) and answers 400 with the errors
otherwise. `HF_ENDPOINT=server.endpoint` points huggingface_hub at it.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from huggingface_hub.repocard import RepoCard

TOKEN = "hf_fake_token_for_tests"
PIPELINE_TAGS = ("image-classification", "image-feature-extraction", "image-segmentation")
"""The Hub's pipeline tags a vision card of ours may use (the Hub knows many more)."""


def metadata_errors(readme: str) -> list[str]:
    """What the Hub's YAML validation would object to in a README's front matter (a subset of its schema)."""
    try:
        meta = RepoCard(readme, ignore_metadata_errors=False).data.to_dict()
    except Exception as err:  # the front matter is not YAML, or not a mapping
        return [f"front matter: {err}"]
    errors = [f"{key} must be a string" for key in ("library_name", "license", "base_model") if key in meta
              and not isinstance(meta[key], str)]  # fmt: skip
    for key in ("tags", "datasets"):
        if key in meta and not (isinstance(meta[key], list) and all(isinstance(v, str) for v in meta[key])):
            errors.append(f"{key} must be a list of strings")
    if meta.get("pipeline_tag") not in (None, *PIPELINE_TAGS):
        errors.append(f"pipeline_tag {meta['pipeline_tag']!r} is not a known task")
    return errors


class FakeHub:
    """Run as a context manager: `with FakeHub() as hub: ... hub.requests, hub.files`. `reject_card`: a message with
    which validate-yaml refuses every card (as the Hub refuses invalid metadata)."""

    def __init__(self, token: str = TOKEN, reject_card: str | None = None):
        self.token, self.reject_card = token, reject_card
        self.requests: list[tuple[str, str]] = []
        self.files: dict[str, bytes] = {}
        self.commits: list[dict] = []
        self.created: list[dict] = []
        self.validated: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                hub.requests.append(("GET", self.path))
                if self.path == "/api/whoami-v2":
                    if self.headers.get("authorization") != f"Bearer {hub.token}":
                        return self._reply(401, {"error": "Invalid credentials in Authorization header"})
                    return self._reply(200, {"name": "tester", "type": "user", "auth": {"type": "access_token"}})
                self._reply(404, {"error": f"no {self.path}"})

            def do_POST(self):
                hub.requests.append(("POST", self.path))
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.path == "/api/repos/create":
                    hub.created.append(json.loads(body))
                    repo = f"{hub.created[-1]['organization']}/{hub.created[-1]['name']}"
                    return self._reply(200, {"url": f"{hub.endpoint}/{repo}"})
                if self.path == "/api/validate-yaml":
                    hub.validated.append(json.loads(body)["content"])
                    errors = metadata_errors(hub.validated[-1]) + ([hub.reject_card] if hub.reject_card else [])
                    return self._reply(400 if errors else 200, {"errors": [{"message": e} for e in errors]})
                if self.path.endswith("/preupload/main"):
                    files = json.loads(body)["files"]
                    modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                    return self._reply(200, {"files": modes})
                if self.path.endswith("/commit/main"):  # /api/models/ORG/NAME/commit/main
                    self._commit(body)
                    repo = "/".join(self.path.split("/")[3:5])
                    return self._reply(
                        200, {"commitUrl": f"{hub.endpoint}/{repo}/commit/{'1' * 40}", "commitOid": "1" * 40}
                    )
                self._reply(404, {"error": f"no {self.path}"})

            def _commit(self, body: bytes) -> None:
                lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                hub.commits.append(lines[0]["value"])  # the header: summary, description
                for line in lines[1:]:
                    if line["key"] == "file":
                        hub.files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])

            def _reply(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
