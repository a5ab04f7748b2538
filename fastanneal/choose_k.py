"""Choosing K from the phase transitions of deterministic annealing (``docs/theory.md`` §9).

Annealing from above the first critical temperature, an effective cluster splits into two
when the temperature falls below ``2 lambda_max`` of its own cell; the number of effective
clusters (codevectors closer than ``sqrt(MERGE * T)`` count once) grows one transition at a
time. A number of clusters that the data supports survives over a wide range of
temperatures: its *plateau* is wide. :func:`suggest_k` follows that path up to ``k_max``
effective clusters (moments only: every backend) and measures each K's plateau

    width(K) = sum over the path's temperatures T_j with K effective clusters of
               log(T_j / T_{j+1}),

the last temperature of ``k_max`` ending at its predicted next transition
(``max_k 2 lambda_max(C_k)`` of the ``k_max``-cluster state), but not below the path's floor
(``1e-5`` of its start: a state of single-row cells would otherwise end it at rounding
noise and make it the widest). A K that the path skipped
(several clusters split at one temperature) has width 0.

The rule: the *natural levels* are the K whose plateau is wider than two cooling steps and
either at least half as wide as the widest plateau or at least 1 wide in ``log T`` (the
temperature falls by a factor e along it); the suggestion is the finest level (the largest
such K), or the widest plateau when there is no level. Data with nested structure
(clusters of clusters: groups far apart, or clusters spread over a square, whose
quadrants make a plateau at K = 4) have a coarse level whose plateau can be the widest; the
widest-plateau rule then answers the coarse level (measured in ``BENCHMARKS.md`` §12).

Where nothing splits and every cell is stable, the path jumps to just below the next
predicted transition instead of cooling step by step (after the EM has settled), and the
split test's Lanczos runs to the precision the decision needs, warm-started from the
previous temperature (``docs/theory.md`` §9).

``AnnealedKMeans(n_clusters="auto", k_max=...)`` fits the best-ranked K by continuing the
annealing from the path's state with that many clusters (no refit from scratch).
"""
import math
import numbers
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from . import _engine as E
from ._moments import pinned_blas
from ._trace import Trace

__all__ = ["suggest_k", "KSuggestion"]


class _PathPhase(E._CriticalPhase):
    """The critical phase, recording the number of *effective* clusters at every
    temperature (codevectors closer than ``sqrt(E.MERGE * T)`` count once: at temperature
    ``T`` the Gibbs distribution does not resolve them) and the coldest state of each
    count; stops once ``k_max`` effective clusters exist (or at ``T_floor``)."""

    def __init__(self, cooling, max_steps, k_max, T_floor):
        super().__init__(cooling, max_steps)
        self.k_max = int(k_max)
        # twins that have not separated yet hold two codevectors for one effective cluster:
        # room for them, so that the budget does not stall the path below k_max
        self.max_codevectors = self.k_max + max(2, self.k_max // 2)
        self.T_floor = float(T_floor)
        self.steps = []            # (T, effective clusters, J, F) per temperature
        self.snapshots = {}        # K -> coldest state with K effective clusters
        self._pending = None
        self._holds = 0
        self._end_holds = 0
        self._ctx = None

    #: skip stretches without a predicted transition (``docs/theory.md`` §9)
    jump = True
    #: the split test needs the decision ``2 lambda > T``, not ``lambda`` to 1e-9: a looser
    #: Lanczos tolerance and warm starts from the previous temperature's Ritz vectors
    lanczos_tol = 1e-4

    #: a jump lands this far below the predicted transition temperature
    JUMP_BELOW = 0.97
    #: at most this many extra EM rounds at one temperature before a jump
    MAX_HOLDS = 3
    #: ... and before the path ends at ``k_max`` effective clusters
    MAX_END_HOLDS = 3

    def after_step(self, ctx, st, T):
        """The engine's split of effective clusters (:meth:`_CriticalPhase.split`), with a
        budget of ``max_codevectors``; remembers the state before the split."""
        self._ctx = ctx
        C0 = st.centers.copy()
        p0 = np.array(st.rule_state["p"], dtype=np.float64, copy=True)
        n, lab = self.split(ctx, st, T, self.max_codevectors - C0.shape[0])
        self._pending = dict(centers=C0, p=p0, T=float(T), step=int(st.step), groups=lab)
        return n

    def next_temperature(self, st, T, n_split):
        pend = self._pending
        self._pending = None
        lab = pend["groups"]
        k = int(lab.max()) + 1
        J, F = float(st.last["hard_distortion"]), float(st.last["free_energy"])
        self.steps.append((float(T), k, J, F))
        pend.update(J=J, F=F)
        self.snapshots[k] = pend
        if T <= self.T_floor or st.step + 1 - st.phase_step0 >= self.max_steps:
            return None
        if k >= self.k_max:
            # end on an equilibrium, not on a transient of the last splits: while twins
            # separate the count can overshoot (4 effective clusters for 3, back to 3 a
            # few EM rounds later at the same temperature), which ended the path before
            # the true count was measured -- with k_max equal to the true K the path
            # suggested a coarser level -- and left the k_max state's plateau to be read
            # from cells still moving
            # (held while the count still changes: a count that repeats at a temperature
            # is taken, settled or not -- holding until every slow drift has settled cost
            # 5-20 % of a path for nothing)
            ctx = self._ctx
            prev = self.steps[-2][1] if len(self.steps) > 1 else None
            if (k != prev and ctx.trace[-1]["center_shift"] > ctx.tol_abs
                    and self._end_holds < self.MAX_END_HOLDS):
                self._end_holds += 1
                return T
            return None
        self._end_holds = 0
        if n_split and st.centers.shape[0] < self.k_max:
            return T                     # new twins: equilibrate at this temperature first
        T_next = T * self.cooling
        lam = self.last_lam
        if self.jump and n_split == 0 and lam is not None and np.all(2.0 * lam < T):
            # nothing splits and every cell is stable (twins that have not separated sit
            # in a stable cell: they wait for its transition like a single codevector):
            # skip the stretch down to the next predicted transition, the largest
            # 2 lambda_max of a cell -- once the EM has settled at T, so that the stretch
            # is credited to the equilibrium's number of clusters, not to a transient
            ctx = self._ctx
            if ctx.trace[-1]["center_shift"] > ctx.tol_abs and self._holds < self.MAX_HOLDS:
                self._holds += 1
                return T
            T_next = min(T_next, max(2.0 * float(np.max(lam)) * self.JUMP_BELOW, self.T_floor))
        self._holds = 0
        return T_next


@dataclass
class KSuggestion:
    """Candidate numbers of clusters ranked by the width of their phase-transition plateau.

    Attributes
    ----------
    best : int
        The suggested K: the finest natural level (the largest of ``levels``), or the
        widest plateau when no plateau is a level.
    ranking : list of int
        Every K in ``[k_min, k_max]`` that appeared: ``best`` first, then by plateau width
        (widest first; ties to the smaller K), the K that are no clustering last: above half
        of ``n_rows`` (fewer than two rows a cluster) or :attr:`trivial_k`. Those are never
        ``best`` unless nothing else appeared (then :attr:`supported` is False).
    levels : list of int
        The natural levels, ascending: every K whose plateau is wider than two cooling
        steps and at least half the widest plateau or at least 1 in ``log T``. Nested data (clusters of clusters)
        have several; the coarser ones are the groups of ``best``'s clusters.
    ks : (m,) int array
        K = k_min .. k_max.
    width : (m,) float array
        Plateau widths: the ``log T`` span the path spent with K effective clusters (0 for a
        K the path skipped).
    t_in, t_out : (m,) float arrays
        Critical temperatures entering / leaving each K (NaN if skipped).
    hard_distortion, free_energy : (m,) float arrays
        J and F of the coldest equilibrium with K clusters on the path (NaN if skipped).
    critical_temperature : float
        ``T_c = 2 lambda_max(C)`` of the data (first transition).
    k_max : int
        The ``k_max`` the path was run to.
    trivial_k : int or None
        ``k_max`` when it equals the number of distinct rows (every row its own cluster: a
        plateau of the data's granularity, never suggested), else None.
    trace : Trace
        The path's :class:`~fastanneal._trace.Trace` (temperature, F, J, ...; its
        ``n_distinct`` counts codevectors, twins included).
    path_temperature, path_clusters : (s,) arrays
        The path's temperatures and its number of effective clusters at each (what the
        plateaus are measured on).
    n_rows : int
        The rows the path ran on (a sample's size with ``max_rows`` or out of core).
    n_distinct : int
        The rows that count for the granularity rule (a K above half of them is no
        clustering): when the path reached ``k_max``, the distinct rows of weight > 0,
        counted only until more than ``2 k_max`` were found (beyond that a lower bound:
        all the rule needs); else the rows.
    n_passes : int
        The moments passes (EM rounds) of the path; ``AnnealedKMeans("auto").n_iter_``
        includes them.
    """
    best: int
    ranking: list
    levels: list
    ks: np.ndarray
    width: np.ndarray
    t_in: np.ndarray
    t_out: np.ndarray
    hard_distortion: np.ndarray
    free_energy: np.ndarray
    critical_temperature: float
    k_max: int
    trace: Trace = field(repr=False, default=None)
    snapshots: dict = field(repr=False, default_factory=dict)
    temperature_start: float = float("nan")
    scale: float = float("nan")
    cooling: float = 0.85
    path_temperature: np.ndarray = field(repr=False, default=None)
    path_clusters: np.ndarray = field(repr=False, default=None)
    n_rows: int = 0
    n_distinct: int = 0
    n_passes: int = 0
    #: ``k_max`` when it equals the number of distinct rows (every row its own cluster):
    #: never suggested and not counted against ``best`` in :attr:`supported`; else None
    trivial_k: int = None

    @property
    def supported(self):
        """True when ``best``'s plateau is wide in absolute terms (more than two cooling
        steps of ``log T``) and clearly wider (1.5x) than every plateau that is not a
        natural level (coarser levels of a nested structure do not count against it).
        False means the path shows no clear plateau -- typical of embeddings whose
        spectrum is flat, where every cluster splits within a step or two below ``T_c``:
        ``best`` is then only where the path happened to stop, not a K the data
        supports. True is relative to the other K, not a test that clusters exist: see
        :attr:`could_be_unclustered`."""
        if self.not_a_clustering(self.best):
            return False        # (only K of single rows in range: no clustering)
        step = -math.log(self.cooling)
        i = int(np.nonzero(self.ks == self.best)[0][0])
        wb = float(self.width[i])
        other = [w for k, w in zip(self.ks, self.width)
                 if int(k) != self.best and int(k) not in self.levels
                 and not self.not_a_clustering(k)]
        runner = max(other) if other else 0.0
        return bool(wb > 2.0 * step + 1e-12 and wb >= 1.5 * runner)

    def not_a_clustering(self, k):
        """Why ``k`` is never suggested, or None: the level where every distinct row is
        its own cluster (:attr:`trivial_k`), or fewer than two rows a cluster (``k`` above
        half of :attr:`n_distinct`)."""
        return _no_clustering(k, self.trivial_k, self.n_distinct or self.n_rows)

    @property
    def could_be_unclustered(self):
        """True when ``best``'s plateau is no wider than those seen on data without any
        clusters (:data:`NO_CLUSTER_WIDTH`): a single Gaussian in 1-3 dimensions, a uniform
        box or a ring hold some K over up to 1.22 in ``log T`` and are often
        :attr:`supported` (49 of 84 runs of ``benchmarks/study_unimodal.py``). The
        plateaus measure how long the path holds K, not whether clusters exist; a narrow
        one is consistent with no cluster structure at all -- and also common on clustered
        low-dimensional data (iris, wine, the 2-D known-answer sets: 0.65-1.65), so True
        does not say there are no clusters, only that the plateau does not show them:
        check the clusters before relying on K."""
        i = int(np.nonzero(self.ks == self.best)[0][0])
        return bool(float(self.width[i]) <= NO_CLUSTER_WIDTH)

    def table(self):
        """One dict per K (ranked): k, rank, width, t_in, t_out, hard_distortion,
        free_energy, and ``no_clustering``: why that K is at the data's granularity
        (:meth:`not_a_clustering`), or None."""
        rank = {k: i + 1 for i, k in enumerate(self.ranking)}
        rows = []
        for i, k in enumerate(self.ks):
            rows.append(dict(k=int(k), rank=rank.get(int(k)), width=float(self.width[i]),
                             t_in=float(self.t_in[i]), t_out=float(self.t_out[i]),
                             hard_distortion=float(self.hard_distortion[i]),
                             free_energy=float(self.free_energy[i]),
                             no_clustering=self.not_a_clustering(int(k))))
        rows.sort(key=lambda r: (r["rank"] is None, r["rank"] or 0))
        return rows

    def plot(self, axes=None, top=3):
        """Two panels: distinct clusters against T (log scale) with the ``top`` widest
        plateaus shaded, and J against K. Needs matplotlib. Returns the figure."""
        import matplotlib.pyplot as plt
        if axes is None:
            fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        else:
            fig = axes[0].figure
        ax = axes[0]
        T = np.asarray(self.path_temperature, dtype=float)
        nd = np.asarray(self.path_clusters, dtype=float)
        ok = T > 0
        ax.step(T[ok], nd[ok], where="post", color="#0550ae")
        ax.set_xscale("log")
        ax.invert_xaxis()
        colors = ["#2da44e", "#bf8700", "#8250df", "#cf222e"]
        for j, k in enumerate(self.ranking[:top]):
            i = int(np.nonzero(self.ks == k)[0][0])
            lo, hi = self.t_out[i], self.t_in[i]
            if np.isfinite(lo) and np.isfinite(hi) and hi > lo > 0:
                ax.axvspan(lo, hi, color=colors[j % len(colors)], alpha=0.25,
                           label=f"K={k} (width {self.width[i]:.2f})")
        ax.set_xlabel("temperature T (log, cooling →)")
        ax.set_ylabel("effective clusters on the path")
        ax.legend(fontsize=8, loc="upper left")
        ax.set_title("phase transitions")
        ax = axes[1]
        ok = np.isfinite(self.hard_distortion)
        ax.plot(self.ks[ok], self.hard_distortion[ok], "o-", ms=3, color="#0550ae")
        ax.axvline(self.best, color="#2da44e", ls="--", label=f"suggested K={self.best}")
        ax.set_xlabel("K")
        ax.set_ylabel("J (hard distortion)")
        ax.legend(fontsize=8)
        ax.set_title("objective along the path")
        fig.tight_layout()
        return fig


def _check_path_params(cooling, max_steps):
    """``cooling`` a real in (0, 1) (a factor between temperatures), ``max_steps`` a whole
    number >= 1."""
    from .schedules import check_steps
    c = cooling
    if isinstance(c, (bool, np.bool_)) or not isinstance(c, numbers.Real) or \
            not (0.0 < float(c) < 1.0):
        raise ValueError(f"cooling must be a number strictly between 0 and 1 (the factor "
                         f"between temperatures); got {cooling!r}")
    return float(c), check_steps(max_steps, "max_steps")


def _check_k_range(k_min, k_max, n_rows):
    for name, v in (("k_min", k_min), ("k_max", k_max)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer; got {v!r}")
    if k_min < 2:
        raise ValueError(f"k_min must be >= 2 (one cluster has no plateau to compare); got "
                         f"{k_min}")
    if k_max < k_min:
        raise ValueError(f"k_max={k_max} must be >= k_min={k_min}")
    if k_max > n_rows:
        raise ValueError(f"k_max={k_max} is larger than the number of rows ({n_rows})")


def path_on_source(source, k_max, k_min=2, rng=None, cooling=0.85, max_steps=400,
                   floor=1e-5, max_iter=4, checked=None):
    """Follow the phase transitions on a moment source up to ``k_max`` effective clusters
    and rank the K; returns :class:`KSuggestion` (with the path's snapshots).
    ``checked``: ``(stats, T_c)`` of a caller that has already computed the data
    statistics, the critical temperature and checked ``k_max`` (no second pass for them)."""
    from ._seeding import (check_n_clusters, critical_temperature, data_stats, rows_coincide,
                           warn_narrow_cone)
    rng = np.random.default_rng(rng) if not isinstance(rng, np.random.Generator) else rng
    cooling, max_steps = _check_path_params(cooling, max_steps)
    _check_k_range(k_min, k_max, source.n_rows)
    if checked is not None:
        stats, T_c = checked
    else:
        stats = data_stats(source)
        why = rows_coincide(source, stats)
        if why:
            raise ValueError(why)
        warn_narrow_cone(source, stats, stacklevel=4)
        check_n_clusters(source, k_max, rng, name="k_max")
        T_c = critical_temperature(source, stats.mean, rng)
    T0 = 1.02 * T_c if T_c > 0 else stats.scale
    # codevectors: k_max (the effective clusters never outnumber them)
    cfg = E.EngineConfig(n_clusters=k_max + max(2, k_max // 2), resp=0,
                         mass_constrained=True, polish=False, reallocate=False,
                         max_iter=int(max_iter))
    st = E.critical_state(stats.mean_c, T0, floor * T0, stats.scale)
    phase = _PathPhase(cooling, max_steps, k_max, floor * T0)
    trace = Trace()
    ctx = E.Context(source, cfg, rng, stats.scale, trace, time.perf_counter(),
                    source.n_features)
    st.centers = E._project(np.array(st.centers, dtype=np.float64), source.metric)
    st.rule_state["K"] = cfg.n_clusters
    E._loop(ctx, st, E.EMRule(critical=True), None, phase, None, 0.0)
    T_out_last = None
    if k_max in phase.snapshots:
        snap = phase.snapshots[k_max]
        C = _merged(snap, source.metric)[0]
        lam = source.cluster_top_eigenvalues(C, 30, rng)
        # the k_max level's plateau is not observed below the path's floor: a state of
        # single-row cells (k_max near the number of distinct rows) has lambda ~ rounding
        # noise, which would make its plateau the widest of all
        T_out_last = max(float(2.0 * np.max(lam)), phase.T_floor)
    reached = max((r[1] for r in phase.steps), default=1)
    if reached < k_min:
        why = (f"max_steps={max_steps} steps were not enough" if phase.steps and
               phase.steps[-1][0] > phase.T_floor else
               f"it stayed at {reached} cluster(s) down to {floor:g} x the critical "
               "temperature: nothing in the data separates at a coarser scale than that "
               "(e.g. a few rows carry almost all the weight, or all but a few rows are "
               "identical)")
        raise ValueError(f"the annealing path reached no K in {k_min}..{k_max}: {why}")
    if reached < k_max and phase.steps[-1][0] > phase.T_floor:
        warnings.warn(f"the annealing path stopped at {reached} clusters after max_steps="
                      f"{max_steps} temperature steps, before k_max={k_max}: the plateaus "
                      f"of K > {reached} were not measured (raise max_steps)",
                      E.AnnealingWarning, stacklevel=3)
    # k_max equal to the number of distinct rows: that level is every row its own cluster,
    # stable at every temperature below its entry -- a plateau of the data's granularity,
    # not a clustering; it is never suggested (its own generator: the fit's stream stays)
    from ._sources import EIG_SEED
    # ... and a K above half the distinct rows is their granularity too (counted once the
    # path reached k_max: duplicates or zero weights made the row count too large)
    n_eff = int(source.n_rows)
    trivial = None
    if k_max in phase.snapshots:
        nd = int(source.n_distinct_rows(np.random.default_rng(EIG_SEED), 2 * k_max + 1))
        trivial = k_max if nd <= k_max else None
        n_eff = min(n_eff, nd)
    out = _rank(phase, trace, k_min, k_max, T_c, T0, stats.scale, T_out_last, cooling,
                trivial, n_eff)
    out.cooling = float(cooling)
    out.n_passes = int(st.n_iter)
    out.path_temperature = np.array([r[0] for r in phase.steps])
    out.path_clusters = np.array([r[1] for r in phase.steps], dtype=np.int64)
    return out


def _merged(snap, metric):
    """``(centers, masses)`` of the effective clusters of a snapshot (mass-weighted)."""
    return E.merge_groups(snap["centers"], snap["p"], snap["groups"], metric)


#: The widest plateau (in ``log T``) a suggestion showed on data without clusters --
#: single Gaussians in 1-3 dimensions, uniform boxes, a ring (their codebooks split in a
#: regular cascade that holds some K for a while): 1.22 over 84 runs of
#: ``benchmarks/study_unimodal.py``, where the known-K sets' true K held 0.65-5.96.
NO_CLUSTER_WIDTH = 1.25

def granularity_note(suggestion):
    """What the commands say when even the best K is at the data's granularity (every K in
    the range has fewer than two distinct points a cluster), or None."""
    why = suggestion.not_a_clustering(suggestion.best)
    if not why:
        return None
    nd = suggestion.n_distinct or suggestion.n_rows
    return (f"every K in {int(suggestion.ks[0])}..{int(suggestion.k_max)} is at the data's "
            f"granularity ({nd:,} distinct points or fewer: {why}): no K in the range is a "
            f"clustering; K = {suggestion.best} only ranks first. "
            + ("Give a smaller K range" if 2 * int(suggestion.ks[0]) <= nd else
               "Too few distinct points to choose K from"))


def unclustered_note(width):
    """What the commands say beside a supported K whose plateau (``width`` in ``log T``)
    is no wider than data without clusters show (:attr:`KSuggestion.could_be_unclustered`)."""
    return (f"its plateau is {width:.2f} in log T; data without clusters (a single "
            f"Gaussian, a uniform box) shows plateaus up to {NO_CLUSTER_WIDTH:g} too: check "
            "the clusters before relying on K")


#: A K is a natural level when its plateau is at least this fraction of the widest one ...
LEVEL_FRACTION = 0.5
#: ... or at least this wide in ``log T`` (a factor e in temperature)
LEVEL_WIDTH = 1.0


def natural_levels(ks, width, cooling):
    """The K whose plateau is wider than two cooling steps and either at least
    ``LEVEL_FRACTION`` of the widest plateau or at least ``LEVEL_WIDTH`` in ``log T``,
    ascending (module docstring)."""
    ks, width = np.asarray(ks), np.asarray(width, dtype=np.float64)
    if not width.size:
        return []
    step = -math.log(cooling)
    ok = (width > 2.0 * step + 1e-12) & ((width >= LEVEL_FRACTION * width.max())
                                         | (width >= LEVEL_WIDTH))
    return [int(k) for k in ks[ok]]


def _rank(phase, trace, k_min, k_max, T_c, T0, scale, T_out_last, cooling, trivial=None,
          n_rows=0):
    ks = np.arange(k_min, k_max + 1)
    m = ks.shape[0]
    width = np.zeros(m)
    t_in = np.full(m, np.nan)
    t_out = np.full(m, np.nan)
    held = np.zeros(m, dtype=bool)
    steps = phase.steps
    for j, (T, k, _, _) in enumerate(steps):
        if not k_min <= k <= k_max:
            continue
        i = k - k_min
        if j + 1 < len(steps):
            T_next = steps[j + 1][0]
        else:
            T_next = T_out_last if (T_out_last is not None and k == k_max) else T
        T_next = min(T_next, T)
        w = math.log(T / max(T_next, 1e-300)) if T_next > 0 else 0.0
        width[i] += w
        # the plateau's bounds come from the visits that held K over a range of
        # temperatures; a transient count at one temperature (twins overshooting while
        # they separate) set "T in" far above the plateau it was printed with
        if w > 0 and not held[i]:
            t_in[i], t_out[i], held[i] = T, T_next, True
        elif w > 0 or not held[i]:
            t_in[i] = T if np.isnan(t_in[i]) else max(t_in[i], T)
            t_out[i] = T_next if np.isnan(t_out[i]) else min(t_out[i], T_next)
    J = np.full(m, np.nan)
    F = np.full(m, np.nan)
    for k, snap in phase.snapshots.items():
        if k_min <= k <= k_max:
            J[k - k_min], F[k - k_min] = snap["J"], snap["F"]
    seen = [int(k) for k in ks if int(k) in phase.snapshots]
    if not seen:
        path_k = [int(r[1]) for r in steps]
        lo = max([k for k in path_k if k < k_min], default=1)
        hi = min([k for k in path_k if k > k_max], default=None)
        raise ValueError(f"the annealing path reached no K in {k_min}..{k_max}: it went from "
                         f"{lo} to {hi} clusters at one temperature (several clusters split "
                         f"together); widen the range (k_min <= {lo} or k_max >= {hi})")
    # neither the level of distinct rows nor one with fewer than two rows a cluster is a
    # clustering (K = n - 1 of n distinct rows held a plateau as wide as its closest pair
    # is close, and was suggested over four obvious blobs)
    excluded = {k for k in seen if _no_clustering(k, trivial, n_rows)}
    # (widths equal up to rounding tie, and ties go to the smaller K: a width is a sum of
    # log(T / T_next), and one cooling step summed in another order differed in its last
    # bits, which ranked K differently for float32 and float64 rows)
    order = sorted(seen, key=lambda k: (k in excluded, k == trivial,
                                        -round(float(width[k - k_min]), 9), k))
    # (measured against the widest plateau of a clustering: not against the granularity's)
    w_levels = np.where(np.isin(ks, sorted(excluded)), 0.0, width)
    levels = [k for k in natural_levels(ks, w_levels, cooling) if k not in excluded]
    best = max(levels) if levels else order[0]
    order = [best] + [k for k in order if k != best]
    return KSuggestion(best=best, ranking=order, levels=levels, ks=ks, width=width, t_in=t_in,
                       t_out=t_out, hard_distortion=J, free_energy=F,
                       critical_temperature=float(T_c), k_max=int(k_max), trace=trace,
                       snapshots=phase.snapshots, temperature_start=float(T0),
                       scale=float(scale), n_rows=int(n_rows), n_distinct=int(n_rows),
                       trivial_k=trivial)


def _no_clustering(k, trivial, n_rows):
    """Why ``k`` is no clustering, or None: the level ``trivial`` where every distinct row
    is its own cluster, or K above half the (distinct) rows ``n_rows`` -- fewer than two
    rows a cluster, the data's granularity."""
    if trivial is not None and int(k) == trivial:
        return "every distinct point its own cluster"
    if n_rows and 2 * int(k) > int(n_rows):
        return "fewer than two distinct points a cluster"
    return None


#: Rows of the sample the path runs on out of core (``suggest_k(max_rows=...)``).
STREAM_ROWS = 100_000


@pinned_blas
def suggest_k(X, k_max, *, k_min=2, sample_weight=None, metric="euclidean",
              random_state=None, backend=None, scheduler=None, cooling=0.85, max_steps=400,
              max_rows=None):
    """Rank the numbers of clusters ``k_min .. k_max`` by the width of their plateau on the
    deterministic-annealing path (see the module docstring).

    Parameters
    ----------
    X : array (n, D), Dask array, Parquet path or :func:`fastanneal.open_parquet` stream
        The rows, as for :meth:`AnnealedKMeans.fit`: a Dask array / DataFrame runs on the
        Dask backend (a Parquet path with ``backend="dask"`` too). A Parquet path without
        ``backend`` / ``scheduler``, or an ``open_parquet(...)`` stream, is read out of
        core in this process: the path runs on a uniform sample of ``max_rows`` rows
        (default 100,000), drawn in one pass over the row groups.
    k_max : int
        The most clusters the path splits into (the cost grows with it). When it equals
        the number of distinct rows, that level (every row its own cluster) is ranked but
        never suggested.
    k_min : int >= 2, default=2
        The fewest clusters to rank.
    sample_weight : (n,) array or None, default=None
        Row weights (>= 0).
    metric : {"euclidean", "cosine"}, default="euclidean"
    random_state : int, RandomState, Generator or None, default=None
    backend : {"cpu", "cuda", "dask"} or None, default=None
        As ``AnnealedKMeans(backend=...)``.
    scheduler : str, distributed.Client or None, default=None
        Dask backend only, as ``AnnealedKMeans(scheduler=...)``.
    cooling : float, default=0.85
        Factor between temperatures where nothing splits.
    max_steps : int, default=400
        The most temperature steps of the path.
    max_rows : int or None, default=None
        Run the path on a uniform sample of at most this many rows (the plateaus are a
        property of the distribution: a sample with enough rows per cluster has the same
        ones, at a cost proportional to its size). None: every row of an array or Dask
        input, 100,000 rows out of core.

    Returns
    -------
    KSuggestion
        ``.best``, ``.ranking``, ``.table()``, ``.plot()`` and the evidence (plateau widths,
        critical temperatures, J and F per K, the path's trace).

    Examples
    --------
    >>> import numpy as np, fastanneal
    >>> rng = np.random.default_rng(0)
    >>> centers = rng.normal(size=(4, 2)) * 10
    >>> X = np.concatenate([c + rng.normal(size=(100, 2)) for c in centers])
    >>> fastanneal.suggest_k(X, k_max=8, random_state=0).best
    4
    """
    import os

    from ._parquet import ParquetStream, open_parquet
    from ._sources import InMemorySource
    from ._validation import metric_code
    from .estimator import AnnealedKMeans
    if max_rows is not None and (not isinstance(max_rows, (int, np.integer))
                                 or isinstance(max_rows, bool) or max_rows < 2):
        raise ValueError(f"max_rows must be an integer >= 2 or None; got {max_rows!r}")
    if backend not in (None, "cpu", "cuda", "dask"):
        raise ValueError(f"backend must be None, 'cpu', 'cuda' or 'dask'; got {backend!r}")
    est = AnnealedKMeans(n_clusters=int(k_max) if isinstance(k_max, (int, np.integer)) else 1,
                         metric=metric, backend=backend, scheduler=scheduler,
                         random_state=random_state)
    rng = est._rng()
    if isinstance(X, (str, os.PathLike)) and backend is None and scheduler is None:
        X = open_parquet(X, metric=metric)             # out of core, in this process
    if isinstance(X, ParquetStream):
        if sample_weight is not None:
            raise ValueError("with a Parquet input, give the weight column to "
                             "open_parquet(..., weight=...)")
        if X.metric != metric_code(metric):
            raise ValueError(f"open_parquet(..., metric=...) must match metric={metric!r}")
        source = X
        max_rows = STREAM_ROWS if max_rows is None else max_rows
    else:
        source, _ = est._make_source(X, sample_weight)
    try:
        if max_rows is not None and (source.n_rows > max_rows or source is X):
            if isinstance(k_max, (int, np.integer)) and not isinstance(k_max, bool) and \
                    int(max_rows) < k_max <= source.n_rows:
                raise ValueError(f"k_max={k_max} is larger than max_rows={int(max_rows)}, "
                                 "the rows of the sample the path runs on (the data has "
                                 f"{source.n_rows}); give a larger max_rows or a smaller "
                                 "k_max")
            Xs, ws = source.sample(min(int(max_rows), source.n_rows), rng)
            Xs, ws = np.ascontiguousarray(Xs), np.asarray(ws, np.float64)
            if getattr(source, "origin", None) is None:
                Xs, _ = est._centered(Xs, ws)      # rows far from the origin: centered
            sample = InMemorySource(Xs, ws, source.metric)
            try:
                out = path_on_source(sample, k_max, k_min, rng, cooling, max_steps)
            except ValueError as e:
                if "distinct points" not in str(e) and "identical" not in str(e):
                    raise
                # (the count is the sample's, drawn without regard to the weights)
                raise ValueError(f"{e} -- in the uniform sample of {Xs.shape[0]:,} rows the "
                                 f"path runs on (max_rows; the data has {source.n_rows:,}): "
                                 "give a larger max_rows") from None
            out.n_rows = int(Xs.shape[0])
            return out
        out = path_on_source(source, k_max, k_min, rng, cooling, max_steps)
        out.n_rows = int(source.n_rows)
        return out
    finally:
        source.close()
