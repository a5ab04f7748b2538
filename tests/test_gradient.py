"""value_and_grad: the separation objective (docs/theory.md section 5) and its exact gradients.

Oracles, independent of the code under test:

* a float64 NumPy reference of the loss and its parts (direct differences, log-sum-exp,
  entmax-1.5 by sorting), written from the definitions;
* central finite differences of that reference with one Richardson step, in float64, for
  the gradients w.r.t. the centers and the embeddings (relative error <= 1e-6 in norm).

The temperature is set relative to the data scale (``T / median(d)`` from 0.005 to 50). At
low T some rows are placed at a margin of about T between their two nearest centers, so the
gradient w.r.t. the centers is not a vanishing ``exp(-margin / T)`` that finite differences
cannot resolve.
"""
import numba
import numpy as np
import pytest

import fastanneal
from fastanneal import _config
from fastanneal.gradient import Loss, value_and_grad

T_RELS = [0.005, 0.05, 0.5, 5.0, 50.0]
PHIS = ["identity", "log", "hinge"]
METRICS = ["euclidean", "cosine"]
N, D, K = 40, 5, 4
TOL = 1e-6


# --------------------------------------------------------------------------- reference
def ref_entmax15(Z):
    """entmax-1.5 of the rows of Z by sorting (Peters et al. 2019), plain NumPy."""
    Z = Z / 2.0
    Z = Z - Z.max(axis=1, keepdims=True)
    srt = -np.sort(-Z, axis=1)
    rho = np.arange(1, Z.shape[1] + 1)
    mean = np.cumsum(srt, axis=1) / rho
    mean_sq = np.cumsum(srt ** 2, axis=1) / rho
    ss = rho * (mean_sq - mean ** 2)
    tau = mean - np.sqrt(np.clip((1.0 - ss) / rho, 0.0, None))
    support = (tau <= srt).sum(axis=1)
    tau_star = tau[np.arange(Z.shape[0]), support - 1]
    return np.clip(Z - tau_star[:, None], 0.0, None) ** 2, Z - tau_star[:, None]


def ref_loss(X, C, T, lam=1.0, phi="identity", margin=None, eps=1e-12, w=None,
             metric="euclidean", resp="softmax"):
    """(L, L_comp, L_sep, entropy per unit weight, s_kl of the active pairs)."""
    X = np.asarray(X, np.float64)
    C = np.asarray(C, np.float64)
    n, k = X.shape[0], C.shape[0]
    w = np.ones(n) if w is None else np.asarray(w, np.float64)
    W = w.sum()
    if metric == "cosine":
        d = 2.0 - 2.0 * X @ C.T
    else:
        d = ((X[:, None, :] - C[None, :, :]) ** 2).sum(axis=2)
    Z = -d / T
    if resp == "softmax":
        Zs = Z - Z.max(axis=1, keepdims=True)
        logR = Zs - np.log(np.exp(Zs).sum(axis=1, keepdims=True))
        R = np.exp(logR)
        H = -(R * np.where(R > 0, logR, 0.0)).sum(axis=1)
    else:
        R, _ = ref_entmax15(Z)
        R = R / R.sum(axis=1, keepdims=True)
        H = (4.0 / 3.0) * (1.0 - (R ** 1.5).sum(axis=1))
    Nk = w @ R
    active = Nk > 0
    mu = np.zeros_like(C)
    mu[active] = ((w[:, None] * R).T @ X)[active] / Nk[active, None]
    comp = (w[:, None] * R * ((X[:, None, :] - mu[None, :, :]) ** 2).sum(axis=2)).sum() / W
    s_all = []
    total = 0.0
    for a in range(k):
        for b in range(a + 1, k):
            if active[a] and active[b]:
                s = ((mu[a] - mu[b]) ** 2).sum()
                s_all.append(s)
                if phi == "identity":
                    total += s
                elif phi == "log":
                    total += np.log(s + eps)
                else:
                    total += -max(0.0, margin - s)
    sep = 2.0 / (k * (k - 1)) * total if k > 1 else 0.0
    return comp - lam * sep, comp, sep, (w * H).sum() / W, np.array(s_all)


def fd_grad(f, A, h):
    """Central differences of the vector function f at A, one Richardson step (O(h^4))."""
    out = None
    for idx in np.ndindex(A.shape):
        def central(step):
            Ap = A.copy()
            Am = A.copy()
            Ap[idx] += step
            Am[idx] -= step
            return (f(Ap) - f(Am)) / (2.0 * step)
        g = (4.0 * central(h / 2.0) - central(h)) / 3.0
        if out is None:
            out = np.zeros(A.shape + g.shape)
        out[idx] = g
    return out


def rel_err(a, b):
    nb = np.linalg.norm(b)
    assert nb > 0, "reference gradient is exactly zero: the check would be vacuous"
    return np.linalg.norm(a - b) / nb


# --------------------------------------------------------------------------- problems
def _unit(A):
    return A / np.linalg.norm(A, axis=1, keepdims=True)


def make_problem(rng, metric, t_rel, n=N, dim=D, k=K):
    """Random X, C, weights, and T = t_rel * median(d). For t_rel < 1 a third of the rows
    is moved so that their two nearest centers differ by a margin of 0.2 T .. 3 T."""
    X = rng.normal(size=(n, dim))
    C = X[rng.choice(n, k, replace=False)] + 0.5 * rng.normal(size=(k, dim))
    if metric == "cosine":
        X, C = _unit(X), _unit(C)
    d = ((X[:, None, :] - C[None, :, :]) ** 2).sum(axis=2)
    T = t_rel * np.median(d)
    if t_rel < 1:
        for i in rng.choice(n, n // 3, replace=False):
            a, b = np.argsort(d[i])[:2]
            u = C[b] - C[a]
            diff = d[i, a] - d[i, b]
            target = -T * rng.uniform(0.2, 3.0)
            X[i] = X[i] + (target - diff) / (2.0 * (u @ u)) * u
        if metric == "cosine":
            X = _unit(X)
    w = rng.uniform(0.2, 2.0, size=n)
    w[rng.integers(n)] = 0.0
    return X, C, w, T


def step_size(X, C, T):
    """FD step: a small fraction of the length on which the logits change by O(1)."""
    R = np.sqrt(np.median(((X[:, None, :] - C[None, :, :]) ** 2).sum(axis=2)))
    return 2e-4 * min(T / R, 10.0 * R)


def hinge_margin(X, C, T, w, metric, resp):
    """A margin in the widest gap between sorted squared centroid distances: some pairs
    inside, some outside, none near it (the FD stencil must not move a pair across)."""
    s = np.sort(ref_loss(X, C, T, w=w, metric=metric, resp=resp)[4])
    j = 1 + int(np.argmax(np.diff(s)))
    return 0.5 * (s[j - 1] + s[j])


def check_gradients(X, C, T, w, metric, phi, resp, lam, margin=None, tol=TOL):
    kw = dict(lam=lam, phi=phi, margin=margin, w=w, metric=metric, resp=resp)
    res = value_and_grad(X, C, T, lam=lam, phi=phi, margin=margin, weights=w, metric=metric,
                         responsibilities=resp)
    assert isinstance(res, Loss)
    L, comp, sep, ent, s_base = ref_loss(X, C, T, **kw)
    assert res.value == pytest.approx(L, rel=1e-10, abs=1e-12)
    assert res.compactness == pytest.approx(comp, rel=1e-10, abs=1e-12)
    assert res.separation == pytest.approx(sep, rel=1e-10, abs=1e-12)
    assert res.entropy == pytest.approx(ent, rel=1e-9, abs=1e-12)
    if phi == "hinge":
        inside = s_base < margin

    def f(Cp, Xp):
        out = ref_loss(Xp, Cp, T, **kw)
        if phi == "hinge":   # the FD stencil must not cross the margin
            assert np.array_equal(out[4] < margin, inside)
        return np.array([out[0], out[2]])

    h = step_size(X, C, T)
    gC = fd_grad(lambda Cp: f(Cp, X), C, h)
    gX = fd_grad(lambda Xp: f(C, Xp), X, h)
    assert res.grad_centers.shape == C.shape and res.grad_X.shape == X.shape
    e_c = rel_err(res.grad_centers, gC[..., 0])
    e_x = rel_err(res.grad_X, gX[..., 0])
    e_s = abs(res.separation_grad_norm - np.linalg.norm(gC[..., 1])) / np.linalg.norm(gC[..., 1])
    assert e_c <= tol, f"dL/dC relative error {e_c:.3g}"
    assert e_x <= tol, f"dL/dX relative error {e_x:.3g}"
    assert e_s <= tol, f"||dLsep/dC|| relative error {e_s:.3g}"
    return res


# --------------------------------------------------------------------------- softmax FD
@pytest.mark.parametrize("t_rel", T_RELS)
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("phi", PHIS)
def test_softmax_gradients_match_finite_differences(rng, t_rel, metric, phi):
    X, C, w, T = make_problem(rng, metric, t_rel)
    margin = hinge_margin(X, C, T, w, metric, "softmax") if phi == "hinge" else None
    check_gradients(X, C, T, w, metric, phi, "softmax", lam=rng.uniform(0.3, 2.0),
                    margin=margin)


def test_negative_lambda_and_unit_weights(rng):
    X, C, _, T = make_problem(rng, "euclidean", 0.5)
    check_gradients(X, C, T, None, "euclidean", "log", "softmax", lam=-0.8)


# --------------------------------------------------------------------------- entmax FD
def _entmax_problem(rng, metric, t_rel):
    """A problem whose entmax supports stay fixed under the FD stencil, with some rows of
    more than one entry (else the gradient w.r.t. C is zero and the check vacuous)."""
    for _ in range(50):
        X, C, w, T = make_problem(rng, metric, t_rel)
        d = ((X[:, None, :] - C[None, :, :]) ** 2).sum(axis=2)
        if metric == "cosine":
            d = 2.0 - 2.0 * X @ C.T
        P, gap = ref_entmax15(-d / T)
        # |z/2 - tau| of every entry vs 2x the largest change the stencil can make to it
        h = step_size(X, C, T)
        reach = 4.0 * h * np.sqrt(d.max()) / T
        if np.abs(gap).min() > 3.0 * reach and ((P > 0).sum(axis=1) > 1).sum() >= 3:
            return X, C, w, T
    raise AssertionError("no problem with a locally constant entmax support in 50 draws")


@pytest.mark.parametrize("t_rel", [0.05, 0.5, 5.0])
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("phi", ["identity", "log"])
def test_entmax_gradients_match_finite_differences(rng, t_rel, metric, phi):
    X, C, w, T = _entmax_problem(rng, metric, t_rel)
    check_gradients(X, C, T, w, metric, phi, "entmax15", lam=rng.uniform(0.3, 2.0))


def test_entmax_hinge_gradients(rng):
    X, C, w, T = _entmax_problem(rng, "euclidean", 0.5)
    margin = hinge_margin(X, C, T, w, "euclidean", "entmax15")
    check_gradients(X, C, T, w, "euclidean", "hinge", "entmax15", lam=1.3, margin=margin)


def test_entmax_low_temperature_value(rng):
    X, C, w, T = make_problem(rng, "euclidean", 0.005)
    res = value_and_grad(X, C, T, weights=w, responsibilities="entmax15", lam=0.5)
    ref = ref_loss(X, C, T, lam=0.5, w=w, resp="entmax15")
    assert res.value == pytest.approx(ref[0], rel=1e-10)
    assert 0.0 <= res.entropy < (4.0 / 3.0) * (1 - K ** -0.5)


# --------------------------------------------------------------------------- API
def test_unpacking_and_fields(rng):
    X, C, w, T = make_problem(rng, "euclidean", 0.5)
    res = value_and_grad(X, C, T, lam=0.3, weights=w)
    loss, gC, gX = res[:3]
    assert loss == res.value and gC is res.grad_centers and gX is res.grad_X
    assert res.value == pytest.approx(res.compactness - 0.3 * res.separation, rel=1e-12)
    assert gC.dtype == np.float64 and gX.dtype == np.float64
    assert res.empty.dtype == bool and not res.empty.any()
    assert 0.0 <= res.entropy <= np.log(K) + 1e-12
    # the separation gradient is the lam-slope of dL/dC
    r0 = value_and_grad(X, C, T, lam=0.0, weights=w)
    r1 = value_and_grad(X, C, T, lam=1.0, weights=w)
    assert np.linalg.norm(r0.grad_centers - r1.grad_centers) == pytest.approx(
        res.separation_grad_norm, rel=1e-9)
    assert r0.separation_grad_norm == pytest.approx(res.separation_grad_norm, rel=1e-12)


def test_weights_equal_repetition(rng):
    X, C, _, T = make_problem(rng, "euclidean", 0.5, n=12)
    reps = rng.integers(1, 4, size=12)
    a = value_and_grad(X, C, T, weights=reps.astype(float), phi="log")
    b = value_and_grad(np.repeat(X, reps, axis=0), C, T, phi="log")
    assert a.value == pytest.approx(b.value, rel=1e-12)
    np.testing.assert_allclose(a.grad_centers, b.grad_centers, rtol=1e-10, atol=1e-13)
    # dL/dx of a repeated row, summed over its copies, is the weighted row's gradient
    summed = np.add.reduceat(b.grad_X, np.r_[0, np.cumsum(reps)[:-1]], axis=0)
    np.testing.assert_allclose(a.grad_X, summed, rtol=1e-10, atol=1e-13)


def test_float32_close_to_float64(rng):
    X, C, w, T = make_problem(rng, "euclidean", 0.5, n=300)
    X32 = X.astype(np.float32)
    r32 = value_and_grad(X32, C.astype(np.float32), T, weights=w, phi="log", lam=0.7)
    assert r32.grad_X.dtype == np.float32 and r32.grad_centers.dtype == np.float64
    # same float32 data in float64: only the final rounding of grad_X differs
    r64 = value_and_grad(X32.astype(np.float64), C.astype(np.float32), T, weights=w,
                         phi="log", lam=0.7)
    assert r32.value == r64.value
    np.testing.assert_array_equal(r32.grad_centers, r64.grad_centers)
    np.testing.assert_allclose(r32.grad_X, r64.grad_X, rtol=1e-6,
                               atol=1e-6 * np.abs(r64.grad_X).max())
    # and close to the unrounded float64 problem
    r = value_and_grad(X, C, T, weights=w, phi="log", lam=0.7)
    assert r32.value == pytest.approx(r.value, rel=1e-5)
    assert rel_err(r32.grad_centers, r.grad_centers) < 1e-4
    assert rel_err(r32.grad_X.astype(np.float64), r.grad_X) < 1e-4


@pytest.mark.parametrize("resp", ["softmax", "entmax15"])
def test_blocks_and_threads_do_not_change_the_result(rng, monkeypatch, resp):
    X, C, w, T = make_problem(rng, "euclidean", 0.05, n=2000, dim=7, k=6)
    ref = ref_loss(X, C, T, lam=0.4, phi="log", w=w, resp=resp)
    base = value_and_grad(X, C, T, lam=0.4, phi="log", weights=w, responsibilities=resp)
    assert base.value == pytest.approx(ref[0], rel=1e-10)
    monkeypatch.setattr(_config, "CPU_BLOCK_ROWS", 7)
    nth = numba.get_num_threads()
    try:
        for threads in sorted({1, nth}):
            numba.set_num_threads(threads)
            r = value_and_grad(X, C, T, lam=0.4, phi="log", weights=w, responsibilities=resp)
            assert r.value == pytest.approx(base.value, rel=1e-12)
            assert rel_err(r.grad_centers, base.grad_centers) < 1e-11
            assert rel_err(r.grad_X, base.grad_X) < 1e-12
    finally:
        numba.set_num_threads(nth)


@pytest.mark.parametrize("resp", ["softmax", "entmax15"])
def test_empty_cluster_is_left_out(rng, resp):
    X, C, w, T = make_problem(rng, "euclidean", 0.5)
    C[2] = 1e3   # far from every row: zero soft mass (exp underflows; entmax is exact 0)
    res = value_and_grad(X, C, T, weights=w, phi="log", lam=0.9, responsibilities=resp)
    assert res.empty.tolist() == [False, False, True, False]
    np.testing.assert_array_equal(res.grad_centers[2], 0.0)
    assert np.isfinite(res.grad_X).all() and np.isfinite(res.grad_centers).all()
    ref = ref_loss(X, C, T, lam=0.9, phi="log", w=w, resp=resp)
    assert res.value == pytest.approx(ref[0], rel=1e-10)
    assert res.separation == pytest.approx(ref[2], rel=1e-10)


def test_single_center_has_no_separation(rng):
    X, C, w, T = make_problem(rng, "euclidean", 0.5)
    res = value_and_grad(X, C[:1], T, weights=w, phi="log")
    assert res.separation == 0.0 and res.separation_grad_norm == 0.0
    assert res.entropy == 0.0
    np.testing.assert_allclose(res.grad_centers, 0.0, atol=1e-12)
    xbar = w @ X / w.sum()
    np.testing.assert_allclose(res.grad_X, 2 * w[:, None] / w.sum() * (X - xbar), atol=1e-12)


def test_collapsed_centers_are_finite(rng):
    X, _, w, T = make_problem(rng, "euclidean", 0.5)
    C = np.repeat((w @ X / w.sum())[None], K, axis=0)
    res = value_and_grad(X, C, T, weights=w, phi="log", lam=1.0)
    assert np.isfinite(res.value) and np.isfinite(res.grad_centers).all()
    assert res.separation == pytest.approx(np.log(1e-12), rel=1e-6)


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(T=0.0), ValueError, "temperature"),
    (dict(T=-1.0), ValueError, "temperature"),
    (dict(T=np.nan), ValueError, "temperature"),
    (dict(phi="square"), ValueError, "phi must be"),
    (dict(phi="hinge"), ValueError, "needs a margin"),
    (dict(phi="hinge", margin=-1.0), ValueError, "margin must be > 0"),
    (dict(margin=1.0), ValueError, "only to phi='hinge'"),
    (dict(eps=1e-3), ValueError, "only to phi='log'"),
    (dict(phi="log", eps=0.0), ValueError, "eps must be > 0"),
    (dict(metric="manhattan"), ValueError, "metric"),
    (dict(responsibilities="hard"), ValueError, "no gradient"),
    (dict(lam=np.inf), ValueError, "lam"),
    (dict(lam="1"), TypeError, "lam"),
    (dict(weights=np.ones(3)), ValueError, "weights"),
    (dict(weights=-np.ones(N)), ValueError, "negative"),
    (dict(weights=np.zeros(N)), ValueError, "sum to 0"),
    (dict(metric="cosine"), ValueError, "unit-norm"),
])
def test_invalid_input(rng, kwargs, exc, match):
    X = 3.0 * rng.normal(size=(N, D))
    C = 3.0 * rng.normal(size=(K, D))
    kw = dict(T=1.0)
    kw.update(kwargs)
    with pytest.raises(exc, match=match):
        value_and_grad(X, C, **kw)


def test_invalid_arrays(rng):
    X = rng.normal(size=(N, D))
    C = rng.normal(size=(K, D))
    with pytest.raises(ValueError, match="features"):
        value_and_grad(X, C[:, :3], 1.0)
    bad = X.copy()
    bad[5, 2] = np.nan
    with pytest.raises(ValueError, match="X contains NaN"):
        value_and_grad(bad, C, 1.0)
    badc = C.copy()
    badc[1, 0] = np.inf
    with pytest.raises(ValueError, match="centers contains infinity"):
        value_and_grad(X, badc, 1.0)
    with pytest.raises(ValueError, match="0 samples"):
        value_and_grad(X[:0], C, 1.0)
    with pytest.raises(ValueError, match="2-D"):
        value_and_grad(X[0], C, 1.0)
    w = np.ones(N)
    w[3] = np.nan
    with pytest.raises(ValueError, match="weights contains NaN"):
        value_and_grad(X, C, 1.0, weights=w)


def test_rows_far_from_the_origin(rng):
    """L and both gradients do not change when X and C move together; rows far from the
    origin relative to their spread are measured from their mean (docs/theory.md section
    7), so the GEMM-form distances keep their precision (uncentered: 4 % error at 1e7)."""
    X = rng.normal(size=(300, 3))
    C = rng.normal(size=(4, 3))
    ref = value_and_grad(X, C, 0.5, lam=0.3)
    for off in (1e5, 1e7):
        got = value_and_grad(X + off, C + off, 0.5, lam=0.3)
        assert got.value == pytest.approx(ref.value, rel=1e-8)
        np.testing.assert_allclose(got.grad_centers, ref.grad_centers, rtol=1e-6,
                                   atol=1e-7 * np.abs(ref.grad_centers).max())
        np.testing.assert_allclose(got.grad_X, ref.grad_X, rtol=1e-6,
                                   atol=1e-7 * np.abs(ref.grad_X).max())


def test_float32_rows_off_the_origin_get_the_gradient_of_their_own_numbers():
    """The kernels compute in float64 whatever the rows' dtype: float32 rows a few spreads
    from the origin were re-centered in float32 (float32's threshold), so the gradient was
    that of rounded, shifted rows (grad_centers 2.8e-6 off the float64 result of the same
    numbers). Now the same numbers give the same value and center gradient bit for bit, and
    grad_X to float32 rounding -- also far from the origin, where both are centered."""
    g = np.random.default_rng(1)
    base = g.normal(size=(300, 16)) + 3 * g.integers(0, 3, (300, 1))
    for off in (0.0, 1e4):
        X32 = (base + off).astype(np.float32)
        X64 = X32.astype(np.float64)
        C = X64[:5] + 0.3
        a = value_and_grad(X32, C, 0.1, lam=0.5)
        b = value_and_grad(X64, C, 0.1, lam=0.5)
        assert a.grad_X.dtype == np.float32
        assert a.value == b.value
        np.testing.assert_array_equal(a.grad_centers, b.grad_centers)
        np.testing.assert_allclose(a.grad_X, b.grad_X, rtol=0,
                                   atol=1.2e-7 * np.abs(b.grad_X).max())


def test_entropy_is_finite_at_the_smallest_temperatures():
    """A center so far that exp(-d/T) is 0 (z = -inf): its 0 * z term was NaN."""
    X = np.array([[0.0], [1.0]])
    C = np.array([[0.0], [50.0]])
    for T in (1e-305, 1e-300, 1e-3):
        r = value_and_grad(X, C, T)
        assert np.isfinite(r.entropy) and r.entropy >= 0.0
        assert np.isfinite(r.value) and np.isfinite(r.grad_centers).all()


@pytest.mark.parametrize("factor", [1e-310, 1e300])
def test_scale_of_the_weights_does_not_matter(rng, factor):
    """The loss is invariant to a common factor of the weights; subnormal or huge weights
    must not overflow 1/W or W (inf/NaN gradients before)."""
    X = rng.normal(size=(200, 3))
    C = rng.normal(size=(3, 3))
    w = rng.uniform(1.0, 2.0, 200)
    ref = value_and_grad(X, C, 1.0, lam=0.5, weights=w)
    got = value_and_grad(X, C, 1.0, lam=0.5, weights=w * factor)
    tol = 1e-6 if factor < 1e-300 else 1e-12       # subnormal weights keep fewer digits
    assert got.value == pytest.approx(ref.value, rel=tol)
    assert got.entropy == pytest.approx(ref.entropy, rel=tol)
    np.testing.assert_allclose(got.grad_centers, ref.grad_centers, rtol=tol, atol=0)
    np.testing.assert_allclose(got.grad_X, ref.grad_X, rtol=tol,
                               atol=tol * np.abs(ref.grad_X).max())


def test_temperature_below_the_smallest_normal_float_is_refused(rng):
    """-d/T overflows to -inf for every entry (NaN responsibilities) below it."""
    X = rng.normal(size=(20, 3))
    with pytest.raises(ValueError, match="smallest normal"):
        value_and_grad(X, X[:2].copy(), 5e-324)
    import fastanneal
    with pytest.raises(ValueError, match="smallest normal"):
        fastanneal.moments(X, X[:2], 1e-310)


def test_a_center_reached_only_by_vanishing_responsibilities_has_no_wild_gradient():
    """Responsibilities below the smallest normal float64 kept a few significant bits:
    the soft centroid ``S_k / N_k`` of a center only they reach came out wrong (0.9 ->
    1.0) and its gradient exploded as T fell by 2 % (norm 7.8e-6 -> 8.9 -> 572, the
    separation term jumping with it). Such entries are dropped in both passes now."""
    rng = np.random.default_rng(0)
    X = np.r_[rng.normal(size=(50, 2)) * 0.3 + [-3, 0], rng.normal(size=(50, 2)) * 0.3 + [3, 0]]
    C = np.array([[-3.0, 0.0], [3.0, 0.0], [0.0, 6.0]])
    d = ((X[:, None] - C[None]) ** 2).sum(-1)
    gap = float((d[:, 2] - d.min(1)).min())
    seps, norms = [], []
    for ratio in (600, 650, 700, 730, 740, 744):
        r = fastanneal.value_and_grad(X, C, gap / ratio)
        assert np.isfinite(r.value) and np.isfinite(r.grad_centers).all()
        seps.append(r.separation)
        norms.append(float(np.linalg.norm(r.grad_centers[2])))
    assert max(norms) < 1e-3
    # the separation term takes one of two values: with the far center's centroid, or
    # (once it is out of reach) without it -- nothing in between
    assert all(min(abs(s - seps[0]), abs(s - seps[-1])) < 1e-6 * seps[0] for s in seps)


def test_gradient_inputs_at_the_edges():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(30, 3))
    C = rng.normal(size=(4, 3))
    with pytest.raises(ValueError, match="too small for this data"):
        fastanneal.value_and_grad(X * 1e30, C * 1e30, 1e-250)
    # centers near 0 against unit-scale rows are harmless (they were "too small")
    res = fastanneal.value_and_grad(X, C * 1e-200, 1.0)
    assert np.isfinite(res.value) and np.isfinite(res.grad_centers).all()
    with pytest.raises(ValueError, match="anchor_weight must be a finite number"):
        fastanneal.AnnealedKMeans(4, solver="gradient", anchor_weight="x").fit(X)
    # weights summing to less than 2^-1000: a clear error, not NaN gradients
    with pytest.raises(ValueError, match=r"the weights sum to .* multiply sample_weight"):
        fastanneal.AnnealedKMeans(4, solver="gradient", polish=False, reallocate=False,
                                  random_state=0).fit(X, sample_weight=np.full(30, 1e-305))
