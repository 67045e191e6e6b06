"""The real datasets the tests read, and the mark that skips a test on a machine without them."""

from __future__ import annotations

import pytest

from data.fashion_mnist import find

FASHION_MNIST = find().path
"""The folder of Fashion-MNIST's four IDX files where this machine has one (never downloaded: data/fashion_mnist.py
looks in $MIMPIPE_FASHION_MNIST, Debian's package and the download cache); None without."""

needs_fashion_mnist = pytest.mark.skipif(
    FASHION_MNIST is None,
    reason="needs Fashion-MNIST: `apt-get install -y dataset-fashion-mnist`, or `make quickstart-data` (downloads)",
)
