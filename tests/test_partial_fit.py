"""AnnealedKMeans.partial_fit (streaming stochastic-EM annealing) and estimator pickling."""
import pickle

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

from fastanneal import AnnealedKMeans


def blobs(rng, n, k=5, d=6):
    means = rng.standard_normal((k, d)) * 8
    y = rng.integers(0, k, n)
    return means[y] + rng.standard_normal((n, d)), y


def test_partial_fit_loop_recovers_separated_blobs(rng):
    X, y = blobs(rng, 6000)
    km = AnnealedKMeans(5, n_steps=10, random_state=0)
    for b in range(0, 6000, 500):
        km.partial_fit(X[b:b + 500])
    assert km.cluster_centers_.shape == (5, 6)
    assert adjusted_rand_score(y, km.predict(X)) >= 0.95
    assert len(km.trace_) == 12
    km2 = pickle.loads(pickle.dumps(km))
    np.testing.assert_array_equal(km2.predict(X[:100]), km.predict(X[:100]))
    # fit() starts afresh: the streaming state is dropped
    km.fit(X[:1000])
    assert not hasattr(km, "_partial_state")


def test_partial_fit_rejects_feature_change(rng):
    X, _ = blobs(rng, 600)
    km = AnnealedKMeans(3, random_state=0).partial_fit(X[:300])
    with pytest.raises(ValueError, match="features"):
        km.partial_fit(X[300:, :4])


def test_first_batch_with_fewer_distinct_rows_than_clusters():
    """A first batch of 2 distinct points seeds 3 centers, two of them equal: they were
    never separated (predict used 2 clusters after 30 good batches); now they are nudged
    apart after each batch and the stream fills all three."""
    rng = np.random.default_rng(2)
    means = np.array([[0.0, 0.0], [6.0, 6.0], [0.0, 6.0]])
    y = rng.integers(0, 3, 3000)
    X = means[y] + rng.normal(0, 0.5, (3000, 2))
    first = np.array([[0.0, 0.0]] * 10 + [[6.0, 6.0]] * 10)
    km = AnnealedKMeans(3, random_state=0, n_steps=10).partial_fit(first)
    for b in range(0, 3000, 100):
        km.partial_fit(X[b:b + 100])
    assert len(np.unique(km.predict(X))) == 3
    assert adjusted_rand_score(y, km.predict(X)) > 0.95


def test_coincident_centers_are_separated_between_batches():
    """An init that repeats a row: fit pulls the twins apart, partial_fit kept them equal
    (identical centers get identical responsibilities and never separate)."""
    rng = np.random.default_rng(5)
    means = np.array([[0.0, 0.0], [6.0, 6.0], [0.0, 6.0]])
    y = rng.integers(0, 3, 3000)
    X = means[y] + rng.normal(0, 0.5, (3000, 2))
    init = np.array([[3.0, 3.0], [3.0, 3.0], [0.0, 0.0]])
    km = AnnealedKMeans(3, init=init, random_state=0, n_steps=10)
    for b in range(0, 3000, 100):
        km.partial_fit(X[b:b + 100])
    assert len(np.unique(km.predict(X))) == 3
    assert adjusted_rand_score(y, km.predict(X)) > 0.95
    assert km.trace_.as_dict()["coincident"][0] >= 1      # seen and separated


def test_minibatch_fit_says_when_a_cluster_ends_empty():
    """Rows that differ only in their last bits under cosine (positive multiples of one
    vector): the mini-batch fit ends with an empty cluster and says so (it only reported
    relocations)."""
    import warnings
    from fastanneal import AnnealingWarning, MiniBatchAnnealedKMeans
    X = np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [-1.0, 0.0]] * 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        km = MiniBatchAnnealedKMeans(3, metric="cosine", random_state=0, batch_size=4).fit(X)
    assert (km.cluster_weights_ == 0).sum() == 1
    assert any(issubclass(w.category, AnnealingWarning)
               and "1 of the 3 fitted clusters hold no row" in str(w.message) for w in caught)


def test_a_batch_of_zero_weight_rows_changes_nothing():
    """A streaming loop may meet a batch whose rows all weigh zero: after the first call it
    leaves the fit as it is (it raised "sample_weight sums to zero"); the first call still
    needs weight to seed from (score() refuses all-zero weights, as scikit-learn's)."""
    from fastanneal import AnnealedKMeans
    rng = np.random.default_rng(11)
    X = np.concatenate([c + rng.normal(size=(100, 3)) for c in rng.normal(size=(4, 3)) * 6])
    zeros = np.zeros(len(X))
    km = AnnealedKMeans(4, random_state=0)
    with pytest.raises(ValueError, match="sums to zero"):
        km.partial_fit(X, sample_weight=zeros)
    km.partial_fit(X)
    C = km.cluster_centers_.copy()
    state = (km.temperature_, km.n_steps_ if hasattr(km, "n_steps_") else None)
    km.partial_fit(X[:50], sample_weight=zeros[:50])
    np.testing.assert_array_equal(km.cluster_centers_, C)
    assert (km.temperature_, km.n_steps_ if hasattr(km, "n_steps_") else None) == state
    assert km.labels_.shape == (50,) and km.inertia_ == 0.0
    np.testing.assert_array_equal(km.labels_, km.predict(X[:50]))
    with pytest.raises(ValueError, match="sums to zero"):
        km.score(X, sample_weight=zeros)
    km.partial_fit(X)                       # and the stream goes on
    assert not np.array_equal(km.cluster_centers_, C)


def test_partial_fit_after_fit_counts_on_and_a_batch_size_fit_has_its_schedule():
    """After fit, partial_fit set n_iter_ / n_steps_ to its step-size count (22 / 20 read
    16 / 16 after one update); they count on now. AnnealedKMeans(batch_size=...) lacked
    the documented schedule_."""
    from sklearn.datasets import make_blobs
    from fastanneal import AnnealedKMeans, MiniBatchAnnealedKMeans
    X, _ = make_blobs(1500, n_features=6, centers=4, random_state=0)
    for est in (MiniBatchAnnealedKMeans(4, random_state=0), AnnealedKMeans(4, random_state=0)):
        est.fit(X)
        it, st = est.n_iter_, est.n_steps_
        est.partial_fit(X[:100])
        assert (est.n_iter_, est.n_steps_) == (it + 1, st + 1)
        est.partial_fit(X[100:200])
        assert (est.n_iter_, est.n_steps_) == (it + 2, st + 2)
    fresh = AnnealedKMeans(4, random_state=0).partial_fit(X[:100]).partial_fit(X[100:200])
    assert (fresh.n_iter_, fresh.n_steps_) == (2, 2)
    mb = AnnealedKMeans(5, batch_size=500, random_state=0).fit(X)
    assert mb.schedule_ is not None
