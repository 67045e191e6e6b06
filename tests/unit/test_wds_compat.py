"""core/compat/webdataset.py: every patch's check passes on the installed webdataset, and fails loudly, naming the
patch, what changed and the installed version, when the internal it relies on is missing or behaves otherwise. The
changes are made with monkeypatch on the installed modules, so each case is a webdataset release that differs in exactly
that internal."""

from __future__ import annotations

import importlib
import io

import pytest
import webdataset

from core.compat import webdataset as wds_compat
from core.compat.webdataset import FSSPEC_SCHEMES, PATCHES, WebDatasetCompatError
from tests.compat_checks import assert_check_fails

gopen = importlib.import_module("webdataset.gopen")


def _fails(patch: str, *phrases: str) -> None:
    """Asserts the patch's check raises an error naming the patch, the installed version and each phrase."""
    named = (f"webdataset patch '{patch}'", f"installed webdataset {webdataset.__version__}")
    assert_check_fails(lambda: wds_compat.check(patch), WebDatasetCompatError, *named, *phrases)


@pytest.mark.parametrize("name", sorted(PATCHES))
def test_every_check_passes_on_the_installed_webdataset_and_leaves_no_probe(name):
    before = dict(gopen.gopen_schemes)
    wds_compat.check(name)
    assert gopen.gopen_schemes == before


def test_install_registers_the_object_stores_without_replacing_webdatasets_own(monkeypatch):
    schemes = {"__default__": gopen.gopen_error, "http": gopen.gopen_curl, "https": gopen.gopen_curl, "s3": print}
    monkeypatch.setattr(gopen, "gopen_schemes", schemes)
    wds_compat.install()
    assert schemes["s3"] is print  # a handler already there stays
    assert all(schemes[s] is wds_compat.gopen_fsspec for s in FSSPEC_SCHEMES if s != "s3")
    assert schemes["http"] is gopen.gopen_curl


def test_missing_scheme_table_fails(monkeypatch):
    monkeypatch.delattr(gopen, "gopen_schemes")
    _fails("gopen_schemes", "webdataset.gopen.gopen_schemes is missing")
    _fails("curl_errors", "webdataset.gopen.gopen_schemes is missing")


def test_a_scheme_table_of_another_type_fails(monkeypatch):
    monkeypatch.setattr(gopen, "gopen_schemes", tuple(gopen.gopen_schemes.items()))
    _fails("gopen_schemes", "gopen_schemes is a tuple, no longer a dict")


def test_a_gopen_that_no_longer_consults_the_table_fails(monkeypatch):
    """The registration would then do nothing: an s3:// shard would fail with 'no gopen handler defined'."""
    table = dict(gopen.gopen_schemes)

    def gopen_with_own_table(url, mode="rb", bufsize=8192, **kw):
        scheme = url.split("://")[0]
        return table.get(scheme, gopen.gopen_error)(url, mode, bufsize, **kw)

    monkeypatch.setattr(gopen, "gopen", gopen_with_own_table)
    _fails("gopen_schemes", "does not open", "no gopen handler defined")


def test_http_fetched_without_curl_f_fails(monkeypatch):
    """Without -f curl writes the server's 404 page and exits 0: the exit statuses we name would never come."""

    def gopen_curl_lenient(url, mode="rb", bufsize=8192):
        return gopen.Pipe(["curl", "-s", "-L", url], mode=mode, bufsize=bufsize)

    monkeypatch.setitem(gopen.gopen_schemes, "https", gopen_curl_lenient)
    _fails("curl_errors", "https:// shards are no longer fetched with `curl -f`")


def test_missing_pipe_class_fails(monkeypatch):
    monkeypatch.delattr(gopen, "Pipe")
    _fails("curl_errors", "webdataset.gopen.Pipe is missing")


def _drop_the_stream_from_read_errors(monkeypatch) -> None:
    """A webdataset whose tar reader no longer adds the stream (the curl pipe) to the error it raises."""
    tariterators = importlib.import_module("webdataset.tariterators")
    expand = tariterators.tar_file_expander

    def expander_without_stream(data, handler=None, **kw):
        try:
            yield from expand(data, **kw)
        except Exception as exn:
            raise type(exn)(*[a for a in exn.args if not hasattr(a, "proc")]) from None

    monkeypatch.setattr(tariterators, "tar_file_expander", expander_without_stream)


def test_a_reader_that_drops_the_stream_from_the_error_fails(monkeypatch):
    """The 'empty file' case: the still-running pipe webdataset adds to the error is all that holds curl's status."""
    _drop_the_stream_from_read_errors(monkeypatch)
    _fails("curl_errors", "through a curl that wrote nothing is reported as 'ReadError: empty file'")


def test_a_pipe_error_without_the_exit_status_fails(monkeypatch):
    """With the pipe left out of the error, curl's status can only come from the error's text."""

    def wait_for_child(self):
        self.status = self.proc.wait()
        if self.status != 0:
            raise OSError(f"pipe {self.proc.pid} failed")

    _drop_the_stream_from_read_errors(monkeypatch)
    monkeypatch.setattr(gopen.Pipe, "wait_for_child", wait_for_child)
    _fails("curl_errors", "through gopen's Pipe is reported as 'OSError: pipe")


def test_why_unreadable_names_curls_exit_status_or_passes_the_error_on():
    assert wds_compat.why_unreadable(OSError("(([['curl', '-f', 'http://h/x.tar']], {}): exit 7 (read) {}")) == (
        "nothing accepts connections at that host and port (curl exit 7)"
    )
    assert wds_compat.why_unreadable(OSError("(([['curl', 'x']], {}): exit 99 (read)")) == "curl failed (curl exit 99)"
    not_curl = ValueError("empty file", io.BytesIO(), "http://h/x.tar")  # a stream that is no curl pipe
    assert wds_compat.why_unreadable(not_curl) == "ValueError: empty file"  # the stream and URL webdataset adds: gone
    truncated = OSError("unexpected end of data @ <Pipe (('cat x.tar',), {})>", object(), "pipe:cat x.tar")
    assert wds_compat.why_unreadable(truncated) == "OSError: unexpected end of data"
    failed = OSError("(('exit 3',), {'shell': True, 'bufsize': 8192}): exit 3 (read) {}", object(), "pipe:exit 3")
    assert wds_compat.why_unreadable(failed) == "the command exited with status 3"
    missing = FileNotFoundError(2, "No such file")
    assert wds_compat.why_unreadable(missing) == "FileNotFoundError: [Errno 2] No such file"


def test_a_tar_reader_that_no_longer_groups_files_by_key_fails(monkeypatch):
    """Every file of a tar would arrive as a sample of its own."""
    tariterators = importlib.import_module("webdataset.tariterators")

    def one_sample_per_file(data, **kw):
        for file in data:
            if file:
                yield {"__key__": file["fname"], "__url__": file["__url__"], "data": file["data"]}

    monkeypatch.setattr(tariterators, "group_by_keys", one_sample_per_file)
    _fails("open_streams", "a tar stream read through tar_file_expander and group_by_keys gives")


def test_a_missing_tar_expander_fails(monkeypatch):
    monkeypatch.delattr(importlib.import_module("webdataset.tariterators"), "tar_file_expander")
    _fails("open_streams", "webdataset.tariterators.tar_file_expander is missing")
