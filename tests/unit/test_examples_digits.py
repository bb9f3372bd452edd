"""The digits example reads scikit-learn's CSV itself: the same data `load_digits` returns, without its import."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from gossamer.examples import digits


def test_load_equals_scikit_learns_load_digits() -> None:
    from sklearn.datasets import load_digits

    pixels, labels = digits.load()
    bunch = load_digits()
    assert pixels.shape == (1797, 64) and labels.dtype == np.int64
    np.testing.assert_array_equal(pixels, bunch.data)
    np.testing.assert_array_equal(labels, bunch.target)


def test_building_the_data_does_not_import_scikit_learn() -> None:
    script = "import sys; from gossamer.examples import digits; digits.data(); print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
