"""The helpers of the known-answer benchmark (benchmarks/_known_answers.py and
benchmarks/bench_known_answers.py) against brute-force references: the generated sets, the
centroid index, the relative SSE and random swap. Nothing here scores fastanneal's quality."""
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _known_answers as ka  # noqa: E402


def ci_brute_force(A, B):
    """The centroid index by its definition, with explicit loops."""
    def orphans(P, Q):
        hit = [False] * len(Q)
        for p in P:
            d = [sum((pi - qi) ** 2 for pi, qi in zip(p, q)) for q in Q]
            hit[d.index(min(d))] = True
        return hit.count(False)
    return max(orphans(A, B), orphans(B, A))


@pytest.fixture(scope="module")
def sets():
    return {name: ka.load(name, seed=0) for name in ka.SETS}


def test_sets_have_the_stated_shapes(sets):
    expected_d = {"grid100": 2, "a20": 2, "a35": 2, "a50": 2, "dim32": 32, "dim128": 128,
                  "dim1024": 1024, "unbalanced": 2}
    assert set(sets) == set(expected_d) == set(ka.N_CLUSTERS) == set(ka.DESCRIPTIONS)
    for name, (X, C, y) in sets.items():
        K, D = ka.N_CLUSTERS[name], expected_d[name]
        assert X.dtype == np.float64 and X.flags.c_contiguous
        assert X.shape == (len(y), D) and C.shape == (K, D)
        assert y.min() == 0 and y.max() == K - 1
        assert np.bincount(y, minlength=K).min() > 0
    assert len(sets["grid100"][0]) in range(10_000, 20_001)
    assert [len(sets[s][0]) for s in ("a20", "a35", "a50")] == [3000, 5250, 7500]
    assert np.bincount(sets["unbalanced"][2]).tolist() == [2000] * 3 + [100] * 5
    # the labels are the generating components: each cluster's mean sits near its center
    for name, (X, C, y) in sets.items():
        for k in range(len(C)):
            rows = X[y == k]
            se = rows.std(0).max() / np.sqrt(len(rows))
            assert np.abs(rows.mean(0) - C[k]).max() < 6 * se, (name, k)


def test_sets_are_reproducible_from_the_seed(sets):
    for name in ("a35", "dim32", "unbalanced"):
        X, C, y = ka.load(name, seed=0)
        np.testing.assert_array_equal(X, sets[name][0])
        np.testing.assert_array_equal(C, sets[name][1])
        np.testing.assert_array_equal(y, sets[name][2])
        assert not np.array_equal(ka.load(name, seed=1)[0], X)
    with pytest.raises(KeyError):
        ka.load("birch1")


def test_a_sets_keep_the_minimum_separation(sets):
    for name in ("a20", "a35", "a50"):
        C = sets[name][1]
        d = np.sqrt(((C[:, None] - C[None]) ** 2).sum(-1))
        assert d[np.triu_indices(len(C), 1)].min() >= 4.5


def test_ci_of_the_true_centers_is_zero(sets):
    for name, (_, C, _) in sets.items():
        assert ka.centroid_index(C, C) == 0
        assert ka.centroid_index(C[::-1] + 1e-6, C) == 0          # order does not matter


def test_ci_is_one_after_dropping_one_center_and_duplicating_another(sets):
    X, C, _ = sets["a20"]
    rng = np.random.default_rng(0)
    for _ in range(5):
        i, j = rng.choice(len(C), 2, replace=False)
        found = C.copy()
        found[j] = C[i] + 1e-3 * rng.standard_normal(2)       # j lost, i found twice
        assert ka.centroid_index(found, C) == 1
        assert ka.centroid_index(C, found) == 1
        assert ci_brute_force(found, C) == 1


def test_ci_matches_brute_force_and_is_symmetric(rng):
    for _ in range(30):
        k1, k2 = rng.integers(1, 12, 2)
        A = rng.standard_normal((k1, 3))
        B = rng.standard_normal((k2, 3))
        ci = ka.centroid_index(A, B)
        assert ci == ci_brute_force(A.tolist(), B.tolist())
        assert ci == ka.centroid_index(B, A)
        assert 0 <= ci <= max(k1, k2) - 1


def test_relative_sse_of_the_true_centers_is_one(sets, rng):
    for name in ("grid100", "a35", "dim128"):
        X, C, _ = sets[name]
        assert ka.relative_sse(X, C, C) == pytest.approx(1.0, rel=1e-12)
    X, C, _ = sets["a20"]
    direct = ((X[:, None] - C[None]) ** 2).sum(-1).min(1).sum()     # not the GEMM form
    assert ka.sse(X, C, block=1000) == pytest.approx(direct, rel=1e-10)
    worse = C + rng.standard_normal(C.shape)
    assert ka.relative_sse(X, worse, C) > 1.0


def test_lloyd_step_sse_is_the_partition_sse(rng):
    X = rng.standard_normal((500, 4))
    X -= X.mean(0)
    C, labels, err = ka._lloyd(X, float((X * X).sum()), X[:6].copy(), 2)
    direct = sum(((X[labels == k] - X[labels == k].mean(0)) ** 2).sum()
                 for k in np.unique(labels))
    assert err == pytest.approx(direct, rel=1e-9)
    for k in np.unique(labels):
        np.testing.assert_allclose(C[k], X[labels == k].mean(0), atol=1e-12)


def test_random_swap_finds_five_separated_clusters():
    gen = np.random.default_rng(7)
    ang = 2 * np.pi * np.arange(5) / 5
    true = 10.0 * np.c_[np.cos(ang), np.sin(ang)]
    X, C, _ = ka._draw(gen, true, np.full(5, 60), 0.5)
    for seed in range(3):
        found, labels, err, accepted = ka.random_swap_kmeans(X, 5, seed, n_swaps=60)
        assert ka.centroid_index(found, true) == 0
        assert found.shape == (5, 2) and labels.shape == (len(X),)
        assert err == pytest.approx(ka.sse(X, found), rel=1e-6)
        assert ka.relative_sse(X, found, true) < 1.0 + 1e-9      # the optimum beats the truth


def test_swap_budget():
    bench = pytest.importorskip("bench_known_answers")
    assert bench.n_swaps_for(100, quick=False) == 5000
    assert bench.n_swaps_for(16, quick=False) == 500
    assert bench.n_swaps_for(50, quick=True) == 1000
    assert bench.n_swaps_for(8, quick=True) == 400
    assert bench.n_swaps_for(100, quick=True, fixed=7) == 7


def test_spy_records_fastanneal_seeds_and_restores(rng):
    """The 'Lloyd from fastanneal k-means++' peer starts from the seeds the default fit used:
    the spy sees them once and leaves fastanneal's functions as they were."""
    bench = pytest.importorskip("bench_known_answers")
    import fastanneal as fa
    import fastanneal.estimator  # noqa: F401 -- loads lazily
    X = rng.standard_normal((300, 3))
    before = {name: getattr(m, "kmeans_plusplus") for name, m in list(sys.modules.items())
              if name.startswith("fastanneal") and hasattr(m, "kmeans_plusplus")}
    with bench.spy_kpp() as seen:
        fa.AnnealedKMeans(4, random_state=0).fit(X)
    after = {name: getattr(sys.modules[name], "kmeans_plusplus") for name in before}
    assert before and after == before
    assert len(seen) == 1
    C0, seconds = seen[0]
    assert C0.shape == (4, 3) and seconds >= 0
    # k-means++ seeds are data rows
    assert all(np.isclose(X, c).all(1).any() for c in C0)
