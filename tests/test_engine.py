"""The annealing engine against independent oracles (docs/theory.md sections 1-4, 6).

Oracles are plain float64 NumPy (distances from explicit differences, log-domain softmax over
all entries, entmax-1.5 by bisection on tau) and ``numpy.linalg.eigvalsh``; nothing here
reuses package code to compute an expected value. Every test draws fresh data from the
``rng`` fixture (its seed is printed on failure).
"""
import math
import warnings

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

import fastanneal
from fastanneal import AnnealedKMeans, AnnealingWarning


# ----------------------------------------------------------------------------- oracles
def sqdist(X, C):
    diff = np.asarray(X, np.float64)[:, None, :] - np.asarray(C, np.float64)[None, :, :]
    return np.einsum("ikj,ikj->ik", diff, diff)


def lse_rows(Z):
    m = Z.max(axis=1, keepdims=True)
    return (m + np.log(np.exp(Z - m).sum(axis=1, keepdims=True)))[:, 0]


def softmax_np(X, C, T, log_prior=None):
    """(r, per-row LSE, d) with ``r = softmax(log p - d / T)`` over all entries."""
    d = sqdist(X, C)
    Z = -d / T
    if log_prior is not None:
        Z = Z + log_prior[None, :]
    L = lse_rows(Z)
    return np.exp(Z - L[:, None]), L, d


def free_energy_np(X, w, C, T, log_prior=None):
    _, L, _ = softmax_np(X, C, T, log_prior)
    return -T * float(w @ L)


def entmax15_np(Z):
    """entmax-1.5 rows by bisection on tau: ``p = [z/2 - tau]_+^2`` summing to 1."""
    Zh = Z / 2.0 - (Z / 2.0).max(axis=1, keepdims=True)
    lo = np.full(Z.shape[0], -1.0)                 # sum >= 1 at tau = max - 1
    hi = np.zeros(Z.shape[0])                      # sum = 0 at tau = max
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        f = (np.maximum(Zh - mid[:, None], 0.0) ** 2).sum(axis=1)
        lo = np.where(f >= 1.0, mid, lo)
        hi = np.where(f >= 1.0, hi, mid)
    P = np.maximum(Zh - lo[:, None], 0.0) ** 2
    return P / P.sum(axis=1, keepdims=True)


def entmax_free_energy_np(X, w, C, T):
    d = sqdist(X, C)
    P = entmax15_np(-d / T)
    H = (4.0 / 3.0) * (1.0 - (P ** 1.5).sum(axis=1))
    return float(w @ ((P * d).sum(axis=1) - T * H))


def weighted_cov(X, w):
    mu = (w @ X) / w.sum()
    Xc = X - mu
    return (Xc * w[:, None]).T @ Xc / w.sum(), mu


def spread(C):
    """Largest pairwise distance between centers."""
    return math.sqrt(sqdist(C, C).max())


def anisotropic(rng, n=1500, scales=(3.0, 1.2, 1.0, 0.8)):
    """Rotated anisotropic Gaussian (clear top eigenvalue ~ 9 vs ~ 1.4) with random weights."""
    D = len(scales)
    Q, _ = np.linalg.qr(rng.standard_normal((D, D)))
    X = (rng.standard_normal((n, D)) * np.asarray(scales)) @ Q.T + rng.normal(0.0, 5.0, D)
    w = rng.uniform(0.5, 2.0, n)
    return X, w


@pytest.fixture
def one_thread():
    """Run the Numba kernels on one thread: the iterative tests below make thousands of tiny
    kernel calls, and an OpenMP parallel region costs milliseconds on a busy 2-core machine."""
    import numba
    old = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(old)


def blobs(rng, K=4, D=3, n_per=150, sep=6.0, std=1.0):
    centers = rng.standard_normal((K, D)) * sep
    X = np.concatenate([c + std * rng.standard_normal((n_per, D)) for c in centers])
    perm = rng.permutation(len(X))
    return X[perm], np.repeat(np.arange(K), n_per)[perm]


# ----------------------------------------------------------------------------- section 2
def test_critical_temperature_matches_eigvalsh(rng):
    X, w = anisotropic(rng)
    cov, _ = weighted_cov(X, w)
    lam = np.linalg.eigvalsh(cov)
    assert lam[-1] > 3 * lam[-2]            # the premise: a clear top eigenvalue
    km = AnnealedKMeans(n_clusters=3, random_state=0, n_steps=3).fit(X, sample_weight=w)
    assert km.critical_temperature_ == pytest.approx(2.0 * lam[-1], rel=1e-3)


def test_critical_temperature_with_a_small_spectral_gap(rng):
    """With ``lambda_2 = 0.95 lambda_1`` (exact, whitened data, D = 20) the estimate of T_c
    stays within 2e-3 for typical random starts."""
    n, lams = 1000, np.r_[1.0, 0.95, np.full(18, 0.5)]
    errors = []
    for seed in range(3):
        Z = rng.standard_normal((n, lams.size))
        Z -= Z.mean(axis=0)
        U, _, _ = np.linalg.svd(Z, full_matrices=False)
        Q, _ = np.linalg.qr(rng.standard_normal((lams.size, lams.size)))
        X = (U * math.sqrt(n) * np.sqrt(lams)) @ Q.T + 3.0     # covariance exactly Q diag Q^T
        assert 2.0 * np.linalg.eigvalsh(weighted_cov(X, np.ones(n))[0])[-1] == pytest.approx(2.0)
        km = AnnealedKMeans(n_clusters=2, random_state=seed, n_steps=1, max_iter=1).fit(X)
        errors.append(km.critical_temperature_ / 2.0 - 1.0)
    # a ~2 % chance per start of a start vector nearly orthogonal to v_1 (see the next test):
    # allow one miss in three
    assert np.sort(np.abs(errors))[1] <= 2e-3, np.round(errors, 5).tolist()


def test_top_eigenvalue_from_an_unlucky_start(rng):
    """The power iteration behind ``critical_temperature_`` (50 iterations) and the per-cluster
    critical temperatures, from a start vector with a 0.01 component along v_1: in D = 20
    a random unit vector is that close to orthogonal with probability ~3.5 %. With
    ``lambda_2 = 0.95 lambda_1`` it must still find lambda_1 (rel 1e-3), not stop near
    lambda_2 (5 % low): a low T_c silences the above-T_c warning and starts the critical
    schedule below T_c. (Exact alternatives: eigvalsh of the D x D covariance for in-memory
    data, or a Lanczos / block iteration.)"""
    from fastanneal._sources import power_iteration_eigs
    D = 20
    lams = np.r_[1.0, 0.95, np.full(D - 2, 0.5)]
    Q, _ = np.linalg.qr(rng.standard_normal((D, D)))
    cov = (Q * lams) @ Q.T
    W = 7.0
    start = 0.01 * Q[:, 0] + math.sqrt(1 - 1e-4) * Q[:, 1]

    class FixedStart:
        def standard_normal(self, shape):
            return np.broadcast_to(start, shape).copy()

    lam = power_iteration_eigs(lambda mu, V: W * (V @ cov), np.zeros((1, D)), np.array([W]),
                               50, FixedStart())
    assert lam[0] == pytest.approx(1.0, rel=1e-3)


@pytest.mark.parametrize("factor, collapsed", [(1.02, True), (0.98, False)])
def test_soft_lloyd_collapses_above_and_splits_below_Tc(rng, one_thread, factor, collapsed):
    """From ``mean + 1e-3 noise``, soft Lloyd (one step = finalize of the moments) stays
    collapsed at ``1.02 T_c`` and splits along the top eigenvector at ``0.98 T_c``."""
    X, w = anisotropic(rng, n=600)
    cov, mu = weighted_cov(X, w)
    lam, V = np.linalg.eigh(cov)
    Tc = 2.0 * lam[-1]
    C = mu + 1e-3 * math.sqrt(lam[-1]) * rng.standard_normal((2, X.shape[1]))
    s0 = spread(C)
    # linear rate 2 lambda / T = 1 / factor per step: 0.98^1000 ~ 2e-9, 1.02^350 ~ 1e3
    for _ in range(1000):
        C = fastanneal.moments(X, C, factor * Tc, weights=w, hard_sums=False).finalize().centers
    # the weighted mean of the centers is the data mean at every step
    if collapsed:
        assert spread(C) < 1e-3 * s0
        assert_allclose(C, np.repeat(mu[None], 2, axis=0), atol=1e-6 * math.sqrt(lam[-1]))
    else:
        # pitchfork amplitude ~ 2 sigma sqrt(0.02) ~ 0.28 sigma for Gaussian data
        assert spread(C) > 0.1 * math.sqrt(lam[-1])
        u = (C[0] - C[1]) / np.linalg.norm(C[0] - C[1])
        assert abs(u @ V[:, -1]) > 0.99


def test_estimator_constant_schedule_around_Tc(rng, one_thread):
    """Same oracle through AnnealedKMeans (schedule="constant", polish=False); the fixed
    start above T_c warns, the one below does not."""
    X, w = anisotropic(rng, n=600)
    cov, mu = weighted_cov(X, w)
    lam = np.linalg.eigvalsh(cov)[-1]
    scale = float(np.trace(cov))
    Tc = 2.0 * lam
    C0 = mu + 1e-3 * math.sqrt(lam) * rng.standard_normal((2, X.shape[1]))
    common = dict(n_clusters=2, schedule="constant", n_steps=1, init=C0, polish=False,
                  max_iter=1000, tol=0.0, random_state=0)
    with pytest.warns(AnnealingWarning, match="critical temperature"):
        hot = AnnealedKMeans(temperature_start=1.02 * Tc, **common).fit(X, sample_weight=w)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AnnealingWarning)
        cold = AnnealedKMeans(temperature_start=0.98 * Tc, **common).fit(X, sample_weight=w)
    # collapsed: only the engine's duplicate nudge (1e-3 sqrt(scale)) separates the centers
    assert 0 < spread(hot.cluster_centers_) <= 2.5e-3 * math.sqrt(scale)
    assert spread(cold.cluster_centers_) > 0.1 * math.sqrt(lam)


def test_critical_schedule_splits_just_below_Tc(rng):
    """schedule="critical" starts at 1.02 T_c with one effective cluster and cools by 0.85:
    on data with a clear top eigenvalue the first cluster must split at the first or second
    temperature below T_c (0.867 T_c or 0.737 T_c), as docs/theory.md section 3 and the engine's
    docstring ("a pair whose members moved apart has passed its cluster's critical
    temperature") describe."""
    X, w = anisotropic(rng, n=2000)
    km = AnnealedKMeans(n_clusters=4, schedule="critical", random_state=0).fit(X, sample_weight=w)
    d = km.trace_.as_dict()
    Tc = km.critical_temperature_
    annealing = d["temperature"] > 0
    T = d["temperature"][annealing]
    split = d["n_distinct"][annealing] >= 2
    assert T[0] == pytest.approx(1.02 * Tc, rel=1e-12)
    assert split.any()
    first = T[np.argmax(split)]
    assert first >= 0.7 * Tc, (
        f"first split at T = {first / Tc:.3f} T_c; T / T_c by step: "
        f"{np.round(T / Tc, 3).tolist()}, n_distinct: {d['n_distinct'][annealing].tolist()}")


# ----------------------------------------------------------------------------- section 1
@pytest.mark.parametrize("mode", ["softmax", "mass_constrained", "entmax15"])
def test_free_energy_never_increases_at_fixed_T(rng, one_thread, mode):
    """Soft Lloyd at fixed T is alternating minimization: F_T is monotone non-increasing.
    With a prior, EM with ``p <- N / W`` also never increases F (it is EM on the fixed-variance
    mixture likelihood); entmax-1.5 minimizes ``sum r d - T H_1.5`` the same way."""
    X, _ = blobs(rng, K=3, D=3, n_per=200, sep=2.5)
    w = rng.uniform(0.2, 3.0, len(X))
    cov, _ = weighted_cov(X, w)
    T = 0.3 * 2.0 * np.linalg.eigvalsh(cov)[-1]
    K = 5
    C = X[rng.choice(len(X), K, replace=False)]
    logp = np.log(rng.dirichlet(np.ones(K))) if mode == "mass_constrained" else None
    resp = "entmax15" if mode == "entmax15" else "softmax"
    F = []
    for _ in range(60):
        m = fastanneal.moments(X, C, T, weights=w, responsibilities=resp, log_prior=logp,
                               hard_sums=False)
        if resp == "entmax15":
            F_ref = entmax_free_energy_np(X, w, C, T)
        else:
            F_ref = free_energy_np(X, w, C, T, logp)
        assert m.free_energy == pytest.approx(F_ref, rel=1e-10)
        F.append(F_ref)
        C = m.finalize().centers
        if logp is not None:
            logp = np.log(m.N / m.weight)
    F = np.asarray(F)
    assert np.all(np.diff(F) <= 1e-12 * np.abs(F[:-1])), np.diff(F).max()
    assert F[-1] < F[0]


@pytest.mark.parametrize("with_prior", [False, True])
def test_soft_step_is_preconditioned_gradient_step(rng, with_prior):
    """One soft-Lloyd step equals ``c - grad F / (2 N)``, ``grad_k F = 2 sum w r_ik (c_k - x_i)``;
    the gradient formula itself is checked against central differences of F (NumPy)."""
    X, _ = blobs(rng, K=3, D=3, n_per=80, sep=3.0)
    n, D = X.shape
    w = rng.uniform(0.2, 3.0, n)
    K = 4
    C = X[rng.choice(n, K, replace=False)] + 0.1 * rng.standard_normal((K, D))
    cov, _ = weighted_cov(X, w)
    scale = float(np.trace(cov))
    T = 0.2 * scale
    logp = np.log(rng.dirichlet(np.ones(K))) if with_prior else None
    R, _, _ = softmax_np(X, C, T, logp)
    Rw = R * w[:, None]
    N = Rw.sum(axis=0)
    grad = 2.0 * (N[:, None] * C - Rw.T @ X)
    expected = C - grad / (2.0 * N[:, None])
    got = fastanneal.moments(X, C, T, weights=w, log_prior=logp).finalize().centers
    assert_allclose(got, expected, rtol=1e-10, atol=1e-10 * math.sqrt(scale))
    # the gradient: central finite differences of the NumPy free energy
    h = 1e-5 * math.sqrt(scale)
    fd = np.empty_like(C)
    for k in range(K):
        for j in range(D):
            Cp, Cm = C.copy(), C.copy()
            Cp[k, j] += h
            Cm[k, j] -= h
            Fp, Fm = free_energy_np(X, w, Cp, T, logp), free_energy_np(X, w, Cm, T, logp)
            fd[k, j] = (Fp - Fm) / (2 * h)
    assert_allclose(grad, fd, rtol=1e-5, atol=1e-6 * np.abs(grad).max())


# ----------------------------------------------------------------------------- section 4
def test_entmax_update_is_exact_at_a_lloyd_fixed_point(rng):
    """At scikit-learn's converged Lloyd centers, ``T <= Delta_min / 2`` makes every entmax-1.5
    responsibility one-hot: soft counts equal the hard counts exactly and the update returns the
    same centers up to float summation order (<= 1e-12 relative; measured ~1e-15). Just above
    the threshold the update moves (the oracle can fail)."""
    from sklearn.cluster import KMeans
    K = 4
    X, _ = blobs(rng, K=K, D=3, n_per=150, sep=6.0)
    w = rng.integers(1, 4, len(X)).astype(np.float64)    # integer weights: exact count sums
    C0 = X[rng.choice(len(X), K, replace=False)]
    km = KMeans(n_clusters=K, init=C0, n_init=1, algorithm="lloyd", tol=0.0,
                max_iter=300).fit(X, sample_weight=w)
    C = km.cluster_centers_
    d = sqdist(X, C)
    labels = np.argmin(d, axis=1)
    assert_array_equal(labels, km.labels_)
    ds = np.sort(d, axis=1)
    dmin = float((ds[:, 1] - ds[:, 0]).min())
    counts = np.bincount(labels, weights=w, minlength=K)
    for T in (0.5 * dmin * (1 - 1e-6), 0.25 * dmin):
        m = fastanneal.moments(X, C, T, weights=w, responsibilities="entmax15")
        assert m.nnz == len(X)                              # every row exactly one-hot
        assert_array_equal(m.N, counts)
        err = np.abs(m.finalize().centers - C).max() / np.abs(C).max()
        assert err <= 1e-12
    m = fastanneal.moments(X, C, 0.6 * dmin, weights=w, responsibilities="entmax15")
    assert m.nnz > len(X)
    assert np.abs(m.finalize().centers - C).max() / np.abs(C).max() > 1e-9


# ----------------------------------------------------------------------------- trace (section 6)
def _check_trace(km, W, K, resp="softmax", mass_constrained=False):
    tr = km.trace_
    d = tr.as_dict()
    n = len(tr)
    assert n >= 2
    assert all(isinstance(v, np.ndarray) and v.shape == (n,) for v in d.values())
    table = tr.to_arrow()
    import pyarrow as pa
    assert isinstance(table, pa.Table)
    assert table.num_rows == n and table.column_names == list(d)
    assert_array_equal(table.column("hard_distortion").to_numpy(), d["hard_distortion"])
    soft = d["temperature"] > 0
    # the soft steps, then the polish record at T = 0 and one per accepted re-allocation
    assert soft.sum() >= 1 and (~soft).sum() >= 1
    assert not soft[np.argmax(~soft):].any()
    if getattr(km, "n_reallocations_", 0) == 0:
        assert (~soft).sum() == 1
    J, F, T = d["hard_distortion"], d["free_energy"], d["temperature"]
    gap = J - F
    assert_allclose(d["certificate_gap"][soft], gap[soft], rtol=1e-12, atol=0)
    tol = 1e-9 * np.maximum(np.abs(J), 1.0)
    if mass_constrained:
        # F_p = -T sum w LSE(log p - d/T) with sum p = 1: J - F_p <= 0, and the recorded
        # lower bound T sum_k J-weight_k log p_k (checked against NumPy in
        # test_mass_constrained_certificate_oracle) must hold
        lower, upper = d["certificate_bound"], np.zeros(n)
        assert np.all(lower[soft] <= 0)
    elif resp == "entmax15":
        lower, upper = np.zeros(n), (4.0 / 3.0) * T * W * (1.0 - K ** -0.5)
    else:
        lower, upper = np.zeros(n), T * W * math.log(K)
    if not mass_constrained:
        assert_allclose(d["certificate_bound"][soft], upper[soft], rtol=1e-12)
    bad = ~((gap >= lower - tol) & (gap <= upper + tol))
    assert not bad[soft].any(), (
        f"certificate violated on records {np.nonzero(bad & soft)[0]}: J - F = "
        f"{gap[bad & soft]}, bounds [{lower[bad & soft]}, {upper[bad & soft]}]")
    assert d["certificate_ok"].all()
    assert np.all(d["entropy"] >= -1e-12) and np.all(d["entropy"] <= math.log(K) + 1e-12)
    assert np.all(d["hardening_gap"] >= -tol)
    assert np.all(np.diff(d["iteration"]) > 0)
    assert np.all(np.diff(d["wall_time"]) >= 0)
    # the final record is the polish pass from the centers before the last Lloyd update
    # (stopped by tolerance): its J is the fitted inertia, up to that last update's gain
    assert km.inertia_ <= J[-1] * (1 + 1e-12)
    assert J[-1] == pytest.approx(km.inertia_, rel=1e-6)


@pytest.mark.parametrize("params", [
    dict(),
    dict(diagnostics="full", schedule="linear"),
    dict(responsibilities="entmax15"),
])
def test_trace_columns_and_certificate(rng, params):
    K = 4
    X, _ = blobs(rng, K=K, D=3, n_per=100, sep=3.0)
    w = rng.uniform(0.5, 2.0, len(X))
    km = AnnealedKMeans(n_clusters=K, random_state=0, n_steps=6, **params).fit(X, sample_weight=w)
    _check_trace(km, w.sum(), K, params.get("responsibilities", "softmax"))


@pytest.mark.parametrize("params", [dict(mass_constrained=True),
                                    dict(mass_constrained=True, diagnostics="full"),
                                    dict(schedule="critical")])
def test_trace_certificate_with_mass_constrained_responsibilities(rng, params):
    """With mass-constrained responsibilities the trace's free energy is
    ``F_p = -T sum w LSE(log p - d/T)``; its certificate is ``T sum_k J-weight_k log p_k <=
    J - F_p <= 0`` (the plain ``0 <= J - F_T <= T W log K`` is for F without the prior)."""
    K = 4
    X, _ = blobs(rng, K=K, D=3, n_per=100, sep=3.0)
    w = rng.uniform(0.5, 2.0, len(X))
    km = AnnealedKMeans(n_clusters=K, random_state=0, n_steps=6, **params).fit(X, sample_weight=w)
    _check_trace(km, w.sum(), K, mass_constrained=True)


def test_mass_constrained_certificate_oracle(rng):
    """NumPy: for random centers, masses p (sum 1) and T over six decades,
    ``T sum_i w_i log p_c(i) <= J - F_p <= 0`` (c(i) the nearest center), and the engine's
    bound equals that lower bound."""
    from fastanneal._engine import certificate_bounds
    X, _ = blobs(rng, K=3, D=3, n_per=60, sep=3.0)
    w = rng.uniform(0.2, 2.0, len(X))
    scale = float(np.trace(weighted_cov(X, w)[0]))
    for T in scale * np.logspace(-3, 3, 7):
        K = int(rng.integers(2, 7))
        C = X[rng.choice(len(X), K, replace=False)] + 0.3 * rng.standard_normal((K, 3))
        logp = np.log(rng.dirichlet(np.ones(K)))
        d = sqdist(X, C)
        J = float(w @ d.min(axis=1))
        F = free_energy_np(X, w, C, T, logp)
        lower = T * float(w @ logp[np.argmin(d, axis=1)])
        tol = 1e-10 * max(abs(J), abs(F), 1.0)
        assert lower - tol <= J - F <= tol
        m = fastanneal.moments(X, C, T, weights=w, log_prior=logp)
        lo, up = certificate_bounds(m, logp)
        assert lo == pytest.approx(lower, rel=1e-10, abs=tol)
        assert up == 0.0
        assert lo - tol <= m.hard_distortion - m.free_energy <= up + tol


# ----------------------------------------------------------------------------- helpers
@pytest.mark.parametrize("fn", ["assign", "pairwise_distances", "responsibilities"])
def test_public_helpers_accept_float32_rows_with_float64_centers(rng, fn):
    """``fastanneal.moments`` casts the centers to the rows' dtype; the other public helpers
    must accept the same mixed input (float32 rows, float64 centers) instead of failing
    inside Numba."""
    X = rng.standard_normal((50, 3)).astype(np.float32)
    C = rng.standard_normal((4, 3))
    extra = (1.0,) if fn == "responsibilities" else ()
    out = getattr(fastanneal, fn)(X, C, *extra)
    ref = getattr(fastanneal, fn)(X, C.astype(np.float32), *extra)
    out, ref = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    for a, b in zip(out, ref):
        assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_lanczos_warm_start_and_tolerance(rng):
    """``power_iteration_eigs(start=, tol=)``: from the top eigenvector itself a loose
    tolerance stops after a few matvecs (three checks, one every two) at the right value; a start orthogonal to the top
    eigenvector still finds it (the random part of a warm start), where a pure warm start
    would converge to lambda_2 (exact arithmetic keeps the Krylov space orthogonal)."""
    from fastanneal import _sources
    D = 40
    lams = np.r_[3.0, 2.0, np.linspace(1.0, 0.1, D - 2)]
    Q, _ = np.linalg.qr(rng.standard_normal((D, D)))
    cov = (Q * lams) @ Q.T
    calls = []

    def matvec(mu, V):
        calls.append(1)
        return V @ cov

    lam, V = _sources.power_iteration_eigs(matvec, np.zeros((1, D)), np.ones(1), 30, rng,
                                           True, tol=1e-4, start=Q[:, :1].T)
    assert lam[0] == pytest.approx(3.0, rel=1e-4)
    assert abs(V[0] @ Q[:, 0]) == pytest.approx(1.0, abs=1e-3)
    warm = len(calls)
    calls.clear()
    lam_cold = _sources.power_iteration_eigs(matvec, np.zeros((1, D)), np.ones(1), 30, rng)
    assert lam_cold[0] == pytest.approx(3.0, rel=1e-9)
    assert warm <= 6 < len(calls)
    # orthogonal start (the top direction of a parent cell is often orthogonal to its
    # child's): the random part finds lambda_1 anyway
    lam = _sources.power_iteration_eigs(matvec, np.zeros((1, D)), np.ones(1), 30, rng,
                                        tol=1e-6, start=Q[:, 1:2].T)
    assert lam[0] == pytest.approx(3.0, rel=1e-4)
    with pytest.raises(ValueError, match="start"):
        _sources.power_iteration_eigs(matvec, np.zeros((1, D)), np.ones(1), 30, rng,
                                      start=np.ones((2, D)))
