"""The annealing engine: one loop for every solver and every backend.

The engine never touches rows: it asks a moment source (:mod:`fastanneal._protocol`) for
additive :class:`~fastanneal.Moments` and updates the centers. What differs between the
solvers is the *update rule* applied at one temperature:

* :class:`EMRule` -- closed-form EM (soft Lloyd), optionally mass-constrained;
* :class:`AdamRule` -- Adam on the separation objective (:mod:`fastanneal._gradient_solver`);
* :class:`StochasticEMRule` -- stochastic EM over mini-batches (:mod:`fastanneal._minibatch`).

Everything around the rule exists once, here: the temperature loop, the critical
(phase-transition) pre-phase, relocation of empty clusters, the handling of coincident
centers, the trace record with its certificate, the checkpointable :class:`AnnealState`
and the Lloyd polish at ``T = 0``. The theory is in ``docs/theory.md``.
"""
import contextlib
import functools
import inspect
import logging
import math
import numbers
import os
import sys
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import numpy as np

from ._trace import Trace
from ._validation import RESPONSIBILITIES
from .schedules import ScheduleState, schedule_attrs

log = logging.getLogger("fastanneal")


@contextlib.contextmanager
def verbose_logging(verbose):
    """``verbose >= 1``: the ``fastanneal`` logger's INFO lines (one per temperature step,
    one per phase) go to stderr for the duration, whatever the logging configuration;
    ``verbose <= 0`` is silent (as scikit-learn's)."""
    import numbers
    if not isinstance(verbose, numbers.Integral):
        raise ValueError("verbose must be an integer (0: silent, >= 1: a log line per "
                         f"temperature step); got {verbose!r}")
    if verbose <= 0:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("fastanneal: %(message)s"))
    old_level, old_prop = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
        log.propagate = old_prop

RESP_ENTMAX15 = RESPONSIBILITIES["entmax15"]
RESP_HARD = RESPONSIBILITIES["hard"]
#: Clusters with soft mass at most this fraction of the total weight are empty (relocated):
#: one threshold for float32 and float64, at float32's resolution.
MIN_MASS = 2.0 ** -24
#: Testing aid: seconds to sleep after each temperature step (kill-and-resume tests).
STEP_DELAY_ENV = "FASTANNEAL_TEST_STEP_DELAY"


#: A near-break-even re-allocation move is tried when its split gains at least this share of
#: what its merge costs at first order (``propose_moves``).
MOVE_SLACK = 0.7
#: ... and at most this many of them, one at a time, since the last kept move.
MAX_SPECULATIVE_MOVES = 3
#: ... and one is kept only when it lowers ``J`` by at least this share (where ``K`` exceeds
#: the number of real groups, near-break-even moves that re-shuffle the pieces of one group
#: gain ~1e-5 each, and there are many of them).
SPECULATIVE_MIN_GAIN = 1e-4
#: Lanczos steps for the cells' top directions in the move statistics (the gain of the cut
#: along whatever direction results is exact): 60 % of the matvecs of the earlier 10, neutral
#: on CLINC150's domains, slightly worse on overlapping Gaussian mixtures (docs/theory.md 6.7).
MOVE_EIG_ITER = 6


class AnnealingWarning(UserWarning):
    """Silent-failure risks: temperature above critical, empty or coincident clusters."""


@dataclass
class EngineConfig:
    n_clusters: int
    resp: int = 0
    mass_constrained: bool = True
    max_iter: int = 4                 # soft-Lloyd iterations per temperature (cap)
    tol: float = 1e-4                 # relative to the mean feature variance
    polish: bool = True
    max_polish_iter: int = 300
    diagnostics: str = "summary"
    verbose: int = 0
    progress: Optional[object] = None  # callable(step, T, record) for progress bars
    reallocate: bool = False          # phase-transition re-allocation moves after the polish
    max_failed_moves: Optional[int] = None   # default 8 (rejected single moves)
    stop_when_hard: bool = True       # end the schedule once it can no longer change anything


@dataclass
class EngineResult:
    centers: np.ndarray
    temperature: float
    free_energy: float
    soft_objective: float
    hard_objective: float
    n_iter: int
    n_steps: int
    relocations: int
    converged: bool
    last_moments: object
    reallocations: int = 0
    hardened_step: Optional[int] = None   # the step after which the schedule was hard
    settled_step: Optional[int] = None    # the step after which it had settled (SETTLE_TOL)


@dataclass
class AnnealState:
    """Everything the engine carries from one temperature step to the next.

    Saved at step boundaries (:mod:`fastanneal._checkpoint`) and resumed from: a resumed run
    repeats the uninterrupted one. ``phase`` is ``"critical"`` (phase-transition pre-phase),
    ``"anneal"``, ``"polish"`` or ``"done"``; ``temperature`` is the temperature of the next
    step; ``step`` its number; ``phase_step0`` the step at which the phase started (the
    schedule sees ``step - phase_step0``).
    """
    centers: np.ndarray
    temperature: float
    T_start: float
    T_end: float
    scale: float
    log_masses: Optional[np.ndarray] = None
    phase: str = "anneal"
    step: int = 0
    phase_step0: int = 0
    n_iter: int = 0
    relocations: int = 0
    rng_state: Optional[dict] = None
    schedule_state: dict = field(default_factory=dict)
    rule_state: dict = field(default_factory=dict)
    last: dict = field(default_factory=dict)     # free energy etc. of the last annealing pass
    converged: bool = False
    # the annealing rule's state when its phase ended (a mini-batch fit reads its running
    # prior and counts after the polish: a fit resumed in or after the polish had lost them)
    anneal_rule_state: dict = field(default_factory=dict)
    last_moments: object = field(default=None, repr=False)   # not saved in checkpoints


# ---------------------------------------------------------------------------- helpers
def perturbation(scale):
    """Norm of the nudge that separates duplicate or relocated centers: ``1e-3 sqrt(scale)``."""
    return 1e-3 * math.sqrt(max(float(scale), 1e-300))


def min_center_distance(C):
    """min_{k != l} ||c_k - c_l|| (inf for K = 1), via the Gram matrix."""
    K = C.shape[0]
    if K < 2:
        return math.inf, np.zeros(0, dtype=np.int64)
    sq = np.einsum("ij,ij->i", C, C)
    D2 = sq[:, None] + sq[None, :] - 2.0 * (C @ C.T)
    np.maximum(D2, 0.0, out=D2)
    np.fill_diagonal(D2, np.inf)
    return float(math.sqrt(D2.min())), D2


def coincident_groups(D2, eps2):
    """Indices of centers that are within ``sqrt(eps2)`` of an earlier center."""
    if D2 is None or len(np.shape(D2)) != 2:
        return np.zeros(0, dtype=np.int64)
    close = np.triu(D2 <= eps2, k=1)
    return np.unique(np.nonzero(close)[1])


#: Centers closer than this fraction of the nudge ``delta`` are coincident.
COINCIDENT_FRACTION = 0.05


def separate_coincident(C, delta, rng, metric):
    """Centers within ``COINCIDENT_FRACTION * delta`` of an earlier one nudged apart by
    random vectors of norm ``delta`` (a duplicate never separates by itself: its
    responsibilities are its twin's). Returns ``(C, dup, dmin, D2)``: ``C`` a new array when
    something moved, the indices moved, and the smallest distance and squared distances
    before the nudge."""
    dmin, D2 = min_center_distance(C)
    dup = coincident_groups(D2, (COINCIDENT_FRACTION * delta) ** 2)
    if len(dup):
        u = rng.standard_normal((len(dup), C.shape[1]))
        u *= delta / np.linalg.norm(u, axis=1, keepdims=True)
        C = C.copy()
        C[dup] += u
        C = _project(C, metric)
    return C, dup, dmin, D2


def _split_largest(C, N, k_empty, rng, delta):
    """Move center ``k_empty`` next to the heaviest cluster (split with a +-delta nudge)."""
    donor = int(np.argmax(N))
    u = rng.standard_normal(C.shape[1])
    u *= delta / max(np.linalg.norm(u), 1e-300)
    C[k_empty] = C[donor] + u
    C[donor] = C[donor] - u
    return donor


def relocate_empty(C, N, empty, rng, delta, metric):
    """Relocate every empty cluster by splitting the heaviest one (its mass is shared).

    ``C`` (K, D) and ``N`` (K,) are updated in place (``N`` of the empty clusters is set to
    0 first); returns ``(C, donors)`` with ``C`` projected for cosine."""
    donors = []
    if not empty.any():
        return C, donors
    N[empty] = 0.0
    for k in np.nonzero(empty)[0]:
        donor = _split_largest(C, N, k, rng, delta)
        N[k] = N[donor] = N[donor] / 2.0
        donors.append(donor)
    return _project(C, metric), donors


def _project(C, metric):
    if metric == 1:
        n = np.linalg.norm(C, axis=1, keepdims=True)
        C = C / np.where(n > 0, n, 1.0)
    return C


def _shift(Cn, C):
    return float(np.max(np.einsum("ij,ij->i", Cn - C, Cn - C)))


def certificate_bounds(m, logp=None):
    """(lower, upper) bounds on ``J - F`` for the record ``m``.

    Plain softmax: ``0 <= J - F_T <= T W log K``. Mass-constrained softmax
    (``F = -T sum w LSE(log p - d/T)``): ``LSE`` lies between ``log p_c(i) - d_min/T`` and
    ``-d_min/T``, so ``T sum_k J-weight_k log p_k <= J - F <= 0`` (``J-weight_k`` the hard
    counts). entmax15: ``0 <= J - F <= (4/3) T W (1 - K^-1/2)``.
    """
    ob = m.objectives()
    if logp is not None and m.responsibilities == "softmax":
        lp = np.where(m.hard_counts > 0, logp, 0.0)
        return float(m.temperature * (m.hard_counts @ lp)), 0.0
    return 0.0, ob["certificate_bound"]


def _record(trace, step, n_iter, T, m, C, shift, relocated, coincident, K, t0, dmin=None,
            logp=None, grad_norm=math.nan):
    ob = m.objectives()
    if dmin is None:
        dmin, _ = min_center_distance(C)
    gap = ob["certificate_gap"]
    lower, upper = certificate_bounds(m, logp)
    bound = upper if logp is None else lower
    tol = 1e-9 * max(abs(ob["hard_distortion"]), 1.0)
    hard = T == 0.0
    trace.append(step=step, iteration=n_iter, temperature=T,
                 entropy=0.0 if hard else ob["entropy"],
                 free_energy=ob["hard_distortion"] if hard else ob["free_energy"],
                 hard_distortion=ob["hard_distortion"],
                 soft_distortion=ob["soft_distortion"],
                 hardening_gap=ob["soft_distortion"] - ob["hard_distortion"],
                 certificate_gap=0.0 if hard else gap,
                 certificate_bound=0.0 if hard else bound,
                 certificate_ok=bool(hard or (lower - tol <= gap <= upper + tol)),
                 min_center_distance=dmin, center_shift=shift, relocations=relocated,
                 coincident=coincident, n_distinct=K - coincident,
                 margin_sum=0.0 if hard else ob["margin_sum"], grad_norm=grad_norm,
                 wall_time=time.perf_counter() - t0)


# ---------------------------------------------------------------------------- context
class Context:
    """What an update rule may use: the source, the configuration, the random generator,
    tolerances relative to the data scale, and the trace."""

    def __init__(self, source, cfg, rng, scale, trace, t0, D):
        self.source = source
        self.cfg = cfg
        self.rng = rng
        self.scale = float(scale)
        self.trace = trace
        self.t0 = t0
        self.metric = source.metric
        self.tol_abs = cfg.tol * scale / max(D, 1)
        self.delta = perturbation(scale)

    def record(self, step, n_iter, T, m, C, shift, relocated=0, coincident=0, dmin=None,
               logp=None, grad_norm=math.nan):
        _record(self.trace, step, n_iter, T, m, C, shift, relocated, coincident,
                self.cfg.n_clusters, self.t0, dmin, logp=logp, grad_norm=grad_norm)


@dataclass
class StepResult:
    """What a rule reports after one temperature: the moments record of the step, the log
    prior it used, the last center shift, relocations and (gradient) the gradient norm."""
    moments: object
    logp: Optional[np.ndarray] = None
    shift: float = math.nan
    relocated: int = 0
    grad_norm: float = math.nan
    record_moments: object = None      # what the trace shows (mini-batch: scaled batch sums)


class EMRule:
    """Soft Lloyd: up to ``cfg.max_iter`` closed-form EM updates per temperature (fewer once
    the centers move less than the tolerance). Mass-constrained when ``st.log_masses`` is
    set. ``critical=True``: the textbook variant of the phase-transition pre-phase (clusters
    of zero mass keep their center, no relocation)."""

    name = "lloyd"
    #: the schedule may end once this rule's update has become Lloyd's (:func:`hardened`)
    stops_when_hard = True

    def __init__(self, critical=False):
        self.critical = critical

    def state_dict(self):
        return {}

    def load_state_dict(self, d):
        pass

    def begin(self, ctx, st):
        pass

    def step(self, ctx, st, T):
        cfg, source = ctx.cfg, ctx.source
        C, logp = st.centers, st.log_masses
        relocated = 0
        shift = math.nan
        m = logp_m = None
        for _ in range(max(1, cfg.max_iter)):
            m = source.moments(C, T, cfg.resp, logp, hard_sums=False)
            logp_m = logp
            upd = m.finalize(previous_centers=C, min_mass=0.0 if self.critical else MIN_MASS)
            Cn = upd.centers
            st.n_iter += 1
            Nk = m.N.copy()
            denom = m.weight
            if not self.critical and upd.empty.any():
                Cn, donors = relocate_empty(Cn, Nk, upd.empty, ctx.rng, ctx.delta, ctx.metric)
                relocated += len(donors)
                denom = Nk.sum()                  # the masses still sum to 1
            elif self.critical:
                Cn = _project(Cn, ctx.metric)
            if logp is not None:
                logp = np.log(np.maximum(Nk / max(denom, 1e-300), 1e-300))
            shift = _shift(Cn, C)
            C = Cn
            if cfg.diagnostics == "full" and not self.critical:
                ctx.record(st.step, st.n_iter, T, m, C, shift, relocated, logp=logp_m)
            if shift <= ctx.tol_abs:
                break
        st.centers, st.log_masses = C, logp
        return StepResult(moments=m, logp=logp_m, shift=shift, relocated=relocated)


# ---------------------------------------------------------------------------- the loop
#: Codevectors closer than ``sqrt(MERGE * T)`` are one effective cluster at temperature ``T``
#: (the Gibbs distribution does not resolve them; docs/theory.md section 9).
MERGE = 0.5


def effective_groups(C, thr2):
    """Groups of codevectors closer than ``sqrt(thr2)`` (single linkage): one effective
    cluster each. Returns a label per codevector (0 .. groups-1, numbered by their first
    codevector)."""
    n = C.shape[0]
    if n < 2:
        return np.zeros(n, dtype=np.int64)
    _, D2 = min_center_distance(C)
    parent = np.arange(n)

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i
    for i, j in zip(*np.nonzero(np.triu(D2 < thr2, 1))):
        ri, rj = find(i), find(j)
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)
    _, lab = np.unique([find(i) for i in range(n)], return_inverse=True)
    return lab.astype(np.int64)


def merge_groups(C, p, lab, metric):
    """``(centers, masses)`` of the effective clusters ``lab`` (mass-weighted means)."""
    k = int(lab.max()) + 1
    m = np.bincount(lab, weights=p, minlength=k)
    S = np.zeros((k, C.shape[1]))
    np.add.at(S, lab, C * p[:, None])
    return _project(S / np.maximum(m, 1e-300)[:, None], metric), m


class _CriticalPhase:
    """Deterministic annealing with phase transitions, as a phase of the engine loop.

    Starts with one effective cluster at the mean. After the EM of each temperature
    (mass-constrained), codevectors closer than ``sqrt(MERGE * T)`` are grouped into
    effective clusters; each effective cluster's own critical temperature
    ``2 lambda_max(C_k)`` is computed (Lanczos on additive moments of its cell), and every
    effective cluster that is a single codevector and has ``T < 2 lambda_max(C_k)`` gets a
    twin along its top eigenvector (half the mass each), largest ``lambda`` first, until
    ``K`` codevectors exist. Twins that have not separated yet are not split again: the
    textbook rule (split every codevector whose cell is unstable) splits coincident twins,
    whose cells are half-spaces through one cluster, in a cascade at one temperature and
    spends the codevectors on a few clusters (docs/theory.md section 9). The temperature is
    held while clusters split and cools by ``cooling`` otherwise; the phase ends once ``K``
    codevectors exist and ``T <= T_end`` (or after ``max_steps``).
    """

    #: Lanczos iterations (matvec passes) of the split test, at most
    lanczos_steps = 30
    #: their tolerance (None: the default of :func:`~fastanneal._sources.power_iteration_eigs`)
    lanczos_tol = None

    def __init__(self, cooling=0.85, max_steps=200):
        self.cooling = float(cooling)
        self.max_steps = int(max_steps)

    def after_step(self, ctx, st, T):
        """Split the unstable effective clusters; returns the number of splits."""
        K = ctx.cfg.n_clusters
        force = T <= st.T_end * self.cooling ** 6
        return self.split(ctx, st, T, K - st.centers.shape[0], force)[0]

    def split(self, ctx, st, T, budget, force=False):
        """Give twins to up to ``budget`` unstable single-codevector effective clusters
        (``force``: the most unstable one even if it is stable). Returns ``(n_split,
        groups)``, the groups being those before the split."""
        C = st.centers
        p = np.asarray(st.rule_state["p"], dtype=np.float64)
        lab = effective_groups(C, MERGE * T)
        self.last_lam = None
        if budget <= 0:
            return 0, lab
        Ce, _ = merge_groups(C, p, lab, ctx.metric)
        lam, V = self._top(ctx, Ce)
        single = np.bincount(lab, minlength=Ce.shape[0]) == 1
        self.last_lam = lam              # the cells' lambda_max (the path's jumps read it)
        unstable = np.nonzero((2.0 * lam > T) & single)[0]
        if unstable.size == 0 and force and single.any():
            unstable = np.nonzero(single)[0][np.argsort(-lam[single])][:1]
        order = unstable[np.argsort(-lam[unstable])][:budget]
        if not order.size:
            return 0, lab
        member = np.empty(Ce.shape[0], dtype=np.int64)
        member[lab[::-1]] = np.arange(C.shape[0])[::-1]      # first codevector per group
        idx = member[order]
        eps = 0.1 * np.sqrt(np.maximum(lam[order], 1e-12 * ctx.scale))[:, None] * V[order]
        C = C.copy()
        newc = C[idx] + eps
        C[idx] -= eps
        st.centers = _project(np.concatenate([C, newc]), ctx.metric)
        p = p.copy()
        p[idx] /= 2.0
        st.rule_state["p"] = np.concatenate([p, p[idx]])
        return int(order.size), lab

    def _top(self, ctx, Ce):
        """``(lam, V)`` of the effective clusters' cells; with ``lanczos_tol`` set, to that
        tolerance and warm-started from the Ritz vectors of the nearest effective clusters
        of the previous call (the cells change little from one temperature to the next)."""
        top = ctx.source.cluster_top_eigenvalues
        kw = {}
        if self.lanczos_tol is not None and _takes(top, "start"):
            kw["tol"] = self.lanczos_tol
            prev = getattr(self, "_prev_top", None)
            if prev is not None:
                C0, V0 = prev
                d2 = (C0 * C0).sum(1)[None, :] - 2.0 * (Ce @ C0.T)
                kw["start"] = V0[np.argmin(d2, axis=1)]
        lam, V = top(Ce, self.lanczos_steps, ctx.rng, return_vectors=True, **kw)
        self._prev_top = (np.array(Ce, copy=True), V)
        return lam, V

    def next_temperature(self, st, T, n_split):
        K_now = st.centers.shape[0]
        K = st.rule_state["K"]
        if (K_now >= K and T <= st.T_end) or st.step + 1 - st.phase_step0 >= self.max_steps:
            return None
        if n_split == 0 or K_now >= K:
            return T * self.cooling
        return T

    def finish(self, ctx, st):
        """Fill up to K by splitting the heaviest clusters (max_steps reached)."""
        K = ctx.cfg.n_clusters
        C, p = st.centers, st.rule_state["p"]
        D = C.shape[1]
        while C.shape[0] < K:
            j = int(np.argmax(p))
            v = ctx.rng.standard_normal(D)
            v *= ctx.delta / np.linalg.norm(v)
            C = np.concatenate([C, (C[j] + v)[None]])
            p[j] /= 2.0
            p = np.concatenate([p, [p[j]]])
        st.centers = _project(C, ctx.metric)


def run(source, st, schedule, cfg, rng, trace=None, t0=None, rule=None, critical=None,
        hook=None):
    """Run (or resume) the annealing described by the state ``st`` and polish.

    ``rule`` is the update rule of the ``"anneal"`` phase (default :class:`EMRule`);
    ``critical`` (a :class:`_CriticalPhase`) runs first when ``st.phase == "critical"``.
    ``hook(st)`` is called at every step boundary (checkpoints) with the state of the next
    step. Returns :class:`EngineResult`.
    """
    from ._protocol import check_source
    check_source(source)
    t0 = time.perf_counter() if t0 is None else t0
    trace = Trace() if trace is None else trace
    rule = EMRule() if rule is None else rule
    D = st.centers.shape[1]
    ctx = Context(source, cfg, rng, st.scale, trace, t0, D)
    delay = float(os.environ.get(STEP_DELAY_ENV, "0") or 0)
    reset = getattr(source, "reset_bounds", None)
    from . import _config
    if reset is not None and (hook is not None or _config.PRUNE_RESET_EACH_STEP):
        # A resumed fit starts without the source's per-row bounds: a fit that saves
        # states forgets them at every step boundary (where it saves), so that resumed or
        # not it takes exactly the same passes (bit-identical). Without checkpoints the
        # bounds live on across steps (pruning the first pass of each step too).
        save = hook

        def hook(st):
            if save is not None:
                save(st)
            reset()
    st.centers = _project(np.array(st.centers, dtype=np.float64), source.metric)
    if st.phase == "critical":
        crit_rule = EMRule(critical=True)
        st.rule_state.setdefault("p", np.ones(st.centers.shape[0]))
        st.rule_state["K"] = cfg.n_clusters
        _loop(ctx, st, crit_rule, None, critical, hook, delay)
        critical.finish(ctx, st)
        # one last temperature with K centers, then the polish (the textbook variant)
        st.phase, st.phase_step0 = "anneal", st.step
        st.temperature = st.last["temperature"]
        st.rule_state = {}
        st.log_masses = _initial_log_masses(cfg)
        st.schedule_state = schedule_state_dict(_OneStep())
        if hook is not None:
            hook(st)
    if st.phase == "anneal":
        if st.schedule_state.get("one_step"):
            schedule = _OneStep()
        elif not st.schedule_state:
            start = getattr(schedule, "start", None)    # (an object with next_temperature
            if start is not None:                       # only: nothing to start)
                start(st.T_start, st.T_end)
        else:
            load_schedule_state(schedule, st.schedule_state)
        rule.load_state_dict(st.rule_state)
        rule.begin(ctx, st)
        _loop(ctx, st, rule, schedule, None, hook, delay)
        st.phase = "polish"
        st.anneal_rule_state = st.rule_state
        st.rule_state = {}
        if hook is not None:
            hook(st)
    elif st.phase in ("polish", "reallocate", "done") and st.schedule_state and \
            not st.schedule_state.get("one_step") and schedule is not None:
        # resumed after the annealing: the schedule object ends as the run left it (the
        # estimator's schedule_ says what ran)
        load_schedule_state(schedule, st.schedule_state)
    res_last = st.last
    if st.phase == "polish":
        polish_state(ctx, st, st.last.get("temperature") or 1.0)  # T of the hard pass: moot
        if len(ctx.trace):
            log.info("polish (Lloyd at T = 0): J=%.6g, %d moment passes so far",
                     ctx.trace[-1]["hard_distortion"], st.n_iter)
        st.phase = "reallocate" if cfg.reallocate else "done"
        st.rule_state = {}
        st.rng_state = ctx.rng.bit_generator.state
        if hook is not None and st.phase == "reallocate":
            hook(st)
    if st.phase == "reallocate":
        reallocate_state(ctx, st, hook)
        st.phase = "done"
        # the moves drew from the generator: a finished state must carry its state as it
        # is now (the estimator saves it, and the next run of n_init, or the probability
        # temperature's sample, continue from it when the fit is resumed)
        st.rng_state = ctx.rng.bit_generator.state
        if len(ctx.trace):
            log.info("re-allocation: %d codevector(s) moved, J=%.6g",
                     int(st.rule_state.get("moves", 0)), ctx.trace[-1]["hard_distortion"])
    return EngineResult(centers=st.centers, temperature=res_last.get("temperature", math.nan),
                        free_energy=res_last.get("free_energy", math.nan),
                        soft_objective=res_last.get("soft_distortion", math.nan),
                        hard_objective=res_last.get("hard_distortion", math.nan),
                        n_iter=st.n_iter, n_steps=res_last.get("n_steps", st.step),
                        relocations=st.relocations, converged=st.converged,
                        last_moments=st.last_moments,
                        reallocations=int(st.rule_state.get("moves", 0))
                        if st.phase == "done" else 0,
                        hardened_step=res_last.get("hardened_step"),
                        settled_step=res_last.get("settled_step"))


def _initial_log_masses(cfg):
    K = cfg.n_clusters
    return np.full(K, -math.log(K)) if cfg.mass_constrained and cfg.resp == 0 else None


def _loop(ctx, st, rule, schedule, critical, hook, delay):
    """The temperature loop (shared by every phase and rule)."""
    cfg = ctx.cfg
    K = cfg.n_clusters
    T = st.temperature
    while T is not None:
        if critical is not None:
            p = st.rule_state["p"]
            st.log_masses = np.log(np.maximum(p, 1e-300)) if cfg.resp == 0 else None
        res = rule.step(ctx, st, T)
        m = res.moments
        if critical is not None:
            st.rule_state["p"] = m.N / max(m.weight, 1e-300)
            n_split = critical.after_step(ctx, st, T)
            if cfg.resp == 0:              # the masses of the split clusters (checkpoints)
                st.log_masses = np.log(np.maximum(st.rule_state["p"], 1e-300))
            dmin, _ = min_center_distance(st.centers)
            n_coinc = K - st.centers.shape[0]
        else:
            st.relocations += res.relocated
            # perturbed duplicates: they separate when T falls below their cluster's T_c
            st.centers, dup, dmin, _ = separate_coincident(st.centers, ctx.delta, ctx.rng,
                                                           ctx.metric)
            if len(dup) and hasattr(rule, "reset_rows"):
                rule.reset_rows(dup)
            n_coinc = len(dup)
        ent = m.objectives()["entropy"]
        if cfg.diagnostics != "full" or critical is not None or res.record_moments is not None:
            ctx.record(st.step, st.n_iter, T, res.record_moments or m, st.centers, res.shift,
                       0 if critical is not None else res.relocated, n_coinc, dmin,
                       logp=res.logp, grad_norm=res.grad_norm)
        elif not math.isnan(res.grad_norm):
            ctx.trace[-1]["grad_norm"] = res.grad_norm
        if cfg.progress is not None:
            cfg.progress(st.step, T, ctx.trace[-1])
        if cfg.verbose:
            log.info("%s step %d T=%.4g F=%.6g J=%.6g H=%.3f distinct=%d",
                     "critical" if critical is not None else rule.name, st.step, T,
                     ctx.trace[-1]["free_energy"], ctx.trace[-1]["hard_distortion"], ent,
                     K - n_coinc)
        rm = res.record_moments or m
        st.last_moments = m
        # the previous step's J (None at the first step of a phase: nothing to compare)
        J_prev = st.last.get("hard_distortion") if st.step > st.phase_step0 else None
        st.last = dict(temperature=float(m.temperature), free_energy=float(rm.free_energy),
                       soft_distortion=float(rm.soft_distortion),
                       hard_distortion=float(rm.hard_distortion), n_steps=st.step + 1)
        if critical is not None:
            T = critical.next_temperature(st, T, n_split)
        else:
            sstate = ScheduleState(step=st.step - st.phase_step0, T=T, T_start=st.T_start,
                                   T_end=st.T_end, entropy=ent, grad_norm=res.grad_norm,
                                   n_distinct=K - n_coinc, n_clusters=K,
                                   extra={"scale": ctx.scale,
                                          "entropy_max": entropy_max(cfg.resp, K)})
            try:
                T_next = schedule.next_temperature(sstate)
            except StopIteration:           # (an iterator the schedule reads ran out)
                raise ValueError(f"{type(schedule).__name__}.next_temperature raised "
                                 f"StopIteration after step {st.step - st.phase_step0}; a "
                                 "schedule ends by returning None") from None
            T = checked_temperature(schedule, T_next, st.step - st.phase_step0)
            st.schedule_state = schedule_state_dict(schedule)
            # the early ends hold because every colder temperature would change nothing: a
            # schedule that goes hotter next (a re-heat, an adaptive step up) runs on
            colder = T is not None and T <= st.last["temperature"]
            if colder and hardened(ctx, st, rule, res, n_coinc):
                st.last["hardened_step"] = int(st.step)
                if cfg.verbose:
                    log.info("hard at step %d (T=%.4g): every row one-hot, centers at a fixed "
                             "point; the colder temperatures are left to the polish",
                             st.step, st.last["temperature"])
                T = None
            elif colder and settled(ctx, st, rule, res, n_coinc, J_prev, ent, dmin):
                st.last["settled_step"] = int(st.step)
                if cfg.verbose:
                    log.info("settled at step %d (T=%.4g): J changed by less than %.0e "
                             "(relative) in that step; the colder temperatures are left to "
                             "the polish", st.step, st.last["temperature"], SETTLE_TOL)
                T = None
        st.step += 1
        st.temperature = T
        st.rule_state = rule.state_dict() if critical is None else st.rule_state
        st.rng_state = ctx.rng.bit_generator.state
        if T is not None and hook is not None:
            hook(st)
        if delay > 0:
            time.sleep(delay)


def entropy_max(resp, K):
    """The largest mean assignment entropy of the rule ``resp`` with ``K`` clusters (all
    centers at one point): ``log K`` (Shannon, softmax), ``4/3 (1 - K^-1/2)`` (Tsallis-1.5,
    entmax-1.5: what its records' entropy is); schedules that feed back on the entropy
    compare it on this scale (``ScheduleState.extra["entropy_max"]``)."""
    if K <= 1:
        return 0.0
    if resp == RESP_ENTMAX15:
        return (4.0 / 3.0) * (1.0 - K ** -0.5)
    return math.log(K)


def checked_temperature(schedule, T, step):
    """The temperature a schedule returned after ``step`` (of its phase): None, or a real
    number that :func:`~fastanneal._validation.check_temperature` accepts; a schedule still
    going ``MAX_STEPS`` temperatures past its ``n_steps`` is stopped with an error (it would
    never end)."""
    from .schedules import MAX_STEPS
    if T is None:
        return None
    name = f"{type(schedule).__name__}.next_temperature"
    if isinstance(T, np.ndarray) and T.ndim == 0:
        T = T[()]
    if isinstance(T, (bool, np.bool_)) or not isinstance(T, numbers.Real):
        raise TypeError(f"{name} returned {T!r} ({type(T).__name__}): a temperature must be "
                        "a number > 0, or None to end the annealing")
    from ._validation import check_temperature
    try:
        T = check_temperature(float(T))       # the one rule of what a temperature is
    except ValueError as e:
        raise ValueError(f"{name} returned T={float(T)!r} after step {step}: {e}; or None to "
                         "end the annealing") from None
    cap = MAX_STEPS + int(getattr(schedule, "n_steps", 0) or 0)
    if step + 1 >= cap:
        raise RuntimeError(f"{name} did not end the annealing after {cap} temperatures "
                           "(it must return None to stop)")
    return T


def hardened(ctx, st, rule, res, n_coinc):
    """True when the rest of the schedule can only repeat Lloyd's update (docs/theory.md
    section 6.8): the step's last pass found every row's responsibilities exactly one-hot
    (``nnz == rows``: each row's other logits below the drop threshold, entmax: margins
    ``>= 2T``), so that pass *was* a Lloyd update; the centers moved less than the
    tolerance; no cluster was relocated or coincident; no mass prior (without one, a
    one-hot row stays one-hot at every colder temperature for the same centers). Each
    colder step would then be one Lloyd pass from a fixed point: the polish does those."""
    if not ctx.cfg.stop_when_hard or not getattr(rule, "stops_when_hard", False):
        return False
    m = res.moments
    if m is None or st.log_masses is not None or res.relocated or n_coinc:
        return False
    rows = int(m.rows)
    return (rows > 0 and int(m.nnz) == rows and math.isfinite(res.shift)
            and res.shift <= ctx.tol_abs)


#: A step that changes the hard distortion ``J`` of its centers by less than this (relative)
#: ends the schedule (:func:`settled`) ...
SETTLE_TOL = 3e-5
#: ... once the rows are nearly decided: mean assignment entropy at most this (nats per unit
#: weight; a row split evenly between two cells has log 2 = 0.69, all centers at the mean
#: log K). 0.1 let the schedule end on a plateau before a late transition on overlapping
#: 2-D clusters (11 of 60 fits worse by > 1e-4, up to 4.5 %); 0.05: 6 of 60, at most 0.23 %,
#: and the same passes on the CLINC150 domains (``benchmarks/study_settle.py``).
SETTLE_ENTROPY = 0.05


def settled(ctx, st, rule, res, n_coinc, J_prev, entropy, dmin):
    """True when the annealing has stopped changing the partition's cost (``docs/theory.md``
    section 6.9), the second way the schedule ends early: the step changed ``J`` (the hard
    distortion of its centers) by less than :data:`SETTLE_TOL` relative to the step before;
    the rows are nearly decided (mean entropy ``<= SETTLE_ENTROPY``); every codevector
    resolves a cell of its own at this temperature (no two closer than ``sqrt(MERGE T)``,
    so no phase transition is pending between them); no relocated or coincident centers and
    no mass prior. The colder steps would then only harden the last boundary rows and move
    ``J`` by even less; the polish (Lloyd) ends the same way. Measured with
    ``benchmarks/study_settle.py``. Same switches as :func:`hardened`."""
    if not ctx.cfg.stop_when_hard or not getattr(rule, "stops_when_hard", False):
        return False
    if J_prev is None or st.log_masses is not None or res.relocated or n_coinc:
        return False
    T = float(st.last["temperature"])
    J = st.last["hard_distortion"]
    return (math.isfinite(J) and math.isfinite(J_prev) and entropy <= SETTLE_ENTROPY
            and dmin * dmin >= MERGE * T and abs(J_prev - J) <= SETTLE_TOL * abs(J))


class _OneStep:
    """Schedule of exactly one temperature (the last one of a critical run)."""

    def __init__(self):
        self.one_step = True

    def start(self, T_start, T_end):
        pass

    def next_temperature(self, state):
        return None


# ---------------------------------------------------------------------------- schedules
def schedule_state_dict(schedule):
    """JSON-able internal state of a schedule (its public and private attributes,
    ``__slots__`` included). NumPy arrays, tuples and dicts with keys other than strings
    are tagged so that :func:`load_schedule_state` gives them back as they were; anything
    else that is not a number, string, bool or None becomes an :class:`Unsaveable` naming
    the attribute (a checkpoint could not give it back: writing one is an error)."""
    out = {}
    for k, v in schedule_attrs(schedule).items():
        if callable(v):
            continue
        try:
            out[k] = _jsonable(v)
        except TypeError as e:
            # (a fit without checkpoints never saves it: only writing the file fails)
            out[k] = Unsaveable(f"{type(schedule).__name__}.{k} cannot be saved in a "
                                f"checkpoint ({e}): keep a schedule's state in numbers, "
                                "strings, lists, tuples, dicts or NumPy arrays, or fit "
                                "without checkpoint=")
    return out


class Unsaveable:
    """A schedule attribute a checkpoint cannot hold; writing one raises ``TypeError``
    with ``message``."""

    def __init__(self, message):
        self.message = message


def load_schedule_state(schedule, d):
    for k, v in d.items():
        if callable(getattr(schedule, k, None)):
            continue
        setattr(schedule, k, _from_jsonable(v))


_TAG = "__fastanneal__"


def _jsonable(v):
    if isinstance(v, np.generic) and v.dtype.kind in "biuf":
        v = v.item()
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    if isinstance(v, np.ndarray):
        if v.dtype.kind not in "biuf":
            raise TypeError(f"an array of dtype {v.dtype}")
        return {_TAG: "ndarray", "dtype": v.dtype.str, "shape": list(v.shape),
                "data": v.ravel().tolist()}
    if isinstance(v, dict):
        if all(isinstance(k, str) for k in v) and _TAG not in v:
            return {k: _jsonable(x) for k, x in v.items()}
        return {_TAG: "dict", "items": [[_jsonable(k), _jsonable(x)] for k, x in v.items()]}
    if isinstance(v, tuple):
        return {_TAG: "tuple", "items": [_jsonable(x) for x in v]}
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    raise TypeError(f"type {type(v).__name__}")


def _from_jsonable(v):
    if isinstance(v, list):
        return [_from_jsonable(x) for x in v]
    if not isinstance(v, dict):
        return v
    tag = v.get(_TAG)
    if tag == "ndarray":
        return np.array(v["data"], dtype=np.dtype(v["dtype"])).reshape(v["shape"])
    if tag == "tuple":
        return tuple(_from_jsonable(x) for x in v["items"])
    if tag == "dict":
        return {_hashable(_from_jsonable(k)): _from_jsonable(x) for k, x in v["items"]}
    return {k: _from_jsonable(x) for k, x in v.items()}


def _hashable(k):
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


# ---------------------------------------------------------------------------- polish
def _lloyd(ctx, st, C, max_iter, T=1.0, source=None):
    """Lloyd at ``T = 0`` (hard moments with hard sums) from ``C`` until the centers stop
    moving (or ``max_iter`` passes), empty clusters relocated. Returns ``(C, mh, shift,
    relocated, converged)`` with ``mh`` the hard moments of the returned centers' last
    assignment (``mh.hard_distortion`` is ``J`` of the centers that pass started from)."""
    source = ctx.source if source is None else source
    converged = False
    relocated = 0
    shift = math.nan
    mh = None
    for _ in range(max_iter):
        mh = source.moments(C, T, RESP_HARD, None, hard_sums=True)
        upd = mh.finalize(previous_centers=C, hard=True)
        st.n_iter += 1
        Cn, donors = relocate_empty(upd.centers, mh.hard_counts.copy(), upd.empty, ctx.rng,
                                    ctx.delta, ctx.metric)
        relocated = len(donors)
        st.relocations += relocated
        shift = _shift(Cn, C)
        C = Cn
        if shift <= ctx.tol_abs * 1e-4 and relocated == 0:
            converged = True
            break
    return C, mh, shift, relocated, converged


def polish_state(ctx, st, T_final, source=None):
    """Lloyd at ``T = 0`` until the centers stop moving, with empty clusters relocated; one
    trace record (step -1). Shared by every solver."""
    if not ctx.cfg.polish:
        st.converged = True
        return
    C, mh, shift, relocated, converged = _lloyd(ctx, st, st.centers, ctx.cfg.max_polish_iter,
                                                T_final, source)
    dmin, _ = min_center_distance(C)
    ctx.record(-1, st.n_iter, 0.0, mh, C, shift, relocated, 0, dmin)
    st.centers, st.converged = C, converged


def cell_value(N, S2, metric):
    """``f`` of hard cells with weights ``N`` and squared norms ``S2 = |S|^2`` of their
    weighted sums: the cell's objective at its best center is ``Q - f`` (Euclidean:
    ``f = |S|^2 / N``, ``Q`` the weighted sum of ``|x|^2``; cosine: ``f = 2 |S|``,
    ``Q = 2 N``). Splitting a cell in two lowers ``J`` by ``f(a) + f(b) - f(a + b)``;
    merging two cells raises it by the same expression (Ward's cost, and its spherical
    analogue)."""
    S2 = np.maximum(S2, 0.0)
    if metric == 1:
        return 2.0 * np.sqrt(S2)
    return S2 / np.maximum(N, 1e-300)


def _sq(S):
    return np.einsum("...j,...j->...", S, S)


def move_statistics(ctx, st, C, W, S):
    """What each re-allocation move would gain or cost, from two passes.

    * ``gain[k]``: how much ``J`` falls when cell ``k`` is cut in two by the hyperplane
      through its mean normal to its top principal direction (Lanczos on the cell's
      covariance about its mean), each half moved to its own mean (exact for that cut;
      Lloyd lowers ``J`` further). The halves come from one hard pass with the ``2K``
      centers ``c_k +- d v_k``: a row of cell ``k`` is nearest to ``c_k + d v_k`` exactly
      when ``(x - c_k).v_k > 0`` (``d``: ``1e-3 sqrt(scale)`` for float32 rows, ``1e-6
      sqrt(scale)`` for float64; rows within about ``d`` of a cell boundary may change
      cells in that pass).
    * ``merge[k]``, ``partner[k]``: the least rise of ``J`` when cell ``k`` is merged into
      another one, and that one (``cell_value``).

    Returns :class:`MoveStats`."""
    K = C.shape[0]
    metric = ctx.metric
    live = W > 0
    M = np.where(live[:, None], S / np.maximum(W, 1e-300)[:, None], C)
    top = ctx.source.cluster_top_eigenvalues
    if _takes_means(top):
        _, V = top(C, MOVE_EIG_ITER, ctx.rng, return_vectors=True, means=M)
    else:                       # a user source without ``means=``: about the centers
        _, V = top(C, MOVE_EIG_ITER, ctx.rng, return_vectors=True)
    if metric == 1:             # on the sphere: the direction within the tangent plane
        V = V - np.einsum("kd,kd->k", V, C)[:, None] * C
        V /= np.maximum(np.linalg.norm(V, axis=1, keepdims=True), 1e-300)
    # offset of the half-centers: as small as the rounding of the distances allows (rows
    # within about d of a cell boundary may change cells in that pass)
    d = ctx.delta * (1.0 if np.dtype(ctx.source.dtype) == np.float32 else 1e-3)
    m2 = ctx.source.moments(_project(np.concatenate([C + d * V, C - d * V]), metric), 1.0,
                            RESP_HARD, None, hard_sums=True)
    st.n_iter += 1
    Np, Nm = m2.hard_counts[:K], m2.hard_counts[K:]
    Sp, Sm = m2.hard_sums[:K], m2.hard_sums[K:]
    # the cell values in units of the total weight (|S|^2 of weighted sums overflowed for
    # weights near 1e150 and underflowed near 1e-200: no move was ever proposed, although
    # only the weights' ratios matter), scaled back at the end
    c = float(np.sum(W))
    c = c if math.isfinite(c) and c > 0 else 1.0
    np_, nm_, sp_, sm_ = Np / c, Nm / c, Sp / c, Sm / c
    gain = c * (cell_value(np_, _sq(sp_), metric) + cell_value(nm_, _sq(sm_), metric)
                - cell_value(np_ + nm_, _sq(sp_ + sm_), metric))
    gain[~((Np > 0) & (Nm > 0))] = 0.0
    # merge costs of all pairs: |S_r + S_l|^2 from the Gram matrix of the cell sums
    Sc, Wc = S / c, W / c
    G = Sc @ Sc.T
    sq = np.diag(G).copy()
    f = cell_value(Wc, sq, metric)
    cost = f[:, None] + f[None, :] - cell_value(Wc[:, None] + Wc[None, :],
                                                sq[:, None] + sq[None, :] + 2.0 * G, metric)
    np.fill_diagonal(cost, np.inf)
    partner = np.argmin(cost, axis=1)
    merge = c * np.maximum(cost[np.arange(K), partner], 0.0)
    return MoveStats(gain, Np, Sp, Nm, Sm, merge, partner, V)


class MoveStats(NamedTuple):
    gain: np.ndarray        #: (K,) fall of J when the cell is cut in two (0: not cut)
    Np: np.ndarray          #: (K,) weight of the half on the side of +v
    Sp: np.ndarray          #: (K, D) its weighted sum
    Nm: np.ndarray          #: (K,) the other half
    Sm: np.ndarray          #: (K, D)
    merge: np.ndarray       #: (K,) least rise of J when the cell is merged into another
    partner: np.ndarray     #: (K,) that other cell
    V: np.ndarray           #: (K, D) unit normals of the cuts


def _takes(fn, name):
    """Whether a source's ``cluster_top_eigenvalues`` accepts the keyword ``name`` (user
    sources written against an earlier protocol may not). Asked at every step of a
    phase-transition schedule: the answer is cached per underlying function
    (``inspect.signature`` was ~4 % of a ``suggest_k`` run)."""
    return _takes_cached(getattr(fn, "__func__", fn), name)


@functools.lru_cache(maxsize=256)
def _takes_cached(fn, name):
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def _takes_means(fn):
    """Whether ``cluster_top_eigenvalues`` accepts ``means=`` (the first protocol did not)."""
    return _takes(fn, "means")


def propose_moves(gain, merge, partner, width, tried, slack=None):
    """Disjoint moves ``(s, r, l)``, best split first: cell ``s`` is split, cell ``r``
    merged into ``l``, when the split gains more than the merge costs. No cell takes part
    in two moves; ``tried`` holds the ``(s, r)`` pairs rejected since the last kept move.

    With ``slack`` (a ratio below 1), the one move of largest ``gain[s] - merge[r]`` among
    those with ``gain[s] >= slack * merge[r]`` (a near-break-even move: at first order it
    costs more than it gains, but Lloyd after it moves the neighbouring centers too, and
    on overlapping data such moves often lower ``J`` by more than the first-order deficit;
    ``docs/theory.md`` section 6.7)."""
    if slack is not None:
        # for each merge, the best split is the first allowed one in falling-gain order:
        # O(K log K + |tried|) (a double loop over all pairs took 0.4 s at K = 1024)
        order_s = [int(s) for s in np.argsort(-gain, kind="stable")]
        best, best_key = None, None
        for r in range(len(merge)):
            l = int(partner[r])
            if l < r and int(partner[l]) == r:
                continue                # the same pair as (l, r): tried once
            m = merge[r]
            if not m < np.inf:
                continue
            for s in order_s:
                if not (gain[s] > 0 and m * slack <= gain[s]):
                    break               # the gains only fall from here
                if s == r or s == l or (s, r) in tried:
                    continue
                key = (m - gain[s], s, r)   # largest gain - merge, then the lowest (s, r)
                if best_key is None or key < best_key:
                    best, best_key = (s, r, l), key
                break
        return [] if best is None else [best]
    order_r = np.argsort(merge, kind="stable")
    used, batch = set(), []
    for s in np.argsort(-gain, kind="stable"):
        if len(batch) >= width:
            break
        s = int(s)
        if s in used or not gain[s] > 0:
            continue
        for r in order_r:
            r = int(r)
            if not merge[r] < gain[s]:
                break
            l = int(partner[r])
            if r == s or l == s or r in used or l in used or (s, r) in tried:
                continue
            batch.append((s, r, l))
            used.update((s, r, l))
            break
    return batch


def reallocate_state(ctx, st, hook=None):
    """Phase-transition re-allocation of codevectors (``docs/theory.md`` section 6.7).

    After annealing, a codevector may sit where two true clusters merged (its cell would
    still split if the annealing went on: its top principal direction separates two
    groups) while two codevectors share one true cluster (merging them costs little).
    Splits made at a high temperature in the wrong place cannot be undone by cooling alone,
    so this phase moves codevectors: from :func:`move_statistics` (the exact gain of cutting
    each cell along its top principal direction, the exact cost of merging each cell into
    its cheapest neighbour) it proposes disjoint moves "split ``s``, merge ``r`` into
    ``l``" wherever the gain exceeds the cost, best first, up to ``K // 4`` at once; the
    two halves' means and the merged mean are the new centers. Lloyd from them (at most 3
    passes to judge) must lower ``J`` or the batch is halved; a single move that fails is
    not proposed again until a move is kept. Once no move gains at first order, up to
    ``MAX_SPECULATIVE_MOVES`` near-break-even single moves (split gain at least
    ``MOVE_SLACK`` x merge cost) are tried since the last kept move, each kept only when
    Lloyd lowers ``J`` by ``SPECULATIVE_MIN_GAIN`` (relative). The phase ends when no move
    is worth proposing or after ``cfg.max_failed_moves`` (default 8) rejected single moves
    in a row, then runs Lloyd to convergence. Every quantity is a pass of the moment source
    (hard moments with hard sums, Lanczos on covariance products), so it runs on every
    backend. The state is saved after each kept batch (resume repeats the proposals
    rejected since then, deterministically).
    """
    cfg = ctx.cfg
    metric = ctx.metric
    K = st.centers.shape[0]
    if K < 2:
        return
    max_fail = cfg.max_failed_moves or 8
    trial_iter = min(cfg.max_polish_iter, 3)           # Lloyd passes to judge a move
    rs = st.rule_state
    if "W" in rs:           # resumed after a kept move: its state, not another Lloyd run
        C, J = st.centers, float(rs["J"])
        W, S = np.asarray(rs["W"], np.float64), np.asarray(rs["S"], np.float64)
        conv = bool(rs["conv"])
    else:
        C, mh, _, _, conv = _lloyd(ctx, st, st.centers, cfg.max_polish_iter)
        W, S, J = mh.hard_counts, mh.hard_sums, mh.hard_distortion
    moves = int(rs.get("moves", 0))
    max_width = max(1, K // 4)                          # moves proposed together
    width = int(rs.get("width", max_width))
    fails = 0
    speculative = 0
    tried = set()
    stats = None
    while fails < max_fail:
        if stats is None:
            stats = move_statistics(ctx, st, C, W, S)
        batch = propose_moves(stats.gain, stats.merge, stats.partner, width, tried)
        need = 1e-9                   # the relative fall of J that keeps a batch
        if not batch and speculative < MAX_SPECULATIVE_MOVES:
            batch = propose_moves(stats.gain, stats.merge, stats.partner, 1, tried,
                                  slack=MOVE_SLACK)
            speculative += len(batch)
            need = SPECULATIVE_MIN_GAIN
        if not batch:
            break
        Cn = C.copy()
        for s, r, l in batch:
            Cn[s] = stats.Sp[s] / stats.Np[s]
            Cn[r] = stats.Sm[s] / stats.Nm[s]
            Cn[l] = (S[r] + S[l]) / max(W[r] + W[l], 1e-300)
        Cn, mhn, shn, reln, convn = _lloyd(ctx, st, _project(Cn, metric), trial_iter)
        if mhn.hard_distortion < J * (1.0 - need):
            C, J, conv = Cn, mhn.hard_distortion, convn
            W, S = mhn.hard_counts, mhn.hard_sums
            moves += len(batch)
            fails = 0
            speculative = 0
            width = min(2 * width, max_width)
            tried.clear()
            stats = None
            dmin, _ = min_center_distance(C)
            ctx.record(-1, st.n_iter, 0.0, mhn, C, shn, reln, 0, dmin)
            st.centers, st.converged = C, conv
            st.rule_state = {"moves": moves, "width": width, "W": W.copy(), "S": S.copy(),
                             "J": J, "conv": bool(conv)}
            st.rng_state = ctx.rng.bit_generator.state
            if hook is not None:
                hook(st)
        elif len(batch) > 1:
            width = max(1, len(batch) // 2)
        else:
            tried.add(batch[0][:2])
            fails += 1
    if not conv:                      # the last kept move was judged before convergence
        C, mh, shift, relocated, conv = _lloyd(ctx, st, C, cfg.max_polish_iter)
        dmin, _ = min_center_distance(C)
        ctx.record(-1, st.n_iter, 0.0, mh, C, shift, relocated, 0, dmin)
    st.centers, st.converged = C, conv
    st.rule_state = {"moves": moves, "width": width}


def polish(source, C, T_final, cfg, rng, trace, t0, n_iter, tol_abs, delta):
    """Compatibility wrapper of :func:`polish_state`: returns ``(C, n_iter, relocations,
    converged)``."""
    D = C.shape[1]
    scale = (delta / 1e-3) ** 2
    ctx = Context(source, cfg, rng, scale, trace, t0, D)
    ctx.tol_abs = tol_abs
    st = AnnealState(centers=C, temperature=T_final, T_start=T_final, T_end=T_final,
                     scale=scale, n_iter=n_iter)
    polish_state(ctx, st, T_final)
    return st.centers, st.n_iter, st.relocations, st.converged


# ---------------------------------------------------------------------------- entry points
def anneal(source, C0, schedule, T_start, T_end, cfg, rng, scale, trace=None, t0=None,
           state_hook=None, n_iter0=0, step0=0, rule=None):
    """Run the schedule from ``C0`` with ``rule`` (default EM) and polish; returns
    :class:`EngineResult`. ``scale`` is the data scale (mean squared distance to the
    mean): tolerances and perturbations are relative to it. ``state_hook(st)`` is called
    at every step boundary with the :class:`AnnealState` of the next step."""
    st = AnnealState(centers=np.asarray(C0, dtype=np.float64), temperature=float(T_start),
                     T_start=float(T_start), T_end=float(T_end), scale=float(scale),
                     log_masses=_initial_log_masses(cfg) if rule is None or
                     getattr(rule, "name", "") == "lloyd" else None,
                     step=step0, phase_step0=step0, n_iter=n_iter0)
    return run(source, st, schedule, cfg, rng, trace, t0, rule=rule, hook=state_hook)


def anneal_critical(source, mean, schedule, T_start, T_end, cfg, rng, scale, trace=None,
                    t0=None, state_hook=None):
    """Deterministic annealing with phase transitions (see :class:`_CriticalPhase`), then
    one temperature with ``K`` centers and the polish."""
    st = critical_state(mean, T_start, T_end, scale)
    crit = _CriticalPhase(getattr(schedule, "cooling", 0.85), getattr(schedule, "max_steps", 200))
    return run(source, st, schedule, cfg, rng, trace, t0, critical=crit, hook=state_hook)


def critical_state(mean, T_start, T_end, scale):
    return AnnealState(centers=np.asarray(mean, dtype=np.float64)[None, :],
                       temperature=float(T_start), T_start=float(T_start), T_end=float(T_end),
                       scale=float(scale), phase="critical", rule_state={"p": np.ones(1)})
