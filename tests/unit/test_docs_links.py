"""The fault matrix (docs/faults.md) names tests that exist: a renamed or removed test would leave a promise
that nothing checks."""

import re

from tests.launching import REPO


def test_every_test_the_fault_matrix_names_exists():
    text = (REPO / "docs" / "faults.md").read_text()
    named = re.findall(r"(tests/[\w/]+\.py)::(\w+)", text)
    assert len(named) >= 30
    missing = [
        f"{path}::{name}"
        for path, name in named
        if not (REPO / path).is_file() or not re.search(rf"def {name}\(", (REPO / path).read_text())
    ]
    assert missing == []
