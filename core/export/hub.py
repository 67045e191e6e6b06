"""The Hugging Face Hub as a source of checkpoints: `hf-hub:ORG/NAME[@REVISION]` (pushing an export: push.py).

Reading goes through the Hub's local cache, the one `timm.create_model("hf-hub:ORG/NAME", pretrained=True)` uses
(`hf_hub_download`, as timm calls it): the repo's config.json and weights, and our manifest when it has one, land in
one snapshot folder, which is then read like any export folder. With `HF_HUB_OFFLINE=1` nothing is downloaded: a file
the cache lacks is an error naming the cache and the command that fills it.

The environment is read when called, not when huggingface_hub was imported, so that `HF_HUB_OFFLINE` and
`HF_ENDPOINT` set by a caller in-process count too.
"""

from __future__ import annotations

import os
from pathlib import Path

import timm
from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
from huggingface_hub.errors import EntryNotFoundError, HFValidationError, HTTPError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id

from core.export.manifest import MANIFEST_NAME

HUB_PREFIX = "hf-hub:"
"""How a checkpoint path names a Hub repo (timm's own prefix): `hf-hub:ORG/NAME`, optionally `@REVISION`."""
HUB_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
"""The weights looked for in a repo, in order (timm's Hugging Face layout)."""
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of a boolean variable


def is_hub_spec(path: object) -> bool:
    """Whether a checkpoint path names a Hub repo (`hf-hub:ORG/NAME[@REVISION]`, also as a `Path`)."""
    return isinstance(path, str | os.PathLike) and str(path).startswith(HUB_PREFIX)


def hub_offline() -> bool:
    """Whether the Hub may not be contacted: `HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) set now or at import."""
    now = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.HF_HUB_OFFLINE or now.upper() in _TRUE


def hub_endpoint() -> str:
    """The Hub's address: `HF_ENDPOINT` as set now, else huggingface_hub's (https://huggingface.co)."""
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def hub_cache() -> str:
    """The Hub cache folder: `HF_HUB_CACHE` as set now, else huggingface_hub's."""
    return os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE


def split_hub_spec(spec: str) -> tuple[str, str | None]:
    """(repo id, revision or None) of `hf-hub:ORG/NAME[@REVISION]`.

    Raises:
        ValueError: Not an `ORG/NAME` repo id.
    """
    repo_id, _, revision = spec.removeprefix(HUB_PREFIX).partition("@")
    check_repo_id(repo_id, what=spec)
    return repo_id, revision or None


def check_repo_id(repo_id: str, *, what: str | None = None) -> None:
    """Raise a one-line ValueError unless `repo_id` is a valid `ORG/NAME` (user or organisation, then the name)."""
    try:
        if repo_id.count("/") != 1:
            raise HFValidationError("it needs exactly one '/'")
        validate_repo_id(repo_id)
    except HFValidationError as err:
        reason = " ".join(str(err).split())
        raise ValueError(f"{what or repo_id}: not a Hub repo id ORG/NAME ({reason})") from None


def hub_folder(spec: str) -> Path:
    """The local snapshot folder of `hf-hub:ORG/NAME[@REVISION]`: config.json and the weights (and mimpipe.json when
    the repo has one), downloaded into the Hub cache unless cached already or offline.

    Raises:
        ValueError: One line: the repo, revision or a file is missing (from the cache when offline, naming the cache
            and how to fill it), or the Hub cannot be reached and nothing is cached.
    """
    repo_id, revision = split_hub_spec(spec)
    offline = hub_offline()
    config = _download(spec, repo_id, "config.json", revision, offline)
    for name in HUB_WEIGHTS:
        if _optional(repo_id, name, revision, offline) is not None:
            break
    else:
        if offline:
            raise ValueError(_not_cached(spec, repo_id, HUB_WEIGHTS[0]))
        where = f"neither in the repo at {hub_endpoint()} nor in the cache {hub_cache()}"
        raise ValueError(f"{spec}: config.json but none of {', '.join(HUB_WEIGHTS)}, {where}")
    _optional(repo_id, MANIFEST_NAME, revision, offline)  # a plain timm repo has none
    return Path(config).parent


def _download(spec: str, repo_id: str, filename: str, revision: str | None, offline: bool) -> str:
    """The cached path of a file the repo must have (downloaded when online)."""
    try:
        return hf_hub_download(
            repo_id, filename, revision=revision, cache_dir=hub_cache(), local_files_only=offline,
            endpoint=hub_endpoint(), library_name="timm", library_version=timm.__version__,
        )  # fmt: skip
    except LocalEntryNotFoundError:  # offline, or online without an answer and without a cached copy
        raise ValueError(_not_cached(spec, repo_id, filename, online=not offline)) from None
    except EntryNotFoundError:
        raise ValueError(f"{spec}: the repo has no {filename}; is it a timm model?") from None
    except (HTTPError, OSError) as err:  # no such repo or revision, gated, refused
        raise ValueError(f"{spec}: cannot fetch {filename} from {hub_endpoint()}: {first_line(err)}") from None


def _optional(repo_id: str, filename: str, revision: str | None, offline: bool) -> str | None:
    """The cached path of a file the repo may lack, or None (offline: when the cache does not hold it)."""
    if offline:
        found = try_to_load_from_cache(repo_id, filename, cache_dir=hub_cache(), revision=revision)
        return found if isinstance(found, str) else None  # a cached "does not exist" is not a str either
    try:
        return hf_hub_download(
            repo_id, filename, revision=revision, cache_dir=hub_cache(), endpoint=hub_endpoint(),
            library_name="timm", library_version=timm.__version__,
        )  # fmt: skip
    except EntryNotFoundError:  # not in the repo; or (LocalEntryNotFoundError) no answer and not cached
        return None
    except (HTTPError, OSError) as err:
        raise ValueError(f"hf-hub:{repo_id}: cannot fetch {filename}: {first_line(err)}") from None


def _not_cached(spec: str, repo_id: str, filename: str, *, online: bool = False) -> str:
    revision = spec.partition("@")[2]
    fetch = f"`hf download {repo_id}" + (f" --revision {revision}`" if revision else "`")
    if online:
        return (
            f"{spec}: {filename} is not in the Hugging Face cache {hub_cache()} and {hub_endpoint()} did not answer; "
            f"fetch it where there is a network with {fetch} (same HF_HUB_CACHE)"
        )
    return (
        f"{spec}: {filename} is not in the Hugging Face cache {hub_cache()} and HF_HUB_OFFLINE=1 forbids downloading "
        f"it; fetch it where there is a network with {fetch} (same HF_HUB_CACHE), or unset HF_HUB_OFFLINE"
    )


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
