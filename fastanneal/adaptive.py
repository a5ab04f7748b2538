"""Adaptive temperature schedule: entropy and gradient-norm feedback (docs/theory.md section 5).

After each temperature step the engine hands the schedule a
:class:`~fastanneal.schedules.ScheduleState` with the mean assignment entropy ``H_t`` and,
with the gradient solver, the separation-gradient norm ``g_t``. The next temperature is

    T_{t+1} = T_t * exp(-eta * (H_t - H*(t)) / sigma_H(t) + beta * (g_t / gbar_t - 1)),

clamped to ``[T_min, T_max]``, where

* ``H*(t)`` is a reference entropy that falls linearly from ``H_0`` at ``t = 0`` to
  ``H_end`` (default 0: hard) at the last step ``t = n_steps - 1``. ``H_0`` is the entropy
  the fit has at its first step, at most ``log K`` (uniform responsibilities; entmax-1.5:
  ``4/3 (1 - K^-1/2)``, the largest Tsallis-1.5 entropy, in which its fits report the
  entropy): a run started above the first critical temperature starts the reference at
  ``log K``; a run started where the assignments are already nearly hard (the estimator's
  ``temperature_start="auto"``) starts it there, instead of reading "too cold" and heating
  the fit above ``T_c``, which undid the seeds it started from;
* ``sigma_H(t)`` is the running standard deviation of the entropies seen so far (all steps,
  Welford), floored at ``sigma_floor * log K`` so that the first steps (one or two samples,
  standard deviation ~ 0) do not divide by ~ 0;
* ``gbar_t`` is an exponential running mean of ``g`` (weight ``grad_smoothing`` on the newest
  value, ``gbar_0 = g_0``).

Signs: entropy above the reference (too hot) makes the exponent negative, so the schedule
cools faster; entropy below the reference (crystallized too early) makes it positive, so the
temperature rises again; a gradient surge (``g_t > gbar_t``) makes the beta term positive,
so the cooling slows. With ``H_t = H*(t)`` and ``g_t = gbar_t`` the temperature is held:
the cooling itself comes from the falling reference. Without a gradient norm (``g_t`` NaN,
as with the Lloyd solver) the beta term is 0.

``T_min = T_min_ratio * scale`` and ``T_max = T_max_ratio * scale`` with ``scale`` the data
scale (mean squared distance to the mean, which the engine passes as
``state.extra["scale"]``); where no scale is given they are relative to ``T_start``.
``T_end`` is not used: the entropy reference decides how cold the run goes. The exponent is
also limited to ``[-max_log_step, max_log_step]`` (at most a factor ``e^max_log_step`` per
step), so that one outlying measurement cannot jump from one clamp to the other.
"""
import math

from .schedules import Schedule, callable_key, check_steps


class AdaptiveSchedule(Schedule):
    """Entropy-tracking temperature schedule with gradient-norm feedback.

    Parameters
    ----------
    n_steps : int, default 30
        Budget: number of temperature steps (the run stops after ``n_steps`` steps) and the
        length over which ``H*`` falls from the first step's entropy to ``H_end``.
    eta : float >= 0, default 1.0
        Gain of the entropy term (per standard deviation of the entropy). Chosen for the
        tracking error ``rms(H_t - H*(t))`` on an anisotropic synthetic set (K = 20, both
        solvers): 0.5 lags more, 2 oscillates.
    beta : float >= 0, default 0.5
        Gain of the gradient-norm term.
    T_min_ratio, T_max_ratio : float, default 0.005 and 50
        Clamps, relative to the data scale (``state.extra["scale"]``), else to ``T_start``.
    H_end : float >= 0, default 0.0
        Reference entropy (nats) at the last step.
    sigma_floor : float > 0, default 0.1
        Floor of ``sigma_H`` as a fraction of ``log K``.
    grad_smoothing : float in (0, 1], default 0.3
        Weight of the newest ``g`` in the running mean ``gbar``.
    max_log_step : float > 0, default 1.0
        Bound on ``|log(T_{t+1} / T_t)|`` before clamping.
    reference : callable or None
        ``reference(t, n_steps, log_K) -> H*`` replaces the linear reference.

    Attributes
    ----------
    history_ : list of dict
        One entry per call of :meth:`next_temperature`: ``step, T, entropy, H_ref, sigma_H,
        grad_norm, grad_mean, entropy_term, grad_term, T_next`` (``T_next`` None at the end).
        An estimator runs a copy of the schedule it is given: after a fit read
        ``estimator.schedule_.history_``.
    """

    def __init__(self, n_steps=30, eta=1.0, beta=0.5, T_min_ratio=0.005, T_max_ratio=50.0,
                 H_end=0.0, sigma_floor=0.1, grad_smoothing=0.3, max_log_step=1.0,
                 reference=None):
        n_steps = check_steps(n_steps, "n_steps")
        for name, v in (("eta", eta), ("beta", beta), ("H_end", H_end)):
            if not (math.isfinite(float(v)) and float(v) >= 0):
                raise ValueError(f"{name} must be a finite number >= 0; got {v!r}")
        if not 0 < float(T_min_ratio) <= float(T_max_ratio) < math.inf:
            raise ValueError("need 0 < T_min_ratio <= T_max_ratio < inf; got "
                             f"{T_min_ratio!r}, {T_max_ratio!r}")
        if not float(sigma_floor) > 0:
            raise ValueError(f"sigma_floor must be > 0; got {sigma_floor!r}")
        if not 0 < float(grad_smoothing) <= 1:
            raise ValueError(f"grad_smoothing must be in (0, 1]; got {grad_smoothing!r}")
        if not 0 < float(max_log_step) < math.inf:
            raise ValueError(f"max_log_step must be a finite number > 0; got {max_log_step!r}")
        if reference is not None and not callable(reference):
            raise TypeError("reference must be callable(t, n_steps, log_K) -> float or None")
        self.n_steps = int(n_steps)
        self.eta = float(eta)
        self.beta = float(beta)
        self.T_min_ratio = float(T_min_ratio)
        self.T_max_ratio = float(T_max_ratio)
        self.H_end = float(H_end)
        self.sigma_floor = float(sigma_floor)
        self.grad_smoothing = float(grad_smoothing)
        self.max_log_step = float(max_log_step)
        self.reference = reference
        self._reset()

    def _reset(self):
        self._n_H = 0
        self._mean_H = 0.0
        self._m2_H = 0.0
        self._gbar = math.nan
        self._H0 = math.nan             # the entropy of the first step (the reference's top)
        self.history_ = []

    def start(self, T_start, T_end):
        super().start(T_start, T_end)
        self._reset()

    def __repr__(self):
        keys = ("n_steps", "eta", "beta", "T_min_ratio", "T_max_ratio", "H_end",
                "sigma_floor", "grad_smoothing", "max_log_step")
        args = [f"{k}={getattr(self, k)!r}" for k in keys]
        if self.reference is not None:          # (the checkpoint key: another reference
            args.append(f"reference={callable_key(self.reference)}")   # is another fit)
        return f"AdaptiveSchedule({', '.join(args)})"

    # ------------------------------------------------------------------ parts of the rule
    def reference_entropy(self, t, log_K):
        """``H*(t)``: linear from ``H_0`` at ``t = 0`` to ``H_end`` at ``t = n_steps - 1``,
        with ``H_0`` the first step's entropy capped at ``log_K`` (``log_K`` before a first
        step was seen); a ``reference`` callable replaces it."""
        if self.reference is not None:
            h = self.reference(t, self.n_steps, log_K)
            try:
                h = float(h)
            except (TypeError, ValueError):
                h = math.nan
            if not math.isfinite(h):
                raise ValueError(f"AdaptiveSchedule's reference({t}, {self.n_steps}, "
                                 f"{log_K:.4g}) returned {h!r}: it must return a finite "
                                 "entropy (nats)")
            return h
        h0 = getattr(self, "_H0", math.nan)
        top = min(h0, log_K) if math.isfinite(h0) else log_K
        s = min(max(t / max(self.n_steps - 1, 1), 0.0), 1.0)
        return top + (min(self.H_end, top) - top) * s

    def bounds(self, state=None):
        """``(T_min, T_max)`` for ``state`` (its ``extra["scale"]``, else ``T_start``)."""
        scale = None
        if state is not None and isinstance(getattr(state, "extra", None), dict):
            scale = state.extra.get("scale")
        try:
            scale = float(scale)
        except (TypeError, ValueError):
            scale = math.nan
        if not (math.isfinite(scale) and scale > 0):
            scale = getattr(self, "T_start", math.nan)
            if state is not None and not (math.isfinite(scale) and scale > 0):
                scale = float(state.T_start)
        return self.T_min_ratio * scale, self.T_max_ratio * scale

    def next_temperature(self, state):
        if not hasattr(self, "T_start"):
            self.start(state.T_start, state.T_end)
        t = int(state.step)
        T = float(state.T)
        H = float(state.entropy)
        g = float(state.grad_norm)
        K = int(state.n_clusters)
        # the reference starts at the largest entropy of the fit's own rule (log K for
        # softmax; entmax-1.5's Tsallis entropy tops out at 4/3 (1 - K^-1/2): against log K
        # its entropy always looked too cold and the schedule heated to its upper clamp)
        extra = getattr(state, "extra", None)
        log_K = (extra.get("entropy_max") if isinstance(extra, dict) else None)
        if log_K is None:
            log_K = math.log(K) if K > 1 else 0.0
        log_K = float(log_K)
        if not math.isfinite(getattr(self, "_H0", math.nan)):
            # the first step's entropy (a state saved by an earlier version has no _H0:
            # its history holds that entropy)
            first = self.history_[0].get("entropy", math.nan) if self.history_ else H
            self._H0 = max(float(first), 0.0) if math.isfinite(first) else math.nan
        # running statistics (they include the current step)
        if math.isfinite(H):
            self._n_H += 1
            d = H - self._mean_H
            self._mean_H += d / self._n_H
            self._m2_H += d * (H - self._mean_H)
        if math.isfinite(g):
            a = self.grad_smoothing
            self._gbar = g if not math.isfinite(self._gbar) else (1 - a) * self._gbar + a * g
        sd = math.sqrt(self._m2_H / (self._n_H - 1)) if self._n_H > 1 else 0.0
        sigma = max(sd, self.sigma_floor * max(log_K, 1e-12))
        H_ref = self.reference_entropy(t, log_K)
        ent_term = -self.eta * (H - H_ref) / sigma if math.isfinite(H) and K > 1 else 0.0
        if math.isfinite(g) and math.isfinite(self._gbar) and self._gbar > 0:
            grad_term = self.beta * (g / self._gbar - 1.0)
        else:
            grad_term = 0.0
        rec = {"step": t, "T": T, "entropy": H, "H_ref": H_ref, "sigma_H": sigma,
               "grad_norm": g, "grad_mean": self._gbar, "entropy_term": ent_term,
               "grad_term": grad_term, "T_next": None}
        self.history_.append(rec)
        if t + 1 >= self.n_steps:
            return None
        expo = min(max(ent_term + grad_term, -self.max_log_step), self.max_log_step)
        T_min, T_max = self.bounds(state)
        T_next = min(max(T * math.exp(expo), T_min), T_max)
        rec["T_next"] = T_next
        return T_next
