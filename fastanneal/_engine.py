"""The annealing engine. It never touches rows directly: it asks a moment source
(:mod:`fastanneal._sources`) for :class:`~fastanneal.Moments` and updates the centers."""
import logging
import math
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ._trace import Trace
from .schedules import ScheduleState

log = logging.getLogger("fastanneal")

RESP_HARD = 2
#: Clusters with soft mass at most this fraction of the total weight are empty (relocated):
#: one threshold for float32 and float64, at float32's resolution.
MIN_MASS = 2.0 ** -24


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


def _split_largest(C, N, k_empty, rng, delta):
    """Move center ``k_empty`` next to the heaviest cluster (split with a +-delta nudge)."""
    donor = int(np.argmax(N))
    u = rng.standard_normal(C.shape[1])
    u *= delta / max(np.linalg.norm(u), 1e-300)
    C[k_empty] = C[donor] + u
    C[donor] = C[donor] - u
    return donor


def _project(C, metric):
    if metric == 1:
        n = np.linalg.norm(C, axis=1, keepdims=True)
        C = C / np.where(n > 0, n, 1.0)
    return C


def anneal(source, C0, schedule, T_start, T_end, cfg, rng, scale, trace=None, t0=None,
           state_hook=None, n_iter0=0, step0=0):
    """Run the schedule from ``C0`` and polish; returns :class:`EngineResult`.

    ``scale`` is the data scale (mean squared distance to the mean): tolerances and
    perturbations are relative to it. ``state_hook(step, C, logp, T)`` is called after each
    temperature step (checkpointing).
    """
    t0 = time.perf_counter() if t0 is None else t0
    trace = Trace() if trace is None else trace
    K = cfg.n_clusters
    D = C0.shape[1]
    C = _project(np.array(C0, dtype=np.float64), source.metric)
    tol_abs = cfg.tol * scale / max(D, 1)
    delta = 1e-3 * math.sqrt(scale)          # duplicate perturbation (norm)
    eps2 = (0.05 * delta) ** 2               # "coincident" threshold (squared)
    logp = np.full(K, -math.log(K)) if cfg.mass_constrained and cfg.resp == 0 else None
    schedule.start(T_start, T_end)
    T = float(T_start)
    step = step0
    n_iter = n_iter0
    relocations_total = 0
    m = None
    converged = False
    while T is not None:
        relocated = 0
        shift = math.nan
        for _ in range(max(1, cfg.max_iter)):
            m = source.moments(C, T, cfg.resp, logp, hard_sums=False)
            logp_m = logp
            upd = m.finalize(previous_centers=C, min_mass=MIN_MASS)
            Cn = upd.centers
            n_iter += 1
            if logp is not None:
                p = m.N / max(m.weight, 1e-300)
                logp = np.log(np.maximum(p, 1e-300))
            if upd.empty.any():
                Nk = np.where(upd.empty, 0.0, m.N)
                for k in np.nonzero(upd.empty)[0]:
                    donor = _split_largest(Cn, Nk, k, rng, delta)
                    Nk[k] = Nk[donor] = Nk[donor] / 2.0   # the donor's mass is shared
                    relocated += 1
                if logp is not None:                        # masses still sum to 1
                    logp = np.log(np.maximum(Nk / max(Nk.sum(), 1e-300), 1e-300))
                Cn = _project(Cn, source.metric)
            shift = float(np.max(np.einsum("ij,ij->i", Cn - C, Cn - C)))
            C = Cn
            if cfg.diagnostics == "full":
                _record(trace, step, n_iter, T, m, C, shift, relocated, 0, K, t0,
                        logp=logp_m)
            if shift <= tol_abs:
                break
        relocations_total += relocated
        dmin, D2 = min_center_distance(C)
        dup = coincident_groups(D2, eps2)
        if len(dup):
            # perturbed duplicates: they separate when T falls below their cluster's T_c
            u = rng.standard_normal((len(dup), D))
            u *= delta / np.linalg.norm(u, axis=1, keepdims=True)
            C[dup] += u
            C = _project(C, source.metric)
        n_distinct = K - len(dup)
        ent = m.objectives()["entropy"]
        if cfg.diagnostics != "full":
            _record(trace, step, n_iter, T, m, C, shift, relocated, len(dup), K, t0, dmin,
                    logp=logp_m)
        if cfg.progress is not None:
            cfg.progress(step, T, trace[-1])
        if cfg.verbose:
            log.info("step %d T=%.4g F=%.6g J=%.6g H=%.3f distinct=%d", step, T, m.free_energy,
                     m.hard_distortion, ent, n_distinct)
        state = ScheduleState(step=step - step0, T=T, T_start=T_start, T_end=T_end, entropy=ent,
                              n_distinct=n_distinct, n_clusters=K, extra={"scale": scale})
        if state_hook is not None:
            state_hook(step, C, logp, T)
        T = schedule.next_temperature(state)
        step += 1
    T_final = m.temperature
    soft_F = m.free_energy
    soft_obj = m.soft_distortion
    # ---------------------------------------------------------------- polish at T = 0
    C, n_iter, relocated, converged = polish(source, C, T_final, cfg, rng, trace, t0, n_iter,
                                             tol_abs, delta)
    relocations_total += relocated
    return EngineResult(centers=C, temperature=T_final, free_energy=soft_F,
                        soft_objective=soft_obj, hard_objective=m.hard_distortion,
                        n_iter=n_iter, n_steps=step, relocations=relocations_total,
                        converged=converged, last_moments=m)


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


def polish(source, C, T_final, cfg, rng, trace, t0, n_iter, tol_abs, delta):
    """Lloyd at ``T = 0`` (hard moments with hard sums) until the centers stop moving, with
    empty clusters relocated by splitting the heaviest one; one trace record (step -1).
    Shared by every solver. Returns ``(C, n_iter, relocations, converged)``."""
    if not cfg.polish:
        return C, n_iter, 0, True
    K = cfg.n_clusters
    converged = False
    relocations = 0
    relocated = 0
    shift = math.nan
    mh = None
    for _ in range(cfg.max_polish_iter):
        mh = source.moments(C, T_final, RESP_HARD, None, hard_sums=True)
        upd = mh.finalize(previous_centers=C, hard=True)
        Cn = upd.centers
        n_iter += 1
        relocated = 0
        if upd.empty.any():
            for k in np.nonzero(upd.empty)[0]:
                _split_largest(Cn, mh.hard_counts, k, rng, delta)
                relocated += 1
            Cn = _project(Cn, source.metric)
            relocations += relocated
        shift = float(np.max(np.einsum("ij,ij->i", Cn - C, Cn - C)))
        C = Cn
        if shift <= tol_abs * 1e-4 and relocated == 0:
            converged = True
            break
    dmin, _ = min_center_distance(C)
    _record(trace, -1, n_iter, 0.0, mh, C, shift, relocated, 0, K, t0, dmin)
    return C, n_iter, relocations, converged


def _record(trace, step, n_iter, T, m, C, shift, relocated, coincident, K, t0, dmin=None,
            logp=None):
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
                 margin_sum=ob["margin_sum"], grad_norm=math.nan,
                 wall_time=time.perf_counter() - t0)


def _top_eigs(source, centers, n_iter, rng):
    """(lambda_max, top eigenvector) per cluster; random unit vectors for sources that do
    not return eigenvectors."""
    try:
        return source.cluster_top_eigenvalues(centers, n_iter, rng, return_vectors=True)
    except TypeError:
        lam = source.cluster_top_eigenvalues(centers, n_iter, rng)
        V = rng.standard_normal(centers.shape)
        return lam, V / np.linalg.norm(V, axis=1, keepdims=True)


def anneal_critical(source, mean, schedule, T_start, T_end, cfg, rng, scale, trace=None,
                    t0=None):
    """Deterministic annealing with phase transitions (THEORY.md section 2).

    Starts with one effective cluster at the mean. At each temperature, mass-constrained EM
    (``r_ik ~ p_k exp(-d_ik / T)``) runs to convergence; then each cluster's own critical
    temperature ``2 lambda_max(C_k)`` is computed (power iteration on additive moments of
    the cluster's rows) and every cluster with ``T < 2 lambda_max(C_k)`` -- the ones whose
    single center has become unstable -- is split into two codevectors displaced along
    its top eigenvector (the unstable direction), each with half the mass. Largest
    ``lambda`` first, until ``K`` clusters exist. Cooling is geometric
    (``schedule.cooling``) until ``K`` clusters exist and ``T <= T_end``; the K centers are
    then polished as in :func:`anneal`.
    """
    t0 = time.perf_counter() if t0 is None else t0
    trace = Trace() if trace is None else trace
    K = cfg.n_clusters
    D = mean.shape[0]
    tol_abs = cfg.tol * scale / max(D, 1)
    C = _project(np.array(mean, dtype=np.float64)[None, :], source.metric)
    p = np.ones(1)
    T = float(T_start)
    step = 0
    n_iter = 0
    m = None
    shift = math.nan
    cooling = getattr(schedule, "cooling", 0.85)
    max_steps = getattr(schedule, "max_steps", 200)
    while True:
        for _ in range(max(1, cfg.max_iter)):
            logp = np.log(np.maximum(p, 1e-300)) if cfg.resp == 0 else None
            m = source.moments(C, T, cfg.resp, logp, hard_sums=False)
            upd = m.finalize(previous_centers=C)
            shift = float(np.max(np.einsum("ij,ij->i", upd.centers - C, upd.centers - C)))
            C = _project(upd.centers, source.metric)
            p = m.N / max(m.weight, 1e-300)
            n_iter += 1
            if shift <= tol_abs:
                break
        ke = C.shape[0]
        n_split = 0
        if ke < K:
            lam, V = _top_eigs(source, C, 30, rng)
            unstable = np.nonzero(2.0 * lam > T)[0]
            if unstable.size == 0 and T <= T_end * cooling ** 6:
                unstable = np.argsort(-lam)[:1]     # nothing left to split on its own
            order = unstable[np.argsort(-lam[unstable])][:K - ke]
            if order.size:
                eps = 0.1 * np.sqrt(np.maximum(lam[order], 1e-12 * scale))[:, None] * V[order]
                newc = C[order] + eps
                C[order] -= eps
                C = _project(np.concatenate([C, newc]), source.metric)
                p[order] /= 2.0
                p = np.concatenate([p, p[order]])
                n_split = order.size
        dmin, _ = min_center_distance(C)
        _record(trace, step, n_iter, T, m, C, shift, 0, K - C.shape[0], K, t0, dmin, logp=logp)
        if cfg.progress is not None:
            cfg.progress(step, T, trace[-1])
        if cfg.verbose:
            log.info("critical step %d T=%.4g clusters=%d (+%d)", step, T, C.shape[0], n_split)
        step += 1
        if (C.shape[0] >= K and T <= T_end) or step >= max_steps:
            break
        if n_split == 0 or C.shape[0] >= K:
            T *= cooling
    if C.shape[0] < K:        # max_steps reached: fill up by splitting the heaviest clusters
        while C.shape[0] < K:
            j = int(np.argmax(p))
            v = rng.standard_normal(D)
            v *= 1e-3 * math.sqrt(scale) / np.linalg.norm(v)
            C = np.concatenate([C, (C[j] + v)[None]])
            p[j] /= 2.0
            p = np.concatenate([p, [p[j]]])
        C = _project(C, source.metric)
    return anneal(source, C, _OneStep(), T, T, cfg, rng, scale, trace, t0,
                  n_iter0=n_iter, step0=step)


class _OneStep:
    """Schedule of exactly one temperature (the last one of a critical run)."""

    def start(self, T_start, T_end):
        pass

    def next_temperature(self, state):
        return None
