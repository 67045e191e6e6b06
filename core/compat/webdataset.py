"""Every place the data pipeline relies on webdataset internals, each a named check that `install()` runs at import.

webdataset's public API opens shard URLs but offers no way to add a URL scheme or to learn why a download failed.
The pipeline reaches past it in two places, and a release that changed either would make the patch silently do
nothing: a registered scheme that gopen no longer consults, or a curl failure reported as an opaque error. So
`install()` first checks that each internal still behaves the way the code here expects, by running it on stand-in
shards, and otherwise stops with a `WebDatasetCompatError` naming the patch, what changed and the installed version.

Patches (`PATCHES`, by name):
    gopen_schemes  object-store schemes (s3://, az://, gcs://, memory://) registered in
                   `webdataset.gopen.gopen_schemes`, the table gopen looks a URL's handler up in
    curl_errors    http(s):// shards are fetched with `curl -f`; why one failed is read from curl's exit status, in
                   the text of gopen's IOError or from the still-running `Pipe` webdataset appends to the error
    open_streams   a shard's stream is opened here (`open_shard`) and its tar read by `tar_samples` through
                   `webdataset.tariterators` (tar_file_expander, group_by_keys), so that the reader of a hung shard
                   holds the stream (a `Pipe`'s process) it must stop (data/shard_read.py)
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import subprocess
import tarfile
from collections.abc import Callable, Iterator, MutableMapping
from types import SimpleNamespace
from typing import Any

from core.compat.checks import CompatError, Library, code_words, run_checks

WRITTEN_FOR = "1.0"
"""The webdataset release series the patches were written against (checked on 1.0.2; pyproject's pin covers exactly
it)."""

FSSPEC_SCHEMES = ("s3", "s3a", "az", "abfs", "gcs", "memory")
"""Object stores reached through fsspec (s3fs, adlfs, gcsfs installed separately); `memory://` serves tests."""

# What curl's exit status means when webdataset's gopen fetches an http(s) shard with `curl -f`.
_CURL_EXITS = {
    6: "the host name does not resolve",
    7: "nothing accepts connections at that host and port",
    22: "the server answered with an HTTP error (404: no such shard there; 403: no access)",
    28: "the transfer timed out",
    35: "the TLS handshake failed",
    56: "the connection broke while receiving",
}
_PROBE_SCHEME = "mimpipe-wds-check"
_PROBE_STATUS = 22


class WebDatasetCompatError(CompatError):
    """The installed webdataset no longer has an internal that a patch in this module relies on."""


WEBDATASET = Library("webdataset", "webdataset", __name__, WRITTEN_FOR, "webdataset>=1.0,<1.1", WebDatasetCompatError)


class MissingFilesystemError(RuntimeError):
    """A shard URL's object store needs an fsspec package that is not installed: no retry can help."""


def expand_urls(spec: str) -> list[str]:
    """webdataset's expansion of a shard string: `::`-separated parts, `${NAME}` from `$WDS_NAME`, brace ranges.
    webdataset is imported here, not before: its package imports torch (seconds for launch.sh's check)."""
    return importlib.import_module("webdataset.shardlists").expand_urls(spec)


def open_shard(url: str) -> Any:
    """A readable stream of the shard at `url` (a file, a `Pipe` around a command or curl, an fsspec file)."""
    return _gopen().gopen(url, "rb")


def tar_samples(url: str, stream: Any) -> Iterator[dict[str, Any]]:
    """The raw samples (fields of bytes, `__key__`, `__url__`) of the tar `stream` opened from `url`; errors are
    raised as webdataset raises them (see `why_unreadable`)."""
    tariterators = importlib.import_module("webdataset.tariterators")
    return tariterators.group_by_keys(tariterators.tar_file_expander([{"url": url, "stream": stream}]))


def why_unreadable(exn: Exception) -> str:
    """Why a shard could not be read: in words when curl fetched it or a `pipe:` command failed, else the error's
    type and own message.

    webdataset reports a failed curl or command either with its exit status or, when it read the empty stream before
    the process exited, as an 'empty file' that carries the still-running pipe: then the status is waited for.
    """
    pipe = next((a for a in exn.args if hasattr(a, "proc")), None)
    status, curl = None, pipe is not None and "curl" in str(getattr(pipe, "args", ""))
    if pipe is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            status = pipe.proc.wait(timeout=60)
        if status in getattr(pipe, "ignore_status", [0]):  # e.g. 141: SIGPIPE, the reader closed the stream first
            status = None
    elif found := re.search(r"\['curl'.*exit (\d+)", str(exn)):
        status, curl = int(found[1]), True
    if not status:
        return _own_message(exn)
    if not curl:
        return f"the command exited with status {status}"
    return f"{_CURL_EXITS.get(status, 'curl failed')} (curl exit {status})"


def _own_message(exn: Exception) -> str:
    """`exn` as "Type: message", without the stream and URL webdataset appends to the arguments of an error raised
    while reading a tar; a `pipe:` command's failure in words."""
    text = str(exn)
    if len(exn.args) > 1 and isinstance(exn.args[0], str):
        text = re.sub(r" @ <.*>$", "", exn.args[0], flags=re.DOTALL)  # webdataset: "message @ <stream>"
    if found := re.search(r"\): exit (-?\d+) \(read\)", text):  # gopen's Pipe: "((cmd,), {...}): exit N (read)"
        return f"the command exited with status {found[1]}"
    return f"{type(exn).__name__}: {text}"


def gopen_fsspec(url: str, mode: str = "rb", bufsize: int = 8192):
    """Opens a shard URL with fsspec, for the object stores webdataset's gopen has no handler for."""
    import fsspec

    try:
        return fsspec.open(url, mode).open()
    except ImportError as exn:  # fsspec knows the protocol, its implementation (e.g. s3fs) is not installed
        raise MissingFilesystemError(f"cannot open shard {url}: {exn} (for s3://: pip install 'mimpipe[s3]')") from exn


def install() -> None:
    """Check every patch, then register `FSSPEC_SCHEMES` (where webdataset has no handler of its own).

    Raises:
        WebDatasetCompatError: At the first patch whose internal has changed.
    """
    check()
    schemes = _gopen().gopen_schemes
    for scheme in FSSPEC_SCHEMES:
        schemes.setdefault(scheme, gopen_fsspec)


def check(*names: str) -> None:
    """Run the checks of the named patches (default: all); raises WebDatasetCompatError at the first that fails."""
    run_checks(PATCHES, names)


def _gopen():
    return importlib.import_module("webdataset.gopen")


def _tar(files: dict[str, bytes]) -> bytes:
    """An uncompressed tar of `files` (name -> content), as a shard is."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _read_probe(patch: str, open_stream: Callable[[], Any]) -> list[dict[str, Any]]:
    """The samples `open_shard` and `tar_samples` (what the pipeline reads shards with) read from a URL of a scheme
    registered in gopen_schemes whose handler returns `open_stream()`; the scheme is removed again after."""
    schemes = WEBDATASET.attr(patch, _gopen(), "gopen_schemes")
    if not isinstance(schemes, MutableMapping):
        WEBDATASET.fail(patch, f"webdataset.gopen.gopen_schemes is a {type(schemes).__name__}, no longer a dict")
    schemes[_PROBE_SCHEME] = lambda url, mode="rb", bufsize=8192, **kw: open_stream()
    url = f"{_PROBE_SCHEME}://shard.tar"
    try:
        return list(tar_samples(url, open_shard(url)))
    finally:
        del schemes[_PROBE_SCHEME]


def _check_gopen_schemes(patch: str) -> None:
    try:
        samples = _read_probe(patch, lambda: io.BytesIO(_tar({"probe.txt": b"ok"})))
    except WebDatasetCompatError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure means the lookup changed
        WEBDATASET.fail(patch, f"a shard URL of a scheme registered in gopen_schemes does not open ({err!r})")
    if [s.get("txt") for s in samples] != [b"ok"]:
        WEBDATASET.fail(patch, f"a shard URL of a scheme registered in gopen_schemes reads as {samples!r}")


class _ExitedCurl:
    """A stand-in for webdataset's `Pipe` around a curl that wrote nothing and exits with `_PROBE_STATUS`."""

    args = ((["curl", "-f", f"http://{_PROBE_SCHEME}/shard.tar"],), {})
    proc = SimpleNamespace(wait=lambda timeout=None: _PROBE_STATUS)

    def read(self, size: int = -1) -> bytes:
        return b""


def _check_curl_errors(patch: str) -> None:
    gopen = _gopen()
    for scheme in ("http", "https"):
        handler = WEBDATASET.attr(patch, gopen, "gopen_schemes").get(scheme)
        if not {"curl", "-f"} <= code_words(handler)[1]:
            WEBDATASET.fail(patch, f"{scheme}:// shards are no longer fetched with `curl -f` ({handler!r})")
    pipe_class = WEBDATASET.attr(patch, gopen, "Pipe")

    def exited_pipe():  # a real process named curl (/bin/sh), which has exited when the reader starts
        pipe = pipe_class(["curl", "-c", f"exit {_PROBE_STATUS}"], mode="rb", executable="/bin/sh")
        pipe.proc.wait()
        return pipe

    # Both ways a failed curl reaches the pipeline: gopen's Pipe raising with the exit status in its text, and an
    # empty stream, read before curl exited, that webdataset adds to the error.
    stand_ins = {"gopen's Pipe": exited_pipe, "a curl that wrote nothing": _ExitedCurl}
    for what, open_stream in stand_ins.items():
        try:
            _read_probe(patch, open_stream)
            reason = "no error"
        except WebDatasetCompatError:
            raise
        except Exception as err:  # noqa: BLE001 - the error is what is checked
            reason = why_unreadable(err)
        if not reason.endswith(f"(curl exit {_PROBE_STATUS})"):
            WEBDATASET.fail(patch, f"curl exiting with {_PROBE_STATUS} through {what} is reported as {reason!r}")


def _check_open_streams(patch: str) -> None:
    tariterators = importlib.import_module("webdataset.tariterators")
    for name in ("tar_file_expander", "group_by_keys"):
        WEBDATASET.attr(patch, tariterators, name)
    files = {"a.jpg": b"1", "a.cls": b"2", "b.jpg": b"3"}
    try:
        samples = list(tar_samples("probe.tar", io.BytesIO(_tar(files))))
    except Exception as err:  # noqa: BLE001 - any failure means the functions changed
        WEBDATASET.fail(
            patch, f"an opened tar stream does not read through tar_file_expander and group_by_keys ({err!r})"
        )
    expected = [{"__key__": "a", "__url__": "probe.tar", "jpg": b"1", "cls": b"2"}]
    expected.append({"__key__": "b", "__url__": "probe.tar", "jpg": b"3"})
    if samples != expected:
        WEBDATASET.fail(patch, f"a tar stream read through tar_file_expander and group_by_keys gives {samples!r}")


PATCHES: dict[str, Callable[[str], None]] = {
    "gopen_schemes": _check_gopen_schemes,
    "curl_errors": _check_curl_errors,
    "open_streams": _check_open_streams,
}
