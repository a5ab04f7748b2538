"""The annealing finds clusters that k-means++ + Lloyd misses (known-answer problems).

The problem: a 6 x 6 grid of well-separated Gaussian clusters (60 points each, sd 0.12,
spacing 1). With ``random_state=1`` the k-means++ seeds of the fit put two codevectors in one
cluster and none in another; Lloyd from those seeds keeps that (centroid index CI = 1). The
default fit ends with every cluster found (CI = 0): the phase-transition re-allocation
(docs/theory.md section 6.7) splits the cell whose critical temperature says it holds two
clusters, with the redundant codevector.
"""
import warnings

import numpy as np
import pytest
from sklearn.cluster import KMeans

import fastanneal._seeding as seeding
from fastanneal import AnnealedKMeans


def grid(seed, side=6, n=60, sd=0.12):
    rng = np.random.default_rng(seed)
    g = np.array([(i, j) for i in range(side) for j in range(side)], float)
    return np.concatenate([c + sd * rng.standard_normal((n, 2)) for c in g]), g


def centroid_index(found, true):
    """Fränti & Sieranoja's CI: true centers that no found center has as its nearest (and
    the other way round), the larger of the two counts."""
    def orphans(A, B):
        d = ((A[:, None, :] - B[None, :, :]) ** 2).sum(-1)
        return B.shape[0] - np.unique(d.argmin(1)).size
    return max(orphans(found, true), orphans(true, found))


@pytest.fixture
def seeds_of_the_fit(monkeypatch):
    """Records the k-means++ seeds the fit draws."""
    seen = []
    orig = seeding.kmeans_plusplus

    def rec(*a, **k):
        C = orig(*a, **k)
        seen.append(C.copy())
        return C
    monkeypatch.setattr(seeding, "kmeans_plusplus", rec)
    return seen


@pytest.mark.parametrize("seed", [1, 8, 11])
def test_default_fit_finds_every_cluster_where_lloyd_from_its_seeds_does_not(
        seed, seeds_of_the_fit):
    X, true = grid(seed)
    K = len(true)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        km = AnnealedKMeans(K, random_state=seed).fit(X)
    lloyd = KMeans(K, init=seeds_of_the_fit[0], n_init=1).fit(X)
    assert centroid_index(lloyd.cluster_centers_, true) >= 1
    assert centroid_index(km.cluster_centers_, true) == 0
    assert km.n_reallocations_ >= 1
    assert km.inertia_ < lloyd.inertia_ * (1 - 1e-3)
    # switched off, the fit ends where Lloyd from its seeds ends
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        off = AnnealedKMeans(K, random_state=seed, reallocate=False).fit(X)
    assert centroid_index(off.cluster_centers_, true) >= 1
    assert off.n_reallocations_ == 0


def test_reallocation_never_increases_J_and_records_its_moves():
    X, true = grid(1)
    K = len(true)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        km = AnnealedKMeans(K, random_state=1).fit(X)
    d = km.trace_.as_dict()
    hard = d["step"] == -1
    J = d["hard_distortion"][hard]
    # the polish, one per kept batch of moves (and a last Lloyd if the last one was judged
    # before convergence)
    assert km.n_reallocations_ >= 1 and 2 <= hard.sum() <= 2 + km.n_reallocations_
    assert np.all(np.diff(J) < 0)                          # every kept move lowered J
    assert km.inertia_ <= J[-1] * (1 + 1e-12)


def test_minibatch_seeds_are_reallocated_on_the_seeding_sample():
    """MiniBatchAnnealedKMeans refines its k-means++ seeds on the in-memory seeding sample
    (Lloyd + re-allocation moves): one codevector per cluster before the stochastic EM;
    with ``reallocate=False`` the seeds keep the doubled/missed clusters."""
    from fastanneal import MiniBatchAnnealedKMeans
    from fastanneal.estimator import _seed_from_sample
    X, true = grid(1)
    w = np.ones(len(X))
    cis = {}
    for flag in (True, False):
        est = MiniBatchAnnealedKMeans(len(true), reallocate=flag)
        C = _seed_from_sample(est, X, w, len(true), 0, np.random.default_rng(1))[0]
        cis[flag] = centroid_index(C, true)
    assert cis[True] == 0 and cis[False] >= 1, cis
