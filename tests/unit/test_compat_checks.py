"""core/compat/checks.py: the helpers the DeepSpeed, timm and webdataset shims share, and each library's release
series agreeing with its pin in pyproject.toml."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from core.compat import accelerate as acc_compat
from core.compat import deepspeed as ds_compat
from core.compat import timm as timm_compat
from core.compat import webdataset as wds_compat
from core.compat.checks import CompatError, Library, code_words, run_checks

REPO = Path(__file__).resolve().parents[2]
# accelerate is optional (the dev extra): its pin is checked where it is installed
OPTIONAL = [acc_compat.ACCELERATE] if importlib.util.find_spec("accelerate") else []
LIBRARIES = [ds_compat.DEEPSPEED, timm_compat.TIMM, wds_compat.WEBDATASET, *OPTIONAL]


class _ProbeError(CompatError):
    pass


def _probe(version: str) -> Library:
    """A library whose `__version__` is `version`: this test module, stood in for one."""
    globals()["__version__"] = version
    return Library("Probe", __name__, "tests.probe_shims", "1.4", "probe>=1.4,<1.5", _ProbeError)


@pytest.mark.parametrize("library", LIBRARIES, ids=lambda lib: lib.module)
def test_each_librarys_pin_in_pyproject_is_its_checked_series(library):
    assert f'"{library.pin}",' in (REPO / "pyproject.toml").read_text()  # a line of its dependencies
    major, minor = library.written_for.split(".")
    assert library.pin.startswith(f"{library.module}>={library.written_for}")
    assert library.pin.endswith(f",<{major}.{int(minor) + 1}")
    assert library.is_checked()  # the installed release is the one the shims were checked against


@pytest.mark.parametrize(("version", "checked"), [("1.4", True), ("1.4.7", True), ("1.40.0", False), ("1.5.0", False)])
def test_a_release_is_checked_only_inside_the_written_for_series(version, checked):
    assert _probe(version).is_checked() is checked


def test_a_failed_check_is_one_line_naming_patch_problem_version_and_pin():
    with pytest.raises(_ProbeError) as caught:
        _probe("1.5.0").check_version("some_patch")
    message = str(caught.value)
    assert "\n" not in message
    for phrase in ("Probe patch 'some_patch'", "tests.probe_shims", "installed", "1.5.0", "probe>=1.4,<1.5"):
        assert phrase in message


def test_attr_method_and_module_name_what_is_missing():
    library = _probe("1.4")

    def reads(self, x):
        return self.weight * x + len("flag")

    owner = type("Owner", (), {"reads": reads})
    assert library.method("p", owner, "reads", params=("self", "x"), uses=("weight",), strings=("flag",)) is reads
    for call, phrase in (
        (lambda: library.attr("p", owner, "gone"), "Owner.gone is missing"),
        (lambda: library.method("p", owner, "reads", params=("self",)), "now takes (self, x)"),
        (lambda: library.method("p", owner, "reads", uses=("bias",)), "no longer uses bias"),
        (lambda: library.module_named("p", "no_such_module_here"), "module no_such_module_here cannot be imported"),
    ):
        with pytest.raises(_ProbeError, match=phrase.replace("(", r"\(").replace(")", r"\)")):
            call()


def test_run_checks_runs_the_named_checks_or_all_in_order():
    ran = []
    checks = {"a": ran.append, "b": ran.append}
    run_checks(checks, ())
    run_checks(checks, ("b",))
    assert ran == ["a", "b", "b"]
    assert code_words(lambda: print("x"))[0] == {"print"}
