"""Property tests (hypothesis) of the Moments algebra on random splits of random data.

* merge of the records of any split of the rows (empty blocks included) == record of the whole
  (and == the independent reference), norm-wise relative error <= 1e-12 in float64 (only the
  association of the sums differs); ``rows`` and ``nnz`` exactly; ``min_margin`` to 1e-12 of
  the largest distance (a row's GEMM distances may round differently in another block);
* commutativity ``a + b == b + a`` bit for bit (IEEE addition and ``min`` commute);
* associativity ``(a + b) + c == a + (b + c)`` within 1e-12 norm-wise;
* ``Moments.zeros`` is a two-sided identity, bit for bit.

Norm-wise relative error: ``||a - b||_2 / ||b||_2`` over all entries of an array; the scalar
energies (D, T*H, F, J) are taken together as one vector (see ``test_kernels.py``).
"""
import functools
import math
import sys
from pathlib import Path

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

import fastanneal as fa  # noqa: E402
from fastanneal import Moments  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference as ref  # noqa: E402

FIELDS = ref.FIELDS + ("nnz",)
SETTINGS = settings(max_examples=25, deadline=None)   # the conftest profile: reproducible in CI, --fresh-seeds explores


def rel_err(a, b, floor=0.0):
    """``|a - b| / max(|b|, floor)``: ``floor`` keeps a sum that is zero up to entries the
    kernel drops (below eps of a row's leading term) from turning into a relative error of
    1 (a row sitting on its center at low T: d1 = 0, the others' terms ~1e-43)."""
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    nb = max(np.linalg.norm(b), floor)
    d = np.linalg.norm(a - b)
    return d / nb if nb > 0 else d


def energies(m, T):
    return np.array([m["soft_distortion"], T * m["entropy"], m["free_energy"],
                     m["hard_distortion"]])


def as_dict(m):
    return {f: getattr(m, f) for f in FIELDS}


def assert_close(a, b, T, tol=1e-12, exact_extremes=True, dmax=None):
    a = a if isinstance(a, dict) else as_dict(a)
    b = b if isinstance(b, dict) else as_dict(b)
    errs = {f: rel_err(a[f], b[f]) for f in ("N", "S", "hard_counts", "hard_sums", "weight",
                                             "margin_sum")}
    W = float(np.sum(b["weight"]))
    # (floor: the energies of rows that all sit on their centers are sums of tiny terms;
    # each row's entropy, log s - sez / s with s = 1 + e^(-d/T), is exact only to the
    # float64 rounding of s (~1e-16), so T H carries ~1e-16 T per row: a fresh-seed run
    # found 7e-11 relative at the old floor 1e-9, i.e. 1e-21 W (d + T) absolute)
    errs["energies"] = rel_err(energies(a, T), energies(b, T),
                               floor=W * ((dmax or 0.0) + T) * 1e-3)
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, bad
    assert a["rows"] == b["rows"]
    if exact_extremes:
        assert a["nnz"] == b["nnz"]
    if dmax is not None:
        if math.isinf(b["min_margin"]):
            assert a["min_margin"] == math.inf
        else:
            assert abs(a["min_margin"] - b["min_margin"]) <= tol * dmax


@st.composite
def problems(draw):
    seed = draw(st.integers(0, 2 ** 32 - 1))
    n = draw(st.integers(0, 60))
    K = draw(st.integers(1, 6))
    D = draw(st.integers(1, 4))
    resp = draw(st.sampled_from(["softmax", "entmax15", "hard"]))
    metric = draw(st.sampled_from(["euclidean", "cosine"]))
    weighted = draw(st.booleans())
    tmult = draw(st.sampled_from([1e-2, 0.1, 1.0, 100.0]))
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=0, max_size=6)))
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, D)) + rng.normal(size=D) * 2
    X[:, 0] += 0.5 * np.sign(X[:, 0]) + (X[:, 0] == 0)     # no zero rows (cosine)
    C = rng.normal(size=(K, D)) * 2
    C[:, 0] += 0.5 * np.sign(C[:, 0]) + (C[:, 0] == 0)
    w = rng.uniform(0.0, 2.0, n) if weighted else None
    dist = ref.distances(X, C, metric) if n else np.ones((1, 1))
    T = tmult * max(float(np.median(dist)), 1e-3)
    bounds = [0] + cuts + [n]
    blocks = list(zip(bounds[:-1], bounds[1:]))
    return X, C, w, T, resp, metric, blocks


def record(X, C, w, T, resp, metric, a=None, b=None):
    sl = slice(a, b)
    return fa.moments(X[sl], C, T, weights=None if w is None else w[sl], metric=metric,
                      responsibilities=resp)


@SETTINGS
@given(problems())
def test_merge_of_any_split_equals_whole(p):
    X, C, w, T, resp, metric, blocks = p
    whole = record(X, C, w, T, resp, metric)
    parts = [record(X, C, w, T, resp, metric, a, b) for a, b in blocks]
    merged = functools.reduce(Moments.merge, parts)
    dmax = float(ref.distances(X, C, metric).max()) if len(X) else 1.0
    assert_close(merged, whole, T, dmax=dmax)
    assert_close(sum(parts), whole, T, dmax=dmax)
    want = ref.moments(X, C, T, weights=w, metric=metric, responsibilities=resp)
    want["nnz"] = merged.nnz
    assert_close(merged, want, T, exact_extremes=False, dmax=dmax)


@SETTINGS
@given(problems(), st.randoms(use_true_random=False))
def test_merge_commutative_and_associative(p, rnd):
    X, C, w, T, resp, metric, blocks = p
    n = X.shape[0]
    i, j = sorted(rnd.randint(0, n) for _ in range(2))
    a = record(X, C, w, T, resp, metric, 0, i)
    b = record(X, C, w, T, resp, metric, i, j)
    c = record(X, C, w, T, resp, metric, j, n)
    for x, y in ((a, b), (b, c), (a, c)):
        xy, yx = as_dict(x + y), as_dict(y + x)
        for f in FIELDS:
            assert np.array_equal(xy[f], yx[f]), f           # bit for bit
    abc = a + (b + c)
    for other in ((a + b) + c, (a + c) + b):
        assert_close(other, abc, T)
        assert other.min_margin == abc.min_margin        # min is exactly associative


@SETTINGS
@given(problems())
def test_zeros_is_two_sided_identity(p):
    X, C, w, T, resp, metric, blocks = p
    m = record(X, C, w, T, resp, metric)
    z = Moments.zeros(C.shape[0], C.shape[1], T, responsibilities=resp, metric=metric)
    for r in (m + z, z + m, sum([z, m, z])):
        for f in FIELDS:
            assert np.array_equal(getattr(r, f), getattr(m, f)), f
        assert (r.temperature, r.responsibilities, r.metric) == (T, resp, metric)


def test_float32_rows_far_from_the_origin_keep_float64_centers_until_centered():
    """Centers (float64, e.g. from Moments.finalize) are measured from the rows' mean before
    they are rounded to the rows' float32: rounding them at their own magnitude (1e-3 at
    1e4) first put responsibilities 3e-3 off the float64 answer."""
    rng = np.random.default_rng(4)
    X32 = (1e4 + rng.normal(size=(400, 5))).astype(np.float32)
    C = X32[:4].astype(np.float64) + 0.1 + rng.normal(size=(4, 5)) * 0.3
    X64 = X32.astype(np.float64)
    r32, r64 = fa.responsibilities(X32, C, 0.5), fa.responsibilities(X64, C, 0.5)
    assert r32.dtype == np.float32
    assert np.abs(r32 - r64).max() < 1e-5
    m32, m64 = fa.moments(X32, C, 0.5), fa.moments(X64, C, 0.5)
    assert np.abs(m32.N - m64.N).max() < 1e-5 * m64.N.max()
    assert abs(m32.free_energy - m64.free_energy) < 1e-5 * abs(m64.free_energy)
    with pytest.raises(ValueError, match="beyond the range of X's dtype float32"):
        fa.moments(X32, np.full((2, 5), 1e39), 0.5)


def test_moments_refuse_weights_that_sum_to_infinity():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(1000, 3))
    with pytest.raises(ValueError, match="weights sum to infinity"):
        fa.moments(X, X[:2], 1.0, weights=np.full(1000, 1e306))
    m = fa.moments(X, X[:2], 1.0, weights=np.full(1000, 1e300))    # large but finite: fine
    assert np.isfinite(m.free_energy) and np.isfinite(m.S).all()


@pytest.mark.parametrize("dtype", ["Float64", "Float32", "Int64"])
def test_functions_take_pandas_nullable_frames(dtype):
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(1)
    X = np.round(rng.normal(size=(60, 3)) * 4)
    C = X[:3]
    df = pd.DataFrame(X).astype(dtype)
    r = fa.responsibilities(df, C, 2.0)
    assert r.dtype == (np.float32 if dtype == "Float32" else np.float64)
    np.testing.assert_allclose(r, fa.responsibilities(X, C, 2.0), atol=1e-6)
    m = fa.moments(df, C, 2.0)
    np.testing.assert_allclose(m.N, fa.moments(X, C, 2.0).N, rtol=1e-6)
    df.iloc[5, 1] = pd.NA
    with pytest.raises(ValueError, match="NaN .*row 5, column 1"):
        fa.moments(df, C, 2.0)
