"""Shared test setup.

The CUDA tests run on the numba-cuda simulator unless FASTANNEAL_REAL_CUDA=1 is set (on a
machine with a GPU). The variable must be set before anything imports numba.cuda.
"""
import os
from pathlib import Path

if os.environ.get("FASTANNEAL_REAL_CUDA") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "clinc150.parquet"


@pytest.fixture
def rng(request):
    """A fresh generator per test; the seed is printed on failure via the test id hash."""
    seed = np.random.SeedSequence().entropy % (2 ** 32)
    request.node.user_properties.append(("seed", seed))
    print(f"rng seed = {seed}")
    return np.random.default_rng(seed)
