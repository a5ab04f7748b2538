"""Gradient solver: Adam on the centers of the separation objective (THEORY.md section 5).

:func:`anneal_gradient` has the calling convention and the result type of
:func:`fastanneal._engine.anneal`; instead of soft Lloyd it takes, at every temperature of the
schedule, ``steps_per_temperature`` Adam steps on the free centers ``C`` of

    L(C) = L_comp - lam * L_sep        (fastanneal.gradient.value_and_grad)

and records the separation-gradient norm ``g_t = ||dL_sep/dC||_F`` in the trace
(``grad_norm``) and in the :class:`~fastanneal.schedules.ScheduleState` it hands to the
schedule (the adaptive schedule feeds back on it). After the schedule it polishes with Lloyd
at ``T = 0`` exactly as the engine does.

Units (everything relative to ``scale``, the mean squared distance of the rows to their
mean, which the estimator computes):

* ``learning_rate`` is the Adam step per coordinate in units of ``sqrt(scale / D)``, the
  RMS spread of one coordinate: Adam's normalized step is at most about ``lr`` per
  coordinate, so one step moves a center by at most about ``learning_rate * sqrt(scale)``
  (Euclidean norm) whatever the temperature (the raw gradient scales like ``1 / T``);
* ``margin`` (``phi="hinge"``) and ``eps`` (``phi="log"``) are in units of ``scale``
  (they are squared distances).

Drift (Euclidean metric): ``L`` depends on the centers only through the responsibilities,
and a sharper partition has a smaller ``L_comp``, so Adam also lowers ``L`` by moving the
centers apart (the logits ``(2 x.c - ||c||^2) / T`` scale like ``||c|| / T``): the effective
temperature falls below ``T`` and the free centers leave the data (their hard objective
grows, the Voronoi partition they induce stays meaningful and the polish starts from it).
On the sphere (cosine) the norm is fixed and there is no drift. ``anchor_weight = rho > 0``
adds ``rho * F_T / W`` (the deterministic-annealing free energy) to the loss; by the envelope
theorem its gradient is exactly ``2 rho (N_k c_k - S_k) / W``, which ties each center to its
soft centroid (one extra moments pass per Adam step). Default 0: the loss as specified.

Adam's moment estimates are reset at every temperature by default (``reset_adam=True``):
the gradient scale jumps with ``1 / T``, and a second moment carried over from a hotter
temperature would make the first steps at the colder one too long.

Not supported here: the mass-constrained prior (``value_and_grad`` has no ``log p``; the
solver ignores ``cfg.mass_constrained``) and sources without rows in memory (the solver needs
``source.X`` and ``source.w``, as :class:`~fastanneal._sources.InMemorySource` has).
With ``metric="cosine"`` (source.metric == 1) the gradient is projected onto the tangent
space of the sphere and the centers are renormalized after each step.
"""
import math
import time

import numpy as np

from . import _engine as E
from ._trace import Trace
from .gradient import value_and_grad
from .schedules import ScheduleState

_RESP_NAMES = {0: "softmax", 1: "entmax15"}


class AdamState:
    """First and second moment estimates of Adam for a (K, D) parameter."""

    def __init__(self, shape):
        self.m = np.zeros(shape)
        self.v = np.zeros(shape)
        self.t = 0

    def reset(self, rows=None):
        if rows is None:
            self.m[:] = 0.0
            self.v[:] = 0.0
            self.t = 0
        else:
            self.m[rows] = 0.0
            self.v[rows] = 0.0


def adam_step(grad, state, lr, betas=(0.9, 0.999), eps=1e-8):
    """One Adam update (Kingma & Ba 2015) of ``state``; returns the step to subtract.

    ``step = lr * mhat / (sqrt(vhat) + eps)`` with bias-corrected moments; the first step is
    ``lr * g / (|g| + eps)``, i.e. ``lr * sign(g)`` per coordinate.
    """
    b1, b2 = betas
    state.t += 1
    state.m *= b1
    state.m += (1.0 - b1) * grad
    state.v *= b2
    state.v += (1.0 - b2) * grad * grad
    mhat = state.m / (1.0 - b1 ** state.t)
    vhat = state.v / (1.0 - b2 ** state.t)
    return lr * mhat / (np.sqrt(vhat) + eps)


def _tangent(G, C):
    """Project the rows of ``G`` onto the tangent spaces of the unit rows of ``C``."""
    return G - C * np.einsum("ij,ij->i", G, C)[:, None]


def anneal_gradient(source, C0, schedule, T_start, T_end, cfg, rng, scale, trace=None,
                    t0=None, state_hook=None, n_iter0=0, step0=0, *, learning_rate=0.05,
                    betas=(0.9, 0.999), steps_per_temperature=10, separation_weight=0.1,
                    phi="identity", margin=None, eps=None, adam_eps=1e-8, reset_adam=True,
                    anchor_weight=0.0):
    """Anneal with Adam on ``L = L_comp - lam * L_sep`` and polish; returns ``EngineResult``.

    Parameters as :func:`fastanneal._engine.anneal` (``source`` must hold its rows as
    ``source.X``, ``source.w``), plus:

    learning_rate : float > 0, default 0.05
        Adam step per coordinate in units of ``sqrt(scale / D)`` (a center moves at most
        about ``learning_rate * sqrt(scale)`` per step).
    betas : (float, float), default (0.9, 0.999)
        Adam's decay rates of the first and second moment estimates.
    steps_per_temperature : int >= 1, default 10
        Adam steps per temperature (fewer when the centers move less than ``cfg.tol``).
    separation_weight : float, default 0.1
        ``lam`` of ``L = L_comp - lam * L_sep`` (0: compactness only).
    phi, margin, eps
        As :func:`fastanneal.gradient.value_and_grad`; ``margin`` and ``eps`` in units of
        ``scale``.
    adam_eps : float, default 1e-8
        Adam's denominator offset (gradient units).
    reset_adam : bool, default True
        Reset Adam's moments at every new temperature.
    anchor_weight : float >= 0, default 0.0
        ``rho``: minimize ``L + rho * F_T / W`` (see the module docstring).

    The trace gets one record per temperature (``diagnostics="summary"``; one per Adam step
    with ``"full"``, at the cost of one extra moments pass per step) whose ``grad_norm`` is
    the separation-gradient norm of the last Adam step; the polish is recorded as in the
    engine (step -1, ``grad_norm`` NaN). ``ScheduleState.grad_norm`` carries the same value.
    """
    t0 = time.perf_counter() if t0 is None else t0
    trace = Trace() if trace is None else trace
    if not (hasattr(source, "X") and hasattr(source, "w")):
        raise ValueError("the gradient solver needs the rows in memory (a source with .X and "
                         ".w, e.g. InMemorySource); use backend='cpu'")
    if cfg.resp not in _RESP_NAMES:
        raise ValueError("the gradient solver needs softmax or entmax15 responsibilities")
    lr = float(learning_rate)
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"learning_rate must be > 0; got {learning_rate!r}")
    b1, b2 = (float(b) for b in betas)
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ValueError(f"betas must be in [0, 1); got {betas!r}")
    n_inner = int(steps_per_temperature)
    if n_inner < 1:
        raise ValueError(f"steps_per_temperature must be >= 1; got {steps_per_temperature!r}")
    lam = float(separation_weight)
    rho = float(anchor_weight)
    if not (math.isfinite(rho) and rho >= 0):
        raise ValueError(f"anchor_weight must be >= 0; got {anchor_weight!r}")
    X, w = source.X, source.w
    metric = source.metric
    metric_name = "cosine" if metric == 1 else "euclidean"
    resp_name = _RESP_NAMES[cfg.resp]
    K = cfg.n_clusters
    D = C0.shape[1]
    vg_kw = dict(lam=lam, phi=phi, weights=w, metric=metric_name, responsibilities=resp_name)
    if margin is not None:
        vg_kw["margin"] = float(margin) * scale
    if eps is not None:
        vg_kw["eps"] = float(eps) * scale
    lr_abs = lr * math.sqrt(scale / max(D, 1))
    C = E._project(np.array(C0, dtype=np.float64), metric)
    tol_abs = cfg.tol * scale / max(D, 1)
    delta = 1e-3 * math.sqrt(scale)
    eps2 = (0.05 * delta) ** 2
    adam = AdamState(C.shape)
    schedule.start(T_start, T_end)
    T = float(T_start)
    step = step0
    n_iter = n_iter0
    relocations_total = 0
    m = None
    g_last = math.nan
    while T is not None:
        if reset_adam:
            adam.reset()
        shift = math.nan
        for _ in range(n_inner):
            res = value_and_grad(X, C, T, **vg_kw)
            g_last = res.separation_grad_norm
            G = res.grad_centers
            if rho:
                # + rho * F_T / W, exact gradient by the envelope theorem (r minimizes F):
                # 2 rho (N_k c_k - S_k) / W; cosine (d = 2 - 2 x.c): -2 rho S_k / W
                ma = source.moments(C, T, cfg.resp, None, hard_sums=False)
                GF = -ma.S if metric == 1 else ma.N[:, None] * C - ma.S
                G = G + (2.0 * rho / ma.weight) * GF
            if metric == 1:
                G = _tangent(G, C)
            Cn = E._project(C - adam_step(G, adam, lr_abs, (b1, b2), adam_eps), metric)
            n_iter += 1
            shift = float(np.max(np.einsum("ij,ij->i", Cn - C, Cn - C)))
            C = Cn
            if cfg.diagnostics == "full":
                mf = source.moments(C, T, cfg.resp, None, hard_sums=False)
                E._record(trace, step, n_iter, T, mf, C, shift, 0, 0, K, t0)
                trace[-1]["grad_norm"] = g_last
            if shift <= tol_abs:
                break
        # one moments pass at the new centers: the record, the entropy, empty clusters
        m = source.moments(C, T, cfg.resp, None, hard_sums=False)
        upd = m.finalize(previous_centers=C)
        relocated = 0
        if upd.empty.any():
            for k in np.nonzero(upd.empty)[0]:
                E._split_largest(C, m.N, k, rng, delta)
                adam.reset(rows=[k, int(np.argmax(m.N))])
                relocated += 1
            C = E._project(C, metric)
        relocations_total += relocated
        dmin, D2 = E.min_center_distance(C)
        dup = E.coincident_groups(D2, eps2)
        if len(dup):
            # coincident centers get identical gradients and would stay together: perturb
            u = rng.standard_normal((len(dup), D))
            u *= delta / np.linalg.norm(u, axis=1, keepdims=True)
            C[dup] += u
            C = E._project(C, metric)
            adam.reset(rows=dup)
        n_distinct = K - len(dup)
        ent = m.objectives()["entropy"]
        if cfg.diagnostics != "full":
            E._record(trace, step, n_iter, T, m, C, shift, relocated, len(dup), K, t0, dmin)
            trace[-1]["grad_norm"] = g_last
        if cfg.progress is not None:
            cfg.progress(step, T, trace[-1])
        if cfg.verbose:
            E.log.info("gradient step %d T=%.4g F=%.6g J=%.6g H=%.3f g=%.4g", step, T,
                       m.free_energy, m.hard_distortion, ent, g_last)
        state = ScheduleState(step=step - step0, T=T, T_start=T_start, T_end=T_end,
                              entropy=ent, grad_norm=g_last, n_distinct=n_distinct,
                              n_clusters=K, extra={"scale": scale})
        if state_hook is not None:
            state_hook(step, C, None, T)
        T = schedule.next_temperature(state)
        step += 1
    T_final = m.temperature
    soft_F = m.free_energy
    soft_obj = m.soft_distortion
    C, n_iter, relocated, converged = E.polish(source, C, T_final, cfg, rng, trace, t0,
                                               n_iter, tol_abs, delta)
    relocations_total += relocated
    return E.EngineResult(centers=C, temperature=T_final, free_energy=soft_F,
                          soft_objective=soft_obj, hard_objective=m.hard_distortion,
                          n_iter=n_iter, n_steps=step, relocations=relocations_total,
                          converged=converged, last_moments=m)
