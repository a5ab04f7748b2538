"""Gradient solver: Adam on the centers of the separation objective (docs/theory.md section 5).

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
* ``margin`` (``phi="hinge"``) and ``eps`` (``phi="log"``, default ``1e-12``) are in units
  of ``scale`` (they are squared distances);
* ``adam_eps`` is in units of ``sqrt(scale)``, the unit of the gradient, so that a fit of
  ``s * X`` is ``s`` times the fit of ``X`` (``phi="log"`` excepted: ``log`` of a squared
  distance is not scale-free, so its ``L_sep`` weighs differently at another scale).

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

The gradient comes from two additive passes of the moment source (forward:
``source.grad_forward``, the soft counts and sums with every responsibility kept; backward:
``source.grad_moments``), so the solver runs on every backend (in memory,
Dask, CUDA). Not supported: the mass-constrained prior (``value_and_grad`` has no ``log p``;
the solver ignores ``cfg.mass_constrained``).
With ``metric="cosine"`` (source.metric == 1) the gradient is projected onto the tangent
space of the sphere and the centers are renormalized after each step.
"""
import math

import numpy as np

from . import _engine as E
from .gradient import _PHIS, LOG_EPS_DEFAULT, value_and_grad_from_source
from . import _grad_kernels as G_

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


class AdamRule:
    """The engine's update rule for the gradient solver: ``steps_per_temperature`` Adam
    steps on ``L = L_comp - lam * L_sep`` (+ ``rho F_T / W``) per temperature, then one
    moments pass at the new centers for the record and the relocation of empty clusters.
    Parameters as :func:`anneal_gradient`."""

    name = "gradient"

    def __init__(self, cfg, scale, D, *, learning_rate=0.05, betas=(0.9, 0.999),
                 steps_per_temperature=10, separation_weight=0.1, phi="identity", margin=None,
                 eps=None, adam_eps=1e-8, reset_adam=True, anchor_weight=0.0):
        if cfg.resp not in _RESP_NAMES:
            raise ValueError("the gradient solver needs softmax or entmax15 responsibilities")
        lr = float(learning_rate)
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"learning_rate must be > 0; got {learning_rate!r}")
        try:
            b1, b2 = (float(b) for b in betas)
        except (TypeError, ValueError):
            raise ValueError(f"betas must be two numbers in [0, 1) (Adam's decay rates); got "
                             f"{betas!r}") from None
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"betas must be in [0, 1); got {betas!r}")
        self.n_inner = int(steps_per_temperature)
        if self.n_inner < 1:
            raise ValueError(f"steps_per_temperature must be >= 1; got "
                             f"{steps_per_temperature!r}")
        self.rho = float(anchor_weight)
        if not (math.isfinite(self.rho) and self.rho >= 0):
            raise ValueError(f"anchor_weight must be >= 0; got {anchor_weight!r}")
        try:
            self.pc = _PHIS[phi]
        except (KeyError, TypeError):
            raise ValueError(f"phi must be one of 'identity', 'log', 'hinge'; got "
                             f"{phi!r}") from None
        self.margin = 0.0
        self.eps = 0.0
        if self.pc == G_.PHI_HINGE:
            if margin is None or not 0 < float(margin) < math.inf:
                raise ValueError("phi='hinge' needs a finite margin > 0 (in units of scale); "
                                 f"got {margin!r}")
            self.margin = float(margin) * scale
        elif margin is not None:
            raise ValueError(f"margin applies only to phi='hinge'; got phi={phi!r}")
        if self.pc == G_.PHI_LOG:
            self.eps = (LOG_EPS_DEFAULT if eps is None else float(eps)) * scale
            if not 0 < self.eps < math.inf:
                raise ValueError(f"eps must be a finite number > 0; got {eps!r}")
        elif eps is not None:
            raise ValueError(f"eps applies only to phi='log'; got phi={phi!r}")
        self.lam = float(separation_weight)
        if not math.isfinite(self.lam):
            raise ValueError(f"separation_weight must be finite; got {separation_weight!r}")
        self.adam_eps = float(adam_eps)
        if not 0 < self.adam_eps < math.inf:
            raise ValueError(f"adam_eps must be a finite number > 0; got {adam_eps!r}")
        # in the gradient's own unit, sqrt(scale) (a squared distance differentiated by a
        # center): an absolute offset made the fit depend on the data's scale (at 2^-20 of
        # it Adam's steps became plain gradient steps of ~1e-8)
        # (rows without spread -- one distinct point -- have scale 0: any unit does then,
        # the gradient is 0; a 0 unit made every step 0 / 0 and the trace NaN)
        unit = scale if scale > 0 and math.isfinite(scale) else 1.0
        self.adam_eps *= math.sqrt(unit)
        self.betas = (b1, b2)
        self.reset_adam = bool(reset_adam)
        self.lr_abs = lr * math.sqrt(unit / max(D, 1))
        self.adam = AdamState((cfg.n_clusters, D))

    def state_dict(self):
        return {"adam_m": self.adam.m.copy(), "adam_v": self.adam.v.copy(),
                "adam_t": int(self.adam.t)}

    def load_state_dict(self, d):
        if d:
            self.adam.m = np.array(d["adam_m"], dtype=np.float64)
            self.adam.v = np.array(d["adam_v"], dtype=np.float64)
            self.adam.t = int(d["adam_t"])

    def begin(self, ctx, st):
        pass

    def reset_rows(self, rows):
        self.adam.reset(rows=rows)

    def step(self, ctx, st, T):
        cfg, source, metric = ctx.cfg, ctx.source, ctx.metric
        C = st.centers
        if self.reset_adam:
            self.adam.reset()
        shift = math.nan
        g_last = math.nan
        for _ in range(self.n_inner):
            res = value_and_grad_from_source(source, C, T, cfg.resp, self.lam, self.pc,
                                             self.margin, self.eps)
            g_last = res.separation_grad_norm
            G = res.grad_centers
            if self.rho:
                # + rho * F_T / W, exact gradient by the envelope theorem (r minimizes F):
                # 2 rho (N_k c_k - S_k) / W; cosine (d = 2 - 2 x.c): -2 rho S_k / W
                ma = source.moments(C, T, cfg.resp, None, hard_sums=False)
                GF = -ma.S if metric == 1 else ma.N[:, None] * C - ma.S
                G = G + (2.0 * self.rho / ma.weight) * GF
            if metric == 1:
                G = _tangent(G, C)
            Cn = E._project(C - adam_step(G, self.adam, self.lr_abs, self.betas,
                                          self.adam_eps), metric)
            st.n_iter += 1
            shift = E._shift(Cn, C)
            C = Cn
            if cfg.diagnostics == "full":
                mf = source.moments(C, T, cfg.resp, None, hard_sums=False)
                ctx.record(st.step, st.n_iter, T, mf, C, shift, grad_norm=g_last)
            if shift <= ctx.tol_abs:
                break
        # one moments pass at the new centers: the record, the entropy, empty clusters
        m = source.moments(C, T, cfg.resp, None, hard_sums=False)
        upd = m.finalize(previous_centers=C)
        C, donors = E.relocate_empty(C, m.N.copy(), upd.empty, ctx.rng, ctx.delta, metric)
        for k, donor in zip(np.nonzero(upd.empty)[0], donors):
            self.adam.reset(rows=[k, donor])
        st.centers = C
        return E.StepResult(moments=m, shift=shift, relocated=len(donors), grad_norm=g_last)


def anneal_gradient(source, C0, schedule, T_start, T_end, cfg, rng, scale, trace=None,
                    t0=None, state_hook=None, n_iter0=0, step0=0, **rule_kw):
    """Anneal with Adam on ``L = L_comp - lam * L_sep`` and polish; returns ``EngineResult``.

    Parameters as :func:`fastanneal._engine.anneal`, plus (the :class:`AdamRule`):

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
        Adam's denominator offset, in units of ``sqrt(scale)`` (the gradient's unit).
    reset_adam : bool, default True
        Reset Adam's moments at every new temperature.
    anchor_weight : float >= 0, default 0.0
        ``rho``: minimize ``L + rho * F_T / W`` (see the module docstring).

    The trace gets one record per temperature (``diagnostics="summary"``; one per Adam step
    with ``"full"``, at the cost of one extra moments pass per step) whose ``grad_norm`` is
    the separation-gradient norm of the last Adam step; the polish is recorded as in the
    engine (step -1, ``grad_norm`` NaN). ``ScheduleState.grad_norm`` carries the same value.
    """
    rule = AdamRule(cfg, scale, np.shape(C0)[1], **rule_kw)
    return E.anneal(source, C0, schedule, T_start, T_end, cfg, rng, scale, trace, t0,
                    state_hook=state_hook, n_iter0=n_iter0, step0=step0, rule=rule)
