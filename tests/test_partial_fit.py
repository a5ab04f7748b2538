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
