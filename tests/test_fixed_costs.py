"""The fixed costs of a fit (what a fit spends outside the annealing passes): the critical
temperature, the start temperature, the distinct-rows check and the BLAS thread pinning.
On small sets (a few thousand rows) these were a third of a default fit; each is made
cheaper here without changing what it computes beyond a stated tolerance. References:
``numpy.linalg.eigvalsh`` of the float64 covariance, ``numpy.unique`` of the rows,
``threadpoolctl.threadpool_info``."""
import numpy as np
import pytest

import fastanneal as fa
from fastanneal import _seeding, _sources
from fastanneal._sources import InMemorySource, top_eigenvalue, weighted_mean


def _aniso(rng, n, D):
    X = rng.standard_normal((n, D)) * np.linspace(0.5, 2.0, D)
    X[: n // 3] += 2.0 * rng.standard_normal(D)
    return np.ascontiguousarray(X)


@pytest.mark.parametrize("D", [40, 150])
def test_top_eigenvalue_matches_eigvalsh(D):
    """Both branches (``eigvalsh`` up to D = 64, ARPACK above) give the top eigenvalue to
    1e-12, also with a small spectral gap."""
    rng = np.random.default_rng(D)
    Q, _ = np.linalg.qr(rng.standard_normal((D, D)))
    lams = np.r_[1.0, 0.99, rng.uniform(0.0, 0.9, D - 2)]
    A = (Q * lams) @ Q.T
    assert top_eigenvalue(A) == pytest.approx(np.linalg.eigvalsh(A)[-1], rel=1e-12)
    B = np.cov(_aniso(rng, 500, D).T, bias=True)
    assert top_eigenvalue(B) == pytest.approx(np.linalg.eigvalsh(B)[-1], rel=1e-12)


def test_critical_temperature_by_lanczos_above_lanczos_d(monkeypatch):
    """Above ``LANCZOS_D`` features the in-memory source leaves T_c to Lanczos on its rows
    (no D x D covariance): the same T_c to 1e-6, and the fit's random stream untouched."""
    rng = np.random.default_rng(3)
    X = _aniso(rng, 400, _sources.LANCZOS_D + 20)
    w = np.ones(len(X))
    src = InMemorySource(X, w, 0)
    assert src.covariance(weighted_mean(X, w)) is None
    want = 2.0 * np.linalg.eigvalsh(np.cov(X.T, bias=True))[-1]
    g = np.random.default_rng(11)
    state = g.bit_generator.state
    got = _seeding.critical_temperature(src, weighted_mean(X, w), g)
    assert got == pytest.approx(want, rel=1e-6)
    assert g.bit_generator.state == state
    km = fa.AnnealedKMeans(3, random_state=0, n_steps=2).fit(X)
    assert km.critical_temperature_ == pytest.approx(want, rel=1e-6)
    # below the threshold the exact covariance route gives the same number
    monkeypatch.setattr(_sources, "LANCZOS_D", 10 ** 6)
    assert src.covariance(weighted_mean(X, w)) is not None
    assert _seeding.critical_temperature(src, weighted_mean(X, w), g) == \
        pytest.approx(want, rel=1e-12)


def test_auto_start_asks_lanczos_for_the_precision_it_needs(monkeypatch):
    """``temperature_start="auto"`` needs the clusters' ``lambda_max`` to about 1e-3: its
    Lanczos is stopped at ``AUTO_START_TOL``, and the start temperature agrees with the
    fully converged one to 1e-5."""
    rng = np.random.default_rng(5)
    X = _aniso(rng, 1500, 48)
    seen = []
    orig = InMemorySource.cluster_top_eigenvalues

    def spy(self, centers, n_iter, rng, **kw):
        seen.append(kw.get("tol"))
        return orig(self, centers, n_iter, rng, **kw)
    monkeypatch.setattr(InMemorySource, "cluster_top_eigenvalues", spy)
    fast = fa.AnnealedKMeans(6, random_state=1, n_steps=2).fit(X)
    assert _seeding.AUTO_START_TOL in seen
    monkeypatch.setattr(_seeding, "AUTO_START_TOL", 1e-12)
    full = fa.AnnealedKMeans(6, random_state=1, n_steps=2).fit(X)
    assert fast.temperature_start_ == pytest.approx(full.temperature_start_, rel=1e-5)


def test_distinct_rows_count_stops_once_the_cap_is_reached():
    """With ``cap`` the count hashes only the first ``4 cap`` rows of non-zero weight when
    they already hold ``cap`` distinct rows (the answer is then their count, >= cap);
    otherwise every row, exactly. ``n_clusters`` above the distinct rows still raises."""
    rng = np.random.default_rng(7)
    X = rng.standard_normal((1000, 5))
    w = np.ones(len(X))
    src = InMemorySource(X, w, 0)
    assert src.n_distinct_rows(np.random.default_rng(0), 10) == 40       # the head only
    assert src.n_distinct_rows(np.random.default_rng(0), 10 ** 9) == 1000
    # a head of duplicates: the whole data decides
    Xd = np.concatenate([np.repeat(X[:1], 400, axis=0), X[1:600]])
    w0 = np.ones(len(Xd))
    w0[400:410] = 0.0                            # rows of weight 0 are not counted
    srcd = InMemorySource(np.ascontiguousarray(Xd), w0, 0)
    want = len(np.unique(Xd[w0 > 0], axis=0))
    assert srcd.n_distinct_rows(np.random.default_rng(0), 50) == want
    Xr = np.ascontiguousarray(np.repeat(X[:3], 200, axis=0))
    with pytest.raises(ValueError, match="distinct"):
        fa.AnnealedKMeans(4, random_state=0).fit(Xr)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_head_count_of_distinct_rows_is_exact(dtype):
    """The head's count compares rows byte for byte (after -0.0 -> 0.0): equal to NumPy's
    ``unique(axis=0)`` with duplicates, signed zeros and rows differing in one last bit."""
    from fastanneal._sources import _n_distinct_exact
    rng = np.random.default_rng(12)
    X = rng.standard_normal((64, 300)).astype(dtype)
    X[5] = X[3]
    X[9] = X[3]
    X[7] = 0.0
    X[8] = -0.0                                   # equal to row 7 as numbers
    X[11] = X[10]
    X[11, -1] = np.nextafter(X[10, -1], dtype(np.inf))  # one ulp apart: distinct
    want = len(np.unique(X + dtype(0), axis=0))
    assert _n_distinct_exact(X) == want == 64 - 3
    assert _n_distinct_exact(X[:0]) == 0


def test_blas_single_thread_pins_and_restores():
    """Inside the context every BLAS library runs one thread; after it, the counts it had
    (also when the context is nested)."""
    from threadpoolctl import threadpool_info
    from fastanneal._moments import blas_single_thread

    def counts():
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
    before = counts()
    with blas_single_thread():
        assert counts() and all(n == 1 for n in counts())
        with blas_single_thread():
            assert all(n == 1 for n in counts())
        assert all(n == 1 for n in counts())
    assert counts() == before


def test_lanczos_ritz_vectors_of_all_clusters_at_once():
    """The final Ritz values and vectors of every cluster come from one stacked ``eigh``:
    values equal each cluster's top covariance eigenvalue, vectors its top eigenvector, with
    the sign rule (non-negative component along the Lanczos start vector)."""
    from fastanneal._sources import power_iteration_eigs
    rng = np.random.default_rng(31)
    K, D, n = 5, 12, 400
    X = rng.standard_normal((n, D)) * np.linspace(3.0, 0.5, D)
    X = X @ np.linalg.qr(rng.standard_normal((D, D)))[0]
    labels = rng.integers(0, K, n)
    w = rng.uniform(0.5, 2.0, n)
    mu = np.stack([np.average(X[labels == k], axis=0, weights=w[labels == k])
                   for k in range(K)])
    wk = np.bincount(labels, weights=w, minlength=K)

    def matvec(m, V):
        Z = X - m[labels]
        return np.stack([(w[labels == k, None] * Z[labels == k]).T
                         @ (Z[labels == k] @ V[k]) for k in range(K)])
    start = np.random.default_rng(7).standard_normal((K, D))
    lam, V = power_iteration_eigs(matvec, mu, wk, D, np.random.default_rng(8),
                                  return_vectors=True, tol=1e-12, start=start)
    # the Lanczos start: the warm start mixed with the generator's first draw (WARM_NOISE)
    noise = np.random.default_rng(8).standard_normal((K, D))
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    q0 = start / np.linalg.norm(start, axis=1, keepdims=True) + _sources.WARM_NOISE * noise
    assert np.all(np.einsum("kd,kd->k", V, q0) >= 0.0)
    for k in range(K):
        Z = X[labels == k] - mu[k]
        C = (w[labels == k, None] * Z).T @ Z / wk[k]
        ev, vec = np.linalg.eigh(C)
        assert lam[k] == pytest.approx(ev[-1], rel=1e-10)
        assert abs(abs(V[k] @ vec[:, -1]) - 1.0) < 1e-8
    # the same call without vectors returns the same values
    lam2 = power_iteration_eigs(matvec, mu, wk, D, np.random.default_rng(8), tol=1e-12,
                                start=start)
    np.testing.assert_allclose(lam2, lam, rtol=1e-12)


ENTMAX_CHAIN = ("entmax15_support_probs", "entmax15_tau_sort", "entmax15_tau_bisect")


def compile_counts(tmp_path, call, names):
    """``{(rule, name): (signatures, Literal-typed signatures)}`` of the ``_kernels``
    functions ``names`` after ``call`` (a statement using ``X`` and the rule ``r``) ran for
    softmax, then for entmax-1.5, in a fresh process with an empty Numba cache (from a cache
    the callees are not compiled at all and list no signature)."""
    import os
    import subprocess
    import sys
    code = ("import numpy as np, fastanneal as fa; from fastanneal import _kernels as k\n"
            "X = np.random.default_rng(3).standard_normal((600, 4)).astype(np.float32)\n"
            f"fs = [getattr(k, n) for n in {list(names)!r}]\n"
            "for r in ('softmax', 'entmax15'):\n"
            f"    {call}\n"
            "    for f in fs:\n"
            "        print(r, f.__name__, len(f.signatures), "
            "sum('Literal' in str(s) for s in f.signatures))\n")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=600, check=True).stdout.split("\n")
    rows = {(r, name): (int(n), int(lit)) for r, name, n, lit in
            (line.split() for line in out if line.strip())}
    assert len(rows) == 2 * len(names)
    return rows


def test_no_literal_typed_second_compile_of_the_row_rules(tmp_path):
    """The moments kernel compiles the row rules once each: a callee called with a
    variable that starts as the literal ``0`` gets a second compile for the type
    ``Literal[int](0)`` (seconds of a cold start); the kernels start such variables as
    ``np.int64(0)``. A softmax pass compiles no part of the entmax chain (its branch is
    typed only for an integer ``sort_max``: about 1 s of a cold first fit); an entmax pass
    then compiles it once, and the rows' function a second time for that argument."""
    rows = compile_counts(tmp_path, "fa.moments(X, X[:4].copy(), 0.5, responsibilities=r)",
                          ("_block_responsibilities", "_softmax_rows", "_accumulate_block")
                          + ENTMAX_CHAIN)
    for (r, name), (n_sigs, n_literal) in rows.items():
        assert n_literal == 0, (r, name)
        if name in ENTMAX_CHAIN:
            want = 0 if r == "softmax" else 1
        elif name == "_block_responsibilities":
            want = 1 if r == "softmax" else 2
        else:
            want = 1
        assert n_sigs == want, (r, name, n_sigs)


def test_softmax_gradient_compiles_no_entmax(tmp_path):
    """The gradient route's kernels take ``sort_max=None`` for softmax too: a softmax
    ``value_and_grad`` compiles no entmax function, an entmax one each once, none for a
    literal argument."""
    rows = compile_counts(
        tmp_path, "fa.value_and_grad(X, X[:4].astype(np.float64), 0.5, responsibilities=r)",
        ENTMAX_CHAIN)
    for (r, name), counts in rows.items():
        assert counts == ((0 if r == "softmax" else 1), 0), (r, name)


@pytest.mark.parametrize("n", [0, 1, 2, 7, 48, 702, 3000])
def test_sorted_descending_matches_numpy(n):
    """The Shell sort that replaced Numba's ``np.sort`` in entmax (compile time) sorts like
    NumPy, ties and sizes beyond its largest gap included, and leaves its input alone."""
    from fastanneal._kernels import _sorted_descending
    rng = np.random.default_rng(n)
    v = rng.standard_normal(n + 5)
    v[:n:9] = 0.25                                    # ties
    before = v.copy()
    np.testing.assert_array_equal(_sorted_descending(v, n), np.sort(v[:n])[::-1])
    np.testing.assert_array_equal(v, before)


def test_import_leaves_the_openmp_wait_policy_alone():
    """fastanneal runs no OpenMP region; importing it must not change ``OMP_WAIT_POLICY``,
    which also governs scikit-learn's threads in the same process."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", "import os, fastanneal; "
                          "print(os.environ.get('OMP_WAIT_POLICY'))"], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "None"


def test_read_only_weights_compile_nothing_new():
    """Weights straight from Arrow are read-only arrays, another type to Numba: the guide's
    first command after the demo compiled the pruned pass, k-means++ and the Lanczos matvec
    a second time (7 s shown as annealing time). The source keeps a writable copy."""
    from fastanneal import _kernels as K
    rng = np.random.default_rng(0)
    X = (rng.standard_normal((3000, 8)) + np.repeat(np.eye(8)[:3] * 6, 1000, axis=0))
    w = rng.uniform(1.0, 3.0, 3000)
    fa.AnnealedKMeans(3, random_state=0).fit(X, sample_weight=w)
    before = {f: len(getattr(K, f).signatures) for f in dir(K)
              if hasattr(getattr(K, f), "signatures")}
    w_ro = w.copy()
    w_ro.flags.writeable = False
    fa.AnnealedKMeans(3, random_state=0).fit(X, sample_weight=w_ro)
    after = {f: len(getattr(K, f).signatures) for f in before}
    assert after == before
    assert InMemorySource(X, w_ro, 0).w.flags.writeable
