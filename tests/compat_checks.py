"""The assertion the compatibility-check tests share (test_ds_compat, test_timm_compat, test_wds_compat): a patch's
check fails with its library's error, naming the patch, the installed version and what changed."""

from collections.abc import Callable

import pytest


def assert_check_fails(check: Callable[[], None], error: type[Exception], *phrases: str) -> None:
    """Asserts `check()` raises `error` with every phrase in its message (the patch's name and the installed
    version among them)."""
    with pytest.raises(error) as caught:
        check()
    message = str(caught.value)
    missing = [phrase for phrase in phrases if phrase not in message]
    assert not missing, f"{missing} not in: {message}"
