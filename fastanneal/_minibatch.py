"""Stochastic-EM (mini-batch) annealing: the engine's :class:`StochasticEMRule`, the
in-process batch stream for NumPy input and the state of ``partial_fit``.

Step-size rule (stochastic EM, Cappe & Moulines 2009; the same rule as online LDA)
-----------------------------------------------------------------------------------
The running moments are per unit weight: ``N_k ~ E[w r_k] / E[w]`` and ``S_k ~ E[w r_k x] /
E[w]``. A batch ``b`` with moments ``(N_b, S_b)`` and weight ``W_b`` at the current centers and
temperature ``T`` updates them as::

    N <- (1 - eta_t) N + eta_t N_b / W_b
    S <- (1 - eta_t) S + eta_t S_b / W_b          centers c_k = S_k / N_k

where a fit, which knows the data's mean row weight ``w_bar = W / n``, uses ``n_b w_bar``
(the batch's rows times ``w_bar``) for ``W_b``: unbiased however heavy-tailed the weights
(``partial_fit`` does not know ``W`` and uses the batch's own weight); and
``eta_t = (t + learning_offset) ** -learning_decay`` for the t-th update,
``learning_decay`` (kappa) in (0.5, 1] -- the Robbins-Monro conditions ``sum eta = inf``,
``sum eta^2 < inf`` -- and ``learning_offset >= 1`` (larger values forget early batches more
slowly). At a fixed ``T`` this is a stochastic approximation of the soft-Lloyd (EM) fixed
point of ``F_T``; the schedule lowers ``T`` meanwhile. A fit starts the running moments
from its seeding sample's moments (at the seeds and ``T_start``), counted as ``t_0 =
sample rows / batch rows`` updates (:meth:`RunningMoments.initial_state`); ``partial_fit``
has no sample, and its first batch initializes them (``eta_0 = 1``). Clusters whose running
mass is zero are relocated by splitting the heaviest cluster (as the full-batch engine does).

Batches are whole chunks (row ranges of ``batch_size`` rows for NumPy input; Dask chunks or
Parquet row groups otherwise) in a random order per epoch; the order of epoch ``e`` is the
permutation drawn by ``default_rng([perm_seed, e])``, so batch ``b`` is a function of ``b``
alone and a resumed fit reads the same batches as an uninterrupted one.
"""
import math
import numbers
from dataclasses import replace

import numpy as np

from . import _engine as E
from ._moments import compute_moments

MINIBATCH_SCHEDULES = ("geometric", "linear", "constant", "adaptive")


def check_learning(learning_decay, learning_offset):
    for name, v in (("learning_decay", learning_decay), ("learning_offset", learning_offset)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ValueError(f"{name} must be a number; got {v!r}")
    kd = float(learning_decay)
    if not 0.5 < kd <= 1.0:
        raise ValueError(f"learning_decay (kappa) must be in (0.5, 1]; got {learning_decay!r}")
    t0 = float(learning_offset)
    if not (math.isfinite(t0) and t0 >= 1.0):
        raise ValueError(f"learning_offset must be >= 1; got {learning_offset!r}")
    return kd, t0


def scaled(m, factor):
    """``m`` with its additive fields multiplied by ``factor`` (a batch scaled to the data)."""
    return replace(m, N=m.N * factor, S=m.S * factor,
                   soft_distortion=m.soft_distortion * factor, entropy=m.entropy * factor,
                   free_energy=m.free_energy * factor,
                   hard_distortion=m.hard_distortion * factor,
                   hard_counts=m.hard_counts * factor,
                   hard_sums=None if m.hard_sums is None else m.hard_sums * factor,
                   weight=m.weight * factor, rows=int(round(m.rows * factor)),
                   margin_sum=m.margin_sum * factor)


class RunningMoments:
    """Running per-unit-weight moments of stochastic EM (``N`` (K,), ``S`` (K, D); None
    before the first update) and the update rule of this module's docstring."""

    def __init__(self, metric, mass_constrained, resp, learning_decay, learning_offset,
                 scale, row_weight=None):
        self.metric = metric
        #: mean weight per row of the whole data when known (a fit): a batch's moments are
        #: divided by ``rows x row_weight``, not by the batch's own weight (see update)
        self.row_weight = None if row_weight is None else float(row_weight)
        self.mass_constrained = bool(mass_constrained)
        self.resp = resp
        self.kd = float(learning_decay)
        self.t0 = float(learning_offset)
        self.delta = E.perturbation(scale)
        self.N = self.S = None
        self.t = 0
        self.rows_seen = 0
        self.weight_seen = 0.0
        self.last_shift = math.nan

    def step_size(self, t=None):
        """``eta_t``: 1 for the first update, then ``(t + learning_offset) ** -learning_decay``."""
        t = self.t if t is None else t
        return 1.0 if t == 0 else float((t + self.t0) ** -self.kd)

    def log_prior(self, K):
        if not (self.mass_constrained and self.resp == 0):
            return None
        if self.N is None:
            return np.full(K, -math.log(K))
        p = self.N / max(self.N.sum(), 1e-300)
        return np.log(np.maximum(p, 1e-300))

    def update(self, m, C_old, rng):
        """One stochastic-EM step with the batch moments ``m`` (computed at ``C_old``);
        returns ``(centers, relocations)``."""
        W = m.weight
        if not W > 0:
            return C_old, 0
        eta = self.step_size()
        den = self._denominator(m)
        Nb, Sb = m.N / den, m.S / den
        if self.N is None or eta >= 1.0:
            N, S = Nb.copy(), Sb.copy()
        else:
            N = (1.0 - eta) * self.N + eta * Nb
            S = (1.0 - eta) * self.S + eta * Sb
        empty = ~(N > E.MIN_MASS * N.sum())
        with np.errstate(invalid="ignore", divide="ignore"):
            C = S / N[:, None]
        if self.metric == 1:
            norms = np.linalg.norm(C, axis=1)
            ok = ~empty & (norms > 0)
            C[ok] /= norms[ok, None]
            empty |= ~(norms > 0)
        C[empty] = C_old[empty]
        C, donors = E.relocate_empty(C, N, empty, rng, self.delta, self.metric)
        if donors:
            S = C * N[:, None]
        self.N, self.S = N, S
        self.last_shift = E._shift(C, C_old)
        self.t += 1
        self.rows_seen += int(m.rows)
        self.weight_seen += float(W)
        return C, len(donors)

    def _denominator(self, m):
        """Per unit weight: ``rows x row_weight`` when the data's mean row weight is known
        (unbiased however heavy-tailed the weights: one row holding half of its batch's
        weight counts for its share of the data, not for half of an update), else the
        batch's weight (``partial_fit``)."""
        if self.row_weight is not None and self.row_weight > 0 and m.rows > 0:
            return m.rows * self.row_weight
        return m.weight

    def initial_state(self, m, n_batches):
        """The state that starts a fit from the moments ``m`` of the seeding sample (at the
        seeds and ``T_start``), counted as ``n_batches`` batches (its rows over a batch's):
        the first update then has the step size ``eta`` of update ``n_batches`` instead of
        1, so that the sample's information is averaged in, not replaced by one batch."""
        if not m.weight > 0:
            return {}
        return {"t": max(1, int(round(n_batches))), "rows_seen": 0, "weight_seen": 0.0,
                "N": m.N / m.weight, "S": m.S / m.weight, "n_batches": 0}

    def state_dict(self):
        d = {"t": self.t, "rows_seen": self.rows_seen, "weight_seen": self.weight_seen}
        if self.N is not None:
            d["N"], d["S"] = self.N.copy(), self.S.copy()
        return d

    def load_state_dict(self, d):
        if not d:
            return
        self.t = int(d["t"])
        self.rows_seen = int(d["rows_seen"])
        self.weight_seen = float(d["weight_seen"])
        if "N" in d:
            self.N = np.array(d["N"], dtype=np.float64)
            self.S = np.array(d["S"], dtype=np.float64)


class StochasticEMRule:
    """The engine's update rule for mini-batch annealing: ``batches_per_step`` stochastic-EM
    updates per temperature, each with the moments of the next batch of chunks from
    ``stream`` (``stream.batch_moments(chunk_ids, C, T, resp, log_prior)``). The trace
    record of a step is the sum of its batches scaled to the total weight."""

    name = "minibatch"

    def __init__(self, stream, running, batch_chunks, batches_per_step, perm_seed,
                 total_weight):
        self.stream = stream
        self.running = running
        self.batch_chunks = int(batch_chunks)
        self.bps = int(batches_per_step)
        self.perm_seed = int(perm_seed)
        self.total_weight = float(total_weight)
        self.nonempty = np.array([i for i, r in enumerate(stream.chunk_rows) if r > 0],
                                 dtype=np.int64)
        self.n_batches = 0
        self._perm = (-1, None)

    # batch b = positions [b * bc, (b + 1) * bc) of the concatenated per-epoch permutations
    def batch(self, b):
        n = len(self.nonempty)
        out = []
        for pos in range(b * self.batch_chunks, (b + 1) * self.batch_chunks):
            e, j = divmod(pos, n)
            if self._perm[0] != e:
                rng = np.random.default_rng([self.perm_seed, e])
                order = getattr(self.stream, "epoch_order", None)
                # a stream may group its chunks (row groups of a Parquet file are
                # decoded once per epoch); positions index into self.nonempty
                self._perm = (e, self._positions(order(rng)) if order is not None
                              else rng.permutation(n))
            out.append(int(self.nonempty[self._perm[1][j]]))
        return out

    def _positions(self, chunk_ids):
        where = {int(c): j for j, c in enumerate(self.nonempty)}
        return np.array([where[int(c)] for c in chunk_ids], dtype=np.int64)

    def state_dict(self):
        return dict(self.running.state_dict(), n_batches=self.n_batches)

    def load_state_dict(self, d):
        if d:
            self.running.load_state_dict(d)
            self.n_batches = int(d["n_batches"])

    def begin(self, ctx, st):
        pass

    def step(self, ctx, st, T):
        K = st.centers.shape[0]
        step_m = None
        rel = 0
        logp_step = self.running.log_prior(K)
        for _ in range(self.bps):
            ids = self.batch(self.n_batches)
            self.stream.prefetch([self.batch(self.n_batches + j)
                                  for j in range(1, self.stream.prefetch_depth + 1)])
            m = self.stream.batch_moments(ids, st.centers, T, ctx.cfg.resp,
                                          self.running.log_prior(K))
            st.centers, r = self.running.update(m, st.centers, ctx.rng)
            rel += r
            self.n_batches += 1
            st.n_iter += 1
            step_m = m if step_m is None else step_m + m
        rec = scaled(step_m, self.total_weight / step_m.weight) if step_m.weight > 0 else step_m
        st.log_masses = self.running.log_prior(K)
        return E.StepResult(moments=rec, logp=logp_step, shift=self.running.last_shift,
                            relocated=rel, record_moments=rec)


def sample_plan(chunk_rows, n_target, rng, min_chunks=8):
    """Which rows of which chunks make a sample of about ``n_target`` rows: at least
    ``min_chunks`` random chunks (data stored in cluster order would bias a sample of one
    chunk), enough of them to hold ``n_target`` rows, rows per chunk proportional to the
    chunk sizes (largest remainders). Returns ``{chunk: sorted local row indices}``.
    A target of every row takes every row in order without drawing from ``rng`` (as an
    in-memory source's ``sample``: a fit's seeds then do not depend on how the rows are
    split into chunks or row groups)."""
    nonempty = [i for i in range(len(chunk_rows)) if chunk_rows[i] > 0]
    if n_target >= sum(int(chunk_rows[i]) for i in nonempty):
        return {i: np.arange(int(chunk_rows[i])) for i in nonempty}
    rows = np.array([chunk_rows[i] for i in nonempty], dtype=np.float64)
    if rows.max() > 4.0 * np.median(rows):
        # chunks of very different sizes: picked with probability proportional to their
        # rows (a uniform pick of 100-row row groups left out one holding half the data,
        # and the seeds missed its clusters: ARI 0.84); chunks of about one size (a
        # smaller last one included: the median decides) keep the uniform order below,
        # so their fits are as before
        order = [int(i) for i in rng.choice(np.array(nonempty), size=len(nonempty),
                                            replace=False, p=rows / rows.sum())]
    else:
        order = [int(i) for i in rng.permutation(nonempty)]
    mean_rows = float(np.mean([chunk_rows[i] for i in nonempty]))
    m = min(len(order), max(min_chunks, math.ceil(n_target / mean_rows)))
    while m < len(order) and sum(chunk_rows[i] for i in order[:m]) < n_target:
        m += 1                        # enough rows in the picked chunks
    picked = sorted(order[:m])
    sizes = np.array([chunk_rows[i] for i in picked], dtype=np.float64)
    want = min(int(n_target), int(sizes.sum()))
    quota = want * sizes / sizes.sum()
    cnt = np.minimum(np.floor(quota).astype(np.int64), sizes.astype(np.int64))
    for j in np.argsort(-(quota - cnt)):
        if cnt.sum() >= want:
            break
        if cnt[j] < sizes[j]:
            cnt[j] += 1
    take = {}
    for i, c in zip(picked, cnt):
        n_i = chunk_rows[i]
        take[i] = np.arange(n_i) if c >= n_i else np.sort(
            rng.choice(n_i, size=int(c), replace=False))
    return take


class ArrayStream:
    """Batches of an in-memory array, in process (no Dask): chunk ``i`` is the row range
    ``[i * chunk_rows, (i + 1) * chunk_rows)``."""

    prefetch_depth = 0
    has_ids = False

    def __init__(self, X, w, metric, chunk_rows):
        self.X, self.w, self.metric = X, w, metric
        n = X.shape[0]
        c = max(1, int(chunk_rows))
        self.bounds = [(a, min(a + c, n)) for a in range(0, n, c)] or [(0, 0)]
        self.chunk_rows = tuple(b - a for a, b in self.bounds)

    def prefetch(self, batches):
        pass

    def batch_moments(self, ids, C, T, resp, log_prior):
        m = None
        for i in ids:
            a, b = self.bounds[i]
            mi = compute_moments(self.X[a:b], self.w[a:b], C, T, self.metric, resp,
                                 log_prior, hard_sums=False)
            m = mi if m is None else m + mi
        return m
