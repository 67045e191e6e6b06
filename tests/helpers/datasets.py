"""The real datasets the tests read, and the mark that skips a test on a machine without them."""

from __future__ import annotations

import os

import pytest

from data.sources import FASHION_MNIST_DIR

needs_fashion_mnist = pytest.mark.skipif(
    not os.path.isfile(os.path.join(FASHION_MNIST_DIR, "t10k-images-idx3-ubyte.gz")),
    reason="needs `apt-get install -y dataset-fashion-mnist`",
)
