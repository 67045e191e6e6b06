"""Push an export folder to the Hugging Face Hub (`--push-to-hub ORG/NAME [--private]` of `python -m pretrain export`
and `python -m finetune convert`).

Everything that can fail is checked before any work (`check_push`): the repo id, offline mode (`HF_HUB_OFFLINE`), a
token (huggingface_hub's: `HF_TOKEN`, else the one `hf auth login` / `huggingface-cli login` stored), and the endpoint
(`HF_ENDPOINT`, else the Hub) answering `whoami` for that token within `PROBE_TIMEOUT_S`. Then, once the export is
written, `push_export` points its card at the repo and uploads the folder with `HfApi.upload_folder`, after creating
the repo if it does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, get_session, get_token
from huggingface_hub.errors import HTTPError
from huggingface_hub.utils import build_hf_headers

from core.export.card import set_card_location
from core.export.hub import HUB_PREFIX, check_repo_id, first_line, hub_endpoint, hub_offline

PROBE_TIMEOUT_S = 10.0
"""How long `check_push` waits for the endpoint to answer before calling it unreachable."""


@dataclass(frozen=True)
class PushTarget:
    """A repo `check_push` found reachable with a token, and who the token belongs to."""

    repo_id: str
    user: str
    endpoint: str
    token: str


def check_push(repo_id: str) -> PushTarget:
    """Everything a push needs, checked before any work: a valid repo id, not offline, a token, and the endpoint
    answering within `PROBE_TIMEOUT_S` with the token's user.

    Raises:
        ValueError: One line saying which of these failed and what to do.
    """
    check_repo_id(repo_id, what=f"--push-to-hub {repo_id}")
    if hub_offline():
        raise ValueError(
            "--push-to-hub: HF_HUB_OFFLINE is set (no network): unset it to push, or push the export later with "
            f"`hf upload {repo_id} EXPORT_DIR`"
        )
    token = get_token()
    if not token:
        raise ValueError(
            "--push-to-hub: no Hugging Face token: set HF_TOKEN or log in with `hf auth login` (huggingface-cli login)"
        )
    endpoint = hub_endpoint()
    try:
        response = get_session().get(
            f"{endpoint}/api/whoami-v2", headers=build_hf_headers(token=token), timeout=PROBE_TIMEOUT_S
        )
    except (HTTPError, OSError) as err:  # no route, no DNS, refused, timed out
        raise ValueError(f"--push-to-hub: cannot reach {endpoint} ({first_line(err)})") from None
    if response.status_code == 401:
        raise ValueError(f"--push-to-hub: {endpoint} refused the token (401): log in again with `hf auth login`")
    if response.status_code != 200:
        raise ValueError(f"--push-to-hub: {endpoint}/api/whoami-v2 answered {response.status_code}")
    return PushTarget(repo_id=repo_id, user=str(response.json().get("name", "?")), endpoint=endpoint, token=token)


def push_export(export_dir: Path, target: PushTarget, *, private: bool, message: str) -> str:
    """Point the export's card at the repo (`hf-hub:ORG/NAME`), create the repo if it does not exist (`private` then
    says its visibility; an existing repo keeps its own) and upload the folder. Returns the repo's address.

    Raises:
        ValueError: One line: the upload failed (the export stays written; the line says how to push it again).
    """
    set_card_location(export_dir, f"{HUB_PREFIX}{target.repo_id}")
    api = HfApi(endpoint=target.endpoint, token=target.token)
    try:
        url = api.create_repo(target.repo_id, private=private, exist_ok=True)
        api.upload_folder(repo_id=target.repo_id, folder_path=export_dir, commit_message=message)
    except (HTTPError, OSError, ValueError) as err:  # refused, cut off, the card's metadata rejected
        raise ValueError(
            f"--push-to-hub: {export_dir} is written, but its upload to {target.repo_id} failed ({first_line(err)}); "
            f"push it again with `hf upload {target.repo_id} {export_dir}`"
        ) from None
    return str(url)
