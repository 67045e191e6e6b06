"""The checks every compat shim runs on the internals of the library it reaches into (DeepSpeed, timm, webdataset).

A shim relies on names its library does not promise to keep: a release that renamed or reshaped one would make the
shim silently do nothing or fail deep inside a run. Each compat module describes its library once as a `Library`
and checks each internal it relies on with the helpers here; a failed check raises the library's `CompatError`
subclass in one line naming the patch, what changed, the installed version and the pin to install.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NoReturn


class CompatError(RuntimeError):
    """An internal that a shim relies on has changed in the installed release of its library."""


@dataclass(frozen=True)
class Library:
    """A library whose internals shims rely on, and how a failed check names it."""

    name: str
    """As messages write it: "DeepSpeed", "timm", "webdataset"."""
    module: str
    """Its import name, whose `__version__` is the installed release."""
    shims: str
    """The module holding the shims (its `__name__`), named in every message."""
    written_for: str
    """The release series the shims were written and checked against, e.g. "0.19": any 0.19.x."""
    pin: str
    """pyproject's requirement for it, which covers exactly `written_for`'s series."""
    error: type[CompatError]

    def version(self) -> str:
        """The installed release (imports the library if nothing has yet)."""
        module = sys.modules.get(self.module) or importlib.import_module(self.module)
        return str(getattr(module, "__version__", "(unknown)"))

    def is_checked(self) -> bool:
        """Whether the installed release belongs to the series the shims were checked against."""
        version = self.version()
        return version == self.written_for or version.startswith(self.written_for + ".")

    def fail(self, patch: str, problem: str) -> NoReturn:
        """Raise the library's error, in one line naming `patch`, `problem`, the installed version and the pin."""
        raise self.error(
            f"{self.name} patch {patch!r} ({self.shims}): {problem}, in the installed {self.module} {self.version()}. "
            f"The patch was written for {self.name} {self.written_for}: adapt it to this release, or install "
            f"{self.pin}."
        )

    def check_version(self, patch: str) -> None:
        """Fail unless the installed release is one `patch` was checked against."""
        if not self.is_checked():
            self.fail(patch, f"not checked against this release (only {self.written_for}.x)")

    def module_named(self, patch: str, name: str):
        """The module `name`, imported; fails when it cannot be."""
        try:
            return importlib.import_module(name)
        except ImportError as err:
            self.fail(patch, f"module {name} cannot be imported ({err})")

    def attr(self, patch: str, owner, name: str):
        """`owner.name`; fails when it is missing."""
        if not hasattr(owner, name):
            self.fail(patch, f"{getattr(owner, '__name__', owner)}.{name} is missing")
        return getattr(owner, name)

    def method(
        self,
        patch: str,
        owner,
        name: str,
        *,
        params: tuple[str, ...] | None = None,
        uses: Iterable[str] = (),
        strings: Iterable[str] = (),
    ) -> Callable:
        """`owner.name`, unwrapped, after checking that it is a function with exactly `params` (when given) whose
        code mentions every name in `uses` and every string constant in `strings`."""
        fn = self.attr(patch, owner, name)
        where = f"{getattr(owner, '__name__', owner)}.{name}"
        if not callable(fn) or not inspect.isfunction(inner := unwrapped(fn)):
            self.fail(patch, f"{where} is no longer a Python function")
        if params is not None and tuple(inspect.signature(inner).parameters) != params:
            found = ", ".join(inspect.signature(inner).parameters)
            self.fail(patch, f"{where} now takes ({found}), where the patch expects ({', '.join(params)})")
        names, consts = code_words(inner)
        for expected, seen, what in ((uses, names, "uses"), (strings, consts, "has the string")):
            missing = sorted(set(expected) - seen)
            if missing:
                self.fail(patch, f"{where} no longer {what} {', '.join(missing)}")
        return inner


def run_checks(checks: Mapping[str, Callable[[str], None]], names: Iterable[str]) -> None:
    """Run the checks of the named patches (all of `checks` when `names` is empty), each given its patch's name;
    the first that fails raises."""
    for name in tuple(names) or checks:
        checks[name](name)


def unwrapped(fn: Callable) -> Callable:
    """The function under its decorators, with or without functools.wraps: DeepSpeed's `instrument_w_nvtx` returns a
    `(*args, **kwargs)` wrapper that holds the function only in its closure."""
    fn = inspect.unwrap(fn)
    while inspect.isfunction(fn) and fn.__closure__ and fn.__code__.co_flags & inspect.CO_VARARGS:
        inner = [cell.cell_contents for cell in fn.__closure__ if inspect.isfunction(cell.cell_contents)]
        if len(inner) != 1:
            break
        fn = inspect.unwrap(inner[0])
    return fn


def code_words(fn: Callable) -> tuple[set[str], set[str]]:
    """(names, strings) that `fn`'s code and the functions nested in it mention: attributes and globals it reads or
    assigns, and its string constants (dictionary keys, command-line flags, list literals of strings)."""
    names: set[str] = set()
    strings: set[str] = set()
    code = getattr(fn, "__code__", None)
    codes = [code] if code is not None else []
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        consts = list(code.co_consts)
        consts += [c for const in code.co_consts if isinstance(const, tuple) for c in const]  # keyword names
        strings.update(c for c in consts if isinstance(c, str))
        codes.extend(c for c in consts if inspect.iscode(c))
    return names, strings
