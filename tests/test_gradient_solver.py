"""The gradient solver (Adam on the centers of L = L_comp - lam L_sep, docs/theory.md section 5).

Oracles: a float64 NumPy evaluation of L written from the definitions, a NumPy Adam
(Kingma & Ba) driven by the gradients of ``value_and_grad`` (which tests/test_gradient.py
checks against finite differences), scikit-learn-free Lloyd via the engine's own soft-Lloyd
path (the two solvers must agree after the T = 0 polish on separated blobs).
"""
import math
import warnings

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal
from sklearn.metrics import adjusted_rand_score

from fastanneal import AnnealedKMeans
from fastanneal._engine import EngineConfig, EngineResult, anneal
from fastanneal._gradient_solver import AdamState, adam_step, anneal_gradient
from fastanneal._sources import InMemorySource
from fastanneal._trace import Trace
from fastanneal.gradient import value_and_grad
from fastanneal.schedules import ConstantSchedule, GeometricSchedule


# ----------------------------------------------------------------------------- oracles
def loss_np(X, w, C, T, lam):
    """L = L_comp - lam L_sep (identity phi, softmax), from the definitions."""
    d = ((X[:, None, :] - C[None, :, :]) ** 2).sum(-1)
    Z = -d / T
    Z -= Z.max(1, keepdims=True)
    r = np.exp(Z)
    r /= r.sum(1, keepdims=True)
    W = w.sum()
    N = w @ r
    mu = (r * w[:, None]).T @ X / N[:, None]
    comp = float((w[:, None] * r * ((X[:, None, :] - mu[None]) ** 2).sum(-1)).sum() / W)
    K = C.shape[0]
    sep = sum(((mu[k] - mu[l]) ** 2).sum() for k in range(K) for l in range(k + 1, K))
    return comp - lam * 2.0 / (K * (K - 1)) * sep


def blobs(rng, n=400, d=4, k=4, sep=8.0):
    """Unit-variance blobs with means on a simplex (pairwise distance ``sep``)."""
    means = np.eye(k, d) * sep / math.sqrt(2.0)
    y = rng.integers(0, k, n)
    return np.ascontiguousarray(means[y] + rng.standard_normal((n, d))), y


def scale_of(X, w=None):
    w = np.ones(len(X)) if w is None else w
    m = w @ X / w.sum()
    return float(w @ ((X - m) ** 2).sum(1) / w.sum())


def setup(rng, k=4, n=400, **kw):
    X, y = blobs(rng, n=n, k=k, **kw)
    w = rng.uniform(0.5, 2.0, len(X))
    return X, y, w, InMemorySource(X, w, 0), scale_of(X, w)


def cfg_(k, **kw):
    kw.setdefault("mass_constrained", False)
    return EngineConfig(n_clusters=k, **kw)


def quiet(fn, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a, **kw)


# ----------------------------------------------------------------------------- Adam
def test_adam_step_matches_numpy_adam():
    rng = np.random.default_rng(0)
    G = [rng.standard_normal((3, 2)) for _ in range(5)]
    st = AdamState((3, 2))
    m = np.zeros((3, 2))
    v = np.zeros((3, 2))
    b1, b2, lr, eps = 0.8, 0.99, 0.1, 1e-8
    for t, g in enumerate(G, 1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        want = lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
        assert_allclose(adam_step(g, st, lr, (b1, b2), eps), want, rtol=1e-13)


def test_gradient_solver_decreases_loss_at_fixed_T():
    rng = np.random.default_rng(1)
    X, y, w, src, scale = setup(rng)
    C0 = X[rng.choice(len(X), 4, replace=False)]
    T, lam = 0.3 * scale, 0.1
    res = anneal_gradient(src, C0, ConstantSchedule(1), T, T, cfg_(4, polish=False, tol=0.0),
                          np.random.default_rng(0), scale, steps_per_temperature=25,
                          learning_rate=0.02, separation_weight=lam)
    assert isinstance(res, EngineResult)
    L0 = loss_np(X, w, C0, T, lam)
    L1 = loss_np(X, w, res.centers, T, lam)
    assert L1 < L0 - 1e-3 * abs(L0)


def test_tiny_learning_rate_follows_the_gradient():
    """First Adam step = lr * sign(g): a descent direction, and the loss falls by
    ``lr_abs * ||g||_1`` to first order (relative error -> 0 with lr)."""
    rng = np.random.default_rng(2)
    X, y, w, src, scale = setup(rng)
    C0 = X[rng.choice(len(X), 4, replace=False)]
    T, lam = 0.5 * scale, 0.2
    g = value_and_grad(X, C0, T, lam=lam, weights=w).grad_centers
    L0 = loss_np(X, w, C0, T, lam)
    errs = []
    for lr in (1e-3, 1e-4, 1e-5):
        res = anneal_gradient(src, C0, ConstantSchedule(1), T, T, cfg_(4, polish=False),
                              np.random.default_rng(0), scale, steps_per_temperature=1,
                              learning_rate=lr, separation_weight=lam)
        lr_abs = lr * math.sqrt(scale / X.shape[1])
        eps_abs = 1e-8 * math.sqrt(scale)          # adam_eps, in the gradient's unit
        step = C0 - res.centers
        assert_allclose(step, lr_abs * g / (np.abs(g) + eps_abs), rtol=1e-8)
        assert_allclose(step, lr_abs * np.sign(g), rtol=1e-5)
        assert np.sum(step * g) > 0                          # descent direction
        dL = loss_np(X, w, res.centers, T, lam) - L0
        pred = -lr_abs * np.abs(g).sum()
        errs.append(abs(dL / pred - 1.0))
    assert errs[-1] < 1e-3 and errs[-1] < errs[0]


def test_adam_trajectory_matches_reference():
    rng = np.random.default_rng(3)
    X, y, w, src, scale = setup(rng, n=200)
    C = X[rng.choice(len(X), 4, replace=False)].copy()
    T, lam, lr, betas = 0.2 * scale, 0.3, 0.05, (0.7, 0.95)
    res = anneal_gradient(src, C, ConstantSchedule(1), T, T, cfg_(4, polish=False, tol=0.0),
                          np.random.default_rng(0), scale, steps_per_temperature=6,
                          learning_rate=lr, betas=betas, separation_weight=lam)
    lr_abs = lr * math.sqrt(scale / X.shape[1])
    m = np.zeros_like(C)
    v = np.zeros_like(C)
    for t in range(1, 7):
        g = value_and_grad(X, C, T, lam=lam, weights=w).grad_centers
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        C = C - lr_abs * (m / (1 - betas[0] ** t)) / (np.sqrt(v / (1 - betas[1] ** t))
                                                      + 1e-8 * math.sqrt(scale))
    assert_allclose(res.centers, C, rtol=1e-9, atol=1e-12 * math.sqrt(scale))


def test_gradient_solver_fit_is_scale_equivariant():
    """Adam's offset is in the gradient's unit (sqrt(scale)): a fit of s * X is s times
    the fit of X, bit for bit for a power-of-two s (an absolute 1e-8 turned Adam's steps
    into plain gradient steps at small scales: ARI 0.16 against the unscaled fit at 2^-30)."""
    rng = np.random.default_rng(4)
    X = rng.normal(size=(600, 3))
    X[:300, 0] += 2.5
    kw = dict(n_clusters=4, solver="gradient", random_state=0)
    ref = quiet(AnnealedKMeans(**kw).fit, X)
    for s in (2.0 ** -30, 2.0 ** 10):
        fit = quiet(AnnealedKMeans(**kw).fit, X * s)
        assert np.array_equal(fit.labels_, ref.labels_), s
        assert_allclose(fit.cluster_centers_, ref.cluster_centers_ * s, rtol=1e-9,
                        atol=1e-9 * s)


def test_lambda_zero_with_polish_matches_lloyd_on_separated_blobs():
    rng = np.random.default_rng(4)
    X, y, w, src, scale = setup(rng, k=4, n=600)
    C0 = np.stack([X[y == k][0] for k in range(4)])          # one seed per blob
    sched = lambda: GeometricSchedule(8)  # noqa: E731
    g = quiet(anneal_gradient, src, C0, sched(), 0.3 * scale, 0.01 * scale, cfg_(4),
              np.random.default_rng(0), scale, steps_per_temperature=5,
              separation_weight=0.0)
    l = quiet(anneal, src, C0, sched(), 0.3 * scale, 0.01 * scale, cfg_(4),
              np.random.default_rng(0), scale)
    assert g.converged and l.converged
    lg, ll = src.assign(g.centers)[0], src.assign(l.centers)[0]
    assert_array_equal(lg, ll)
    assert_allclose(g.centers, l.centers, atol=1e-8 * math.sqrt(scale))
    assert adjusted_rand_score(y, lg) > 0.95


@pytest.mark.parametrize("diagnostics", ["summary", "full"])
def test_grad_norm_recorded_in_trace(diagnostics):
    rng = np.random.default_rng(5)
    X, y, w, src, scale = setup(rng, n=200)
    C0 = X[rng.choice(len(X), 4, replace=False)]
    T0, lam = 0.4 * scale, 0.1
    trace = Trace()
    n_T, n_in = 3, 2
    quiet(anneal_gradient, src, C0, GeometricSchedule(n_T), T0, 0.05 * scale,
          cfg_(4, diagnostics=diagnostics, tol=0.0), np.random.default_rng(0), scale, trace,
          steps_per_temperature=n_in, separation_weight=lam)
    d = trace.as_dict()
    ann = d["step"] >= 0
    assert ann.sum() == (n_T if diagnostics == "summary" else n_T * n_in)
    assert np.all(np.isfinite(d["grad_norm"][ann])) and np.all(d["grad_norm"][ann] > 0)
    assert d["step"][-1] == -1 and np.isnan(d["grad_norm"][-1])   # the polish
    # first record: g of the first Adam step is that of the initial centers at T0
    want = value_and_grad(X, C0, T0, lam=lam, weights=w).separation_grad_norm
    if diagnostics == "full":
        assert d["grad_norm"][0] == pytest.approx(want, rel=1e-12)
    else:   # summary: the last Adam step of the first temperature; check the 1-step case
        tr1 = Trace()
        anneal_gradient(src, C0, ConstantSchedule(1), T0, T0, cfg_(4, polish=False),
                        np.random.default_rng(0), scale, tr1, steps_per_temperature=1,
                        separation_weight=lam)
        assert tr1["grad_norm"][0] == pytest.approx(want, rel=1e-12)


def test_schedule_sees_grad_norm_and_scale():
    rng = np.random.default_rng(6)
    X, y, w, src, scale = setup(rng, n=200)
    seen = []

    class Spy(ConstantSchedule):
        def next_temperature(self, state):
            seen.append(state)
            return super().next_temperature(state)

    trace = Trace()
    anneal_gradient(src, X[:4], Spy(3), 0.2 * scale, 0.2 * scale, cfg_(4, polish=False),
                    np.random.default_rng(0), scale, trace, steps_per_temperature=2)
    assert [s.step for s in seen] == [0, 1, 2]
    assert [s.grad_norm for s in seen] == list(trace["grad_norm"])
    assert all(s.extra["scale"] == scale and 0 <= s.entropy <= math.log(4) for s in seen)


def test_reproducible_from_rng():
    """Coincident seeds force random perturbations; same rng -> identical run."""
    rng = np.random.default_rng(7)
    X, y, w, src, scale = setup(rng, n=300)
    C0 = np.repeat(X[:1], 4, axis=0)

    def run(seed):
        tr = Trace()
        r = quiet(anneal_gradient, src, C0, GeometricSchedule(5), 0.3 * scale, 0.02 * scale,
                  cfg_(4), np.random.default_rng(seed), scale, tr, steps_per_temperature=3)
        return r, tr.as_dict()

    (a, ta), (b, tb), (c, _) = run(11), run(11), run(12)
    assert_array_equal(a.centers, b.centers)
    for col in ("temperature", "entropy", "hard_distortion", "grad_norm"):
        assert_array_equal(ta[col], tb[col])
    assert not np.array_equal(a.centers, c.centers)


def test_cosine_centers_stay_on_the_sphere():
    rng = np.random.default_rng(8)
    X, y = blobs(rng, n=300, d=6, k=3, sep=3.0)
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    w = np.ones(len(X))
    src = InMemorySource(np.ascontiguousarray(X), w, 1)
    scale = float(w @ (2.0 - 2.0 * X @ (w @ X / w.sum())) / w.sum())
    trace = Trace()
    res = quiet(anneal_gradient, src, X[:3], GeometricSchedule(4), 0.2 * scale, 0.02 * scale,
                cfg_(3, polish=False), np.random.default_rng(0), scale, trace,
                steps_per_temperature=3, separation_weight=0.1, anchor_weight=1.0)
    assert_allclose(np.linalg.norm(res.centers, axis=1), 1.0, atol=1e-12)
    assert np.all(np.isfinite(trace["grad_norm"]))


def test_anchor_keeps_centers_with_their_points_at_high_T():
    """Pure L depends on C only through r, so Adam sharpens r by pushing the centers apart
    (the hard objective of the free centers grows); the free-energy anchor keeps them at
    their soft centroids."""
    rng = np.random.default_rng(9)
    X, y, w, src, scale = setup(rng, n=300)
    C0 = np.stack([X[y == k][0] for k in range(4)])
    out = {}
    for rho in (0.0, 1.0):
        out[rho] = anneal_gradient(src, C0, ConstantSchedule(6), 1.0 * scale, 1.0 * scale,
                                   cfg_(4, polish=False), np.random.default_rng(0), scale,
                                   steps_per_temperature=5, anchor_weight=rho)
    W = w.sum()
    J0 = float(w @ ((X[:, None, :] - C0[None]) ** 2).sum(-1).min(1)) / W
    assert out[0.0].hard_objective / W > 3.0 * J0              # drifted away from the data
    assert out[1.0].hard_objective / W < J0                    # stayed with its points


def test_hinge_and_log_phi_run():
    rng = np.random.default_rng(10)
    X, y, w, src, scale = setup(rng, n=200)
    for kw in (dict(phi="hinge", margin=0.5), dict(phi="log", eps=1e-3)):
        r = anneal_gradient(src, X[:4], ConstantSchedule(2), 0.2 * scale, 0.2 * scale,
                            cfg_(4), np.random.default_rng(0), scale,
                            steps_per_temperature=2, separation_weight=0.5, **kw)
        assert np.all(np.isfinite(r.centers))


def test_bad_arguments():
    rng = np.random.default_rng(11)
    X, y, w, src, scale = setup(rng, n=50)

    class NoRows:
        metric = 0

    args = (ConstantSchedule(1), 1.0, 1.0, cfg_(4), np.random.default_rng(0), scale)
    with pytest.raises(TypeError, match="not a moment source"):
        anneal_gradient(NoRows(), X[:4], *args)
    for kw in (dict(learning_rate=0.0), dict(betas=(1.0, 0.9)),
               dict(steps_per_temperature=0), dict(anchor_weight=-1.0)):
        with pytest.raises(ValueError):
            anneal_gradient(src, X[:4], *args, **kw)
    with pytest.raises(ValueError):
        anneal_gradient(src, X[:4], ConstantSchedule(1), 1.0, 1.0, cfg_(4, resp=2),
                        np.random.default_rng(0), scale)


def test_solver_params_are_checked_before_the_fit():
    """Non-finite weights of the loss would make every Adam step NaN (the polish hid it)."""
    rng = np.random.default_rng(12)
    X, y, w, src, scale = setup(rng, n=60)
    args = (ConstantSchedule(1), 1.0, 1.0, cfg_(4), np.random.default_rng(0), scale)
    for kw, msg in ((dict(separation_weight=math.nan), "separation_weight"),
                    (dict(separation_weight=math.inf), "separation_weight"),
                    (dict(phi="hinge", margin=math.inf), "finite margin"),
                    (dict(phi="log", eps=math.inf), "eps"),
                    (dict(adam_eps=0.0), "adam_eps"),
                    (dict(betas=(0.9, 0.99, 0.9)), "two numbers"),
                    (dict(betas=0.9), "two numbers")):
        with pytest.raises(ValueError, match=msg):
            anneal_gradient(src, X[:4], *args, **kw)
    with pytest.raises(ValueError, match="separation_weight"):
        AnnealedKMeans(4, solver="gradient", separation_weight=math.nan).fit(X)


def test_a_center_reached_only_below_the_drop_threshold():
    """One center so far from the data that the moments drop every entry of it (N = 0)
    while the softmax still gives it mass: the gradient's two passes must agree on the
    responsibilities (the forward pass from the moments divided the backward's mass by
    N = 0: ZeroDivisionError). The fit goes through and the far center is relocated."""
    rng = np.random.default_rng(13)
    X = rng.normal(size=(200, 2))
    init = np.array([[0.0, 0.0], [30.0, 0.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        km = AnnealedKMeans(2, init=init, solver="gradient", temperature_start=2.0,
                            random_state=0).fit(X)
    assert np.isfinite(km.cluster_centers_).all() and len(np.unique(km.labels_)) == 2
    # the solver's gradient equals value_and_grad's exact one at that state
    from fastanneal.gradient import value_and_grad_from_source
    from fastanneal import _grad_kernels as G_
    src = InMemorySource(X, np.ones(len(X)), 0)
    assert src.moments(init, 2.0, 0, None).N[1] == 0.0
    got = value_and_grad_from_source(src, init, 2.0, 0, 0.1, G_.PHI_IDENTITY)
    want = value_and_grad(X, init, 2.0, lam=0.1)
    assert not want.empty.any() and not got.empty.any()
    assert_allclose(got.grad_centers, want.grad_centers, rtol=1e-9, atol=1e-300)


@pytest.mark.parametrize("kw, msg", [
    (dict(learning_rate="x"), "learning_rate must be a finite number > 0"),
    (dict(learning_rate=0.0), "learning_rate must be a finite number > 0"),
    (dict(separation_weight="a"), "separation_weight must be a finite number"),
    (dict(phi="log", phi_eps=-1), "phi_eps must be a finite number > 0"),
    (dict(phi="hinge", phi_margin="1"), "phi_margin must be a finite number > 0"),
    (dict(gradient_steps=True), "gradient_steps must be a positive integer"),
])
def test_gradient_parameters_are_named_before_any_pass(kw, msg, monkeypatch):
    from fastanneal import estimator
    called = []
    monkeypatch.setattr(estimator, "data_stats", lambda *a, **k: called.append(1))
    with pytest.raises(ValueError, match=msg):
        AnnealedKMeans(3, solver="gradient", **kw).fit(np.random.default_rng(0).random((30, 2)))
    assert not called


def test_rows_without_spread_fit_cleanly():
    """One distinct point has scale 0: Adam's unit (sqrt(scale)) was 0, every step 0 / 0 --
    a RuntimeWarning, NaN in the trace and the stop rule never firing (202 steps)."""
    for X in (np.ones((5, 3)) * 7.0, np.ones((1, 3))):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            km = AnnealedKMeans(1, solver="gradient", random_state=0).fit(X)
        np.testing.assert_array_equal(km.cluster_centers_, X[:1])
        shifts = [t["center_shift"] for t in km.trace_ if "center_shift" in t]
        assert shifts and np.isfinite(shifts).all()
        assert km.n_iter_ < 100
