"""The schedule stops once it can only repeat Lloyd's update (docs/theory.md section 6.8).

A step ends the schedule when its last pass found every row exactly one-hot (``nnz ==
rows``) and the centers at a fixed point; the colder temperatures are left to the polish.
The tests check the criterion itself (one ambiguous row keeps every temperature), that the
result is the full schedule's (bit for bit where the centers did not move), that overlapping
data still run every temperature, and the cases that must never stop early (mass prior,
gradient solver, ``stop_when_hard=False``, ``polish=False``). Data come from seeds fixed per
test.
"""
import warnings

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from fastanneal import AnnealedKMeans


def separated(seed, K=6, D=8, n_per=80, sep=40.0, dtype=np.float64):
    """K clusters far apart relative to their spread (every margin >> any T of a fit)."""
    rng = np.random.default_rng(seed)
    M = sep * rng.standard_normal((K, D))
    X = np.concatenate([m + rng.standard_normal((n_per, D)) for m in M])
    return X[rng.permutation(len(X))].astype(dtype), M


def fit(X, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AnnealedKMeans(**kw).fit(X)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("resp", ["softmax", "entmax15"])
def test_hard_schedule_stops_and_equals_the_full_schedule(dtype, resp):
    X, M = separated(0, dtype=dtype)
    kw = dict(n_clusters=6, responsibilities=resp, random_state=3)
    on = fit(X, **kw)
    off = fit(X, stop_when_hard=False, **kw)
    assert on.hardened_step_ is not None and on.hardened_step_ < off.n_steps_ - 1
    assert off.hardened_step_ is None and off.n_steps_ == 20 and len(off.trace_) == 21
    assert on.n_steps_ == on.hardened_step_ + 1
    assert on.n_iter_ < off.n_iter_
    # the skipped temperatures were Lloyd passes from a fixed point: the same result
    assert_array_equal(on.labels_, off.labels_)
    scale = float(np.mean((X - X.mean(0)) ** 2))
    tol = 1e-12 if dtype == np.float64 else 1e-6
    np.testing.assert_allclose(on.cluster_centers_, off.cluster_centers_, rtol=0,
                               atol=tol * np.sqrt(scale) * 10)
    assert on.inertia_ == pytest.approx(off.inertia_, rel=1e-12 if dtype == np.float64
                                        else 1e-6)


def _two_mirrored_clusters():
    rng = np.random.default_rng(5)
    a = rng.standard_normal((100, 3))
    a -= a.mean(0)
    # point-symmetric about 0: means at -20 and +20 on the first axis
    return np.concatenate([a + [-20.0, 0, 0], -a + [20.0, 0, 0], [[0.0, 0.0, 0.0]]])


def test_a_row_that_stays_ambiguous_keeps_every_temperature():
    """Two mirrored clusters and a row halfway between them with a negligible weight: the
    centers stay symmetric, its margin stays ~0, it is never one-hot, so every temperature
    runs; without that row the first temperature is already hard."""
    X = _two_mirrored_clusters()
    clean = fit(X[:-1], n_clusters=2, random_state=0)
    assert clean.hardened_step_ == 0 and clean.n_steps_ == 1
    w = np.ones(len(X))
    w[-1] = 1e-9
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amb = AnnealedKMeans(2, random_state=0).fit(X, sample_weight=w)
    assert amb.hardened_step_ is None and amb.n_steps_ == 20


def test_the_schedule_stops_at_the_first_one_hot_temperature():
    """With full weight the halfway row joins one cluster as the temperature falls (its
    margin becomes ~8). The schedule stops at the first temperature where every margin
    exceeds ``T log 2^53`` (float64 drop threshold), checked against NumPy at the returned
    centers (a fixed point by then); at the temperature before, that row was still soft."""
    X = _two_mirrored_clusters()
    km = fit(X, n_clusters=2, random_state=0)
    h = km.hardened_step_
    assert h is not None and 0 < h < 19
    T = km.trace_.as_dict()["temperature"]
    d = ((X[:, None, :] - km.cluster_centers_[None]) ** 2).sum(-1)
    d.sort(axis=1)
    margin = (d[:, 1] - d[:, 0]).min()
    thr = np.log(2.0 ** 53)
    assert margin > T[h] * thr
    assert margin < T[h - 1] * thr


def test_overlapping_clusters_run_every_temperature():
    """Where rows stay soft (overlapping clusters) the criterion never holds."""
    rng = np.random.default_rng(11)
    M = 2.5 * rng.standard_normal((8, 2))
    X = np.concatenate([m + rng.standard_normal((150, 2)) for m in M])
    km = fit(X, n_clusters=8, random_state=0)
    assert km.hardened_step_ is None and km.n_steps_ == 20
    d = km.trace_.as_dict()
    assert np.all(d["entropy"][d["step"] >= 0] > 0)


@pytest.mark.parametrize("kw", [dict(stop_when_hard=False), dict(mass_constrained=True),
                                dict(solver="gradient", gradient_steps=2),
                                dict(polish=False)])
def test_never_stops_early_where_the_update_is_not_lloyds(kw):
    X, _ = separated(1)
    km = fit(X, n_clusters=6, random_state=0, n_steps=6, **kw)
    assert km.hardened_step_ is None and km.n_steps_ == 6


def test_resumed_fit_makes_the_same_decision(tmp_path):
    """The decision reads only the step's moments: a fit that writes checkpoints (bounds
    reset at every step) stops at the same step, and a rerun from its finished file returns
    the same centers."""
    X, _ = separated(2)
    a = fit(X, n_clusters=6, random_state=4)
    b = fit(X, n_clusters=6, random_state=4, checkpoint=tmp_path / "ck")
    c = fit(X, n_clusters=6, random_state=4, checkpoint=tmp_path / "ck")
    assert a.hardened_step_ == b.hardened_step_ == 0
    assert_array_equal(a.cluster_centers_, b.cluster_centers_)
    assert_array_equal(b.cluster_centers_, c.cluster_centers_)


def test_the_mini_batch_route_reports_no_early_end():
    """``batch_size`` delegates to the stochastic rule, which runs every temperature; the
    attribute exists there too (None)."""
    X, _ = separated(1)
    km = fit(X, n_clusters=6, random_state=0, n_steps=6, batch_size=120)
    assert km.hardened_step_ is None
