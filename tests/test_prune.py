"""Pruned passes (per-row Hamerly bounds, ``_config.PRUNE``) against the unpruned kernel.

A pruned row contributes one-hot with its own distance computed directly; everything else
takes the full path. Tolerances: float64 1e-12 relative (summation order only); float32
5e-5 relative to the largest entry (the full path keeps one-hot weights in the float32
distance buffer and may sum a block with a float32 GEMM; the pruned path sums in float64).
Hard labels (``hard_counts``) must be identical.
"""
import numpy as np
import pytest

import fastanneal
from fastanneal import _config
from fastanneal._moments import compute_moments
from fastanneal._sources import InMemorySource


def _data(rng, dtype, metric, n=6000, K=24, D=12):
    M = rng.standard_normal((K, D)) * 4.0
    X = M[rng.integers(0, K, n)] + rng.standard_normal((n, D))
    if metric == 1:
        X /= np.linalg.norm(X, axis=1, keepdims=True)
    return np.ascontiguousarray(X.astype(dtype)), rng.uniform(0.5, 2.0, n), K


def _close(a, b, dtype, what):
    tol = 1e-12 if dtype == np.float64 else 5e-5
    scale = max(float(np.max(np.abs(b))), 1e-300)
    assert float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) <= tol * scale, what


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("metric", [0, 1])
def test_pruned_pass_equals_unpruned(dtype, metric):
    rng = np.random.default_rng(7 + metric + (dtype == np.float32))
    X, w, K = _data(rng, dtype, metric)
    src = InMemorySource(X, w, metric)
    C = X[rng.choice(X.shape[0], K, replace=False)].astype(np.float64)
    scale = 1.0 if metric == 0 else 0.05
    eps = np.finfo(dtype).eps
    pruned_low_T = []
    schedule = [(0.5, 0), (0.05, 1), (0.005, 0), (0.0, 2)] * 3
    for it, (t, resp) in enumerate(schedule):
        T = t * scale
        prior = np.log(rng.dirichlet(np.ones(K)) + 0.01) if it % 3 == 1 and resp != 2 else None
        a = src.moments(C, T, resp, prior, hard_sums=True)
        b = compute_moments(X, w, C, T, metric, resp, prior, True)
        # the same nearest center for every row (the bounds keep it), the same hard counts
        np.testing.assert_array_equal(
            src._bounds.lab, fastanneal.assign(X, C.astype(dtype), ("euclidean", "cosine")[
                metric])[0])
        np.testing.assert_allclose(a.hard_counts, b.hard_counts, rtol=1e-12)
        for name in ("N", "S", "hard_sums"):
            _close(getattr(a, name), getattr(b, name), dtype, name)
        for name in ("hard_distortion", "soft_distortion", "free_energy", "weight"):
            _close(getattr(a, name), getattr(b, name), dtype, name)
        # the entropy of the few soft rows is sensitive to the GEMM's rounding of their
        # distances (a gathered block is another GEMM shape; float32 rounding of d ~ 200 is
        # ~1e-5, i.e. 2e-3 of a logit at T = 0.005): loose for float32
        tol_h = 1e-9 if dtype == np.float64 else 1e-2
        assert abs(a.entropy - b.entropy) <= tol_h * max(abs(b.entropy), 1.0)
        assert a.nnz == b.nnz and a.rows == b.rows
        # pruned rows report bounds: min_margin from below; margin_sum from above, by at
        # most eps per pruned row on a soft pass (their true terms are below eps too)
        # (up to the GEMM-form rounding of a squared distance, what the bounds allow for)
        rnd = 4 * (X.shape[1] + 4) * eps * (float((X.astype(float) ** 2).sum(1).max())
                                            + float((C ** 2).sum(1).max()))
        assert a.min_margin <= b.min_margin + rnd
        if resp != 2:
            # (entmax-1.5 prunes a row once its margin is >= 2T: its term is <= e^-2)
            per_row = 2 * eps if resp == 0 else np.exp(-2.0)
            assert b.margin_sum * (1 - tol_h) - 1e-9 * w.sum() <= a.margin_sum
            assert a.margin_sum <= b.margin_sum * (1 + tol_h) + per_row * w.sum() + 1e-9
        if t <= 0.005:
            pruned_low_T.append(src._bounds.pruned / X.shape[0])
        # a Lloyd step, and every fourth pass one center jumps far (a re-allocation move)
        C = np.where(b.N[:, None] > 0, b.S / np.maximum(b.N, 1e-300)[:, None], C)
        if it % 4 == 3:
            C[it % K] = X[rng.integers(X.shape[0])] + 0.01
        if metric == 1:
            C /= np.linalg.norm(C, axis=1, keepdims=True)
    assert np.mean(pruned_low_T) > 0.5, pruned_low_T     # the bounds do prune


def test_bounds_hold_after_each_pass():
    rng = np.random.default_rng(3)
    X, w, K = _data(rng, np.float32, 0, n=3000)
    src = InMemorySource(X, w, 0)
    C = X[:K].astype(np.float64)
    for it in range(6):
        m = src.moments(C, 0.01, 0)
        b = src._bounds
        Cb = np.asarray(b.C, dtype=np.float64)
        d = np.sqrt(((X.astype(np.float64)[:, None, :] - Cb[None]) ** 2).sum(-1))
        own = d[np.arange(len(X)), b.lab]
        d[np.arange(len(X)), b.lab] = np.inf
        assert (b.lab >= 0).all()
        assert (b.ub >= own - 1e-9).all() and (b.lb <= d.min(axis=1) + 1e-9).all()
        C = m.S / np.maximum(m.N, 1e-300)[:, None]
        C[it] += 3.0                                    # one far move (exact path)


def test_k_change_resets_bounds_and_off_switch(monkeypatch):
    rng = np.random.default_rng(5)
    X, w, K = _data(rng, np.float64, 0, n=2000)
    src = InMemorySource(X, w, 0)
    C = X[:K].astype(np.float64)
    src.moments(C, 0.0, 2)
    src.moments(C, 0.0, 2)
    assert src._bounds.pruned > 0
    a = src.moments(C[:-1], 0.0, 2)                     # K changed: no stale bounds used
    assert src._bounds.pruned == 0
    np.testing.assert_allclose(
        a.hard_counts, compute_moments(X, w, C[:-1], 0.0, 0, 2, None, False).hard_counts,
        rtol=1e-12)
    monkeypatch.setattr(_config, "PRUNE", False)
    src2 = InMemorySource(X, w, 0)
    src2.moments(C, 0.0, 2)
    assert src2._bounds is None


@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
def test_fit_with_and_without_pruning(monkeypatch, metric):
    """A whole default fit: identical labels, centers equal to float32 rounding."""
    rng = np.random.default_rng(11)
    X, _, K = _data(rng, np.float32, 1 if metric == "cosine" else 0, n=4000, K=16)
    monkeypatch.setattr(_config, "PRUNE", False)
    a = fastanneal.AnnealedKMeans(K, metric=metric, random_state=0).fit(X)
    monkeypatch.setattr(_config, "PRUNE", True)
    b = fastanneal.AnnealedKMeans(K, metric=metric, random_state=0).fit(X)
    np.testing.assert_array_equal(a.labels_, b.labels_)
    np.testing.assert_allclose(a.cluster_centers_, b.cluster_centers_, rtol=0, atol=2e-6)
    assert b.inertia_ == pytest.approx(a.inertia_, rel=1e-6)


def test_a_far_jump_of_one_center_does_not_void_the_bounds():
    """A re-allocation moves one center far: with the exact distances of the movers most
    rows stay pruned; with Hamerly's plain rule (every bound lowered by the largest move)
    none would."""
    rng = np.random.default_rng(9)
    X, w, K = _data(rng, np.float64, 0, n=4000)
    src = InMemorySource(X, w, 0)
    C = compute_moments(X, w, X[:K], 0.0, 0, 2, None, False)
    C = C.S / np.maximum(C.N, 1e-300)[:, None]
    for _ in range(3):                                  # settle: bounds for these centers
        m = src.moments(C, 0.0, 2)
        C = m.S / np.maximum(m.N, 1e-300)[:, None]
    C2 = C.copy()
    C2[0] = X[rng.integers(len(X))] + 50.0              # one center jumps far away
    a = src.moments(C2, 0.0, 2)
    assert src._bounds.pruned > 0.5 * len(X)
    np.testing.assert_allclose(
        a.hard_counts, compute_moments(X, w, C2, 0.0, 0, 2, None, False).hard_counts,
        rtol=1e-12)


def test_bounds_live_across_steps_unless_the_fit_saves_checkpoints(monkeypatch, tmp_path):
    """Without a checkpoint the bounds are kept from one temperature step to the next (the
    first pass of a step is pruned too); a fit that saves states forgets them at every step
    (bit-identical resume). Both give the same fit up to rounding."""
    rng = np.random.default_rng(21)
    M = rng.uniform(0, 60, (12, 2))
    X = M[rng.integers(0, 12, 3000)] + rng.standard_normal((3000, 2))
    pruned = {}
    resets = {}
    real_moments, real_reset = InMemorySource.moments, InMemorySource.reset_bounds

    def moments(self, *a, **k):
        out = real_moments(self, *a, **k)
        if self._bounds is not None:
            pruned[mode] = pruned.get(mode, 0) + self._bounds.pruned
        return out

    def reset(self):
        resets[mode] = resets.get(mode, 0) + 1
        real_reset(self)
    monkeypatch.setattr(InMemorySource, "moments", moments)
    monkeypatch.setattr(InMemorySource, "reset_bounds", reset)
    fits = {}
    for mode in ("plain", "checkpoint"):
        ck = tmp_path / "ck" if mode == "checkpoint" else None
        fits[mode] = fastanneal.AnnealedKMeans(12, random_state=3, checkpoint=ck).fit(X)
    a, b = fits["plain"], fits["checkpoint"]
    assert resets["plain"] == 1                  # only the estimator's final statistics
    assert resets["checkpoint"] >= a.n_steps_
    assert pruned["plain"] > pruned["checkpoint"] + 0.5 * X.shape[0] * a.n_steps_
    np.testing.assert_array_equal(a.labels_, b.labels_)
    np.testing.assert_allclose(a.cluster_centers_, b.cluster_centers_, rtol=1e-12, atol=1e-12)
    assert a.inertia_ == pytest.approx(b.inertia_, rel=1e-12)


@pytest.mark.parametrize("far, want_pruned", [(20, 0), (40, 40)])
def test_a_block_with_few_prunable_rows_takes_the_full_path(far, want_pruned):
    """One block of 100 rows: ``far`` rows deep inside their cells (prunable at T = 0.01)
    and the rest midway between two centers (never prunable). Below a quarter of prunable
    rows (``PRUNE_MIN_BLOCK_FRACTION``) the whole block takes the full path (nothing
    pruned); above, the prunable rows prune. Either way the moments are the unpruned
    pass's, and so are the bounds the next pass reads (it prunes the same rows again)."""
    from fastanneal import _kernels
    from fastanneal._sources import RowBounds, pruned_moments
    assert _kernels.PRUNE_MIN_BLOCK_FRACTION == 0.25
    rng = np.random.default_rng(3)
    C = np.array([[-5.0, 0.0], [5.0, 0.0]])
    deep = C[rng.integers(0, 2, far)] + 0.1 * rng.standard_normal((far, 2))
    mid = np.column_stack([0.001 * rng.standard_normal(100 - far),
                           rng.standard_normal(100 - far)])
    X = np.ascontiguousarray(np.concatenate([deep, mid])[rng.permutation(100)])
    w = rng.uniform(0.5, 2.0, 100)
    b = RowBounds(100)
    b.xsq_max = float((X * X).sum(1).max())
    ref = compute_moments(X, w, C, 0.01, 0, 0, None, True)
    for _ in range(2):                 # the first pass makes the bounds, the second reads
        m = pruned_moments(X, w, C, 0.01, 0, 0, None, True, b, block=128)
    assert b.pruned == want_pruned
    for name in ("N", "S", "hard_sums", "hard_distortion", "soft_distortion", "free_energy"):
        _close(getattr(m, name), getattr(ref, name), np.float64, name)


def test_rows_that_cannot_prune_skip_their_own_distance():
    """A row whose last exact own distance (less its rounding widening and the center's
    move) already fails the prune test does not compute it again: at a soft temperature
    where no row prunes, the second pass computes almost no own distance (a few rows pass
    the optimistic test and fail the exact one); at T = 0, where nearly every
    row of these separated blobs prunes, it computes one per row (the pruned row needs
    it). Same moments either way (``test_pruned_pass_equals_unpruned``)."""
    rng = np.random.default_rng(9)
    X, w, K = _data(rng, np.float64, 0, n=3000)
    src = InMemorySource(X, w, 0)
    C = X[rng.choice(len(X), K, replace=False)].astype(np.float64)
    T_soft = 50.0                        # every margin far below gap = 36.7 T
    src.moments(C, T_soft, 0)
    # without the skip, every row with a positive lower bound to the other centers would
    # compute its own distance here: most rows
    assert (src._bounds.lb > 1e-3).mean() > 0.5
    src.moments(C * (1 + 1e-9), T_soft, 0)
    assert src._bounds.pruned == 0 and src._bounds.own_distances < 0.02 * len(X)
    src.moments(C, 0.0, 2)
    src.moments(C * (1 + 1e-9), 0.0, 2)
    assert src._bounds.pruned > 0.9 * len(X)
    assert src._bounds.own_distances >= src._bounds.pruned


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("metric", [0, 1])
def test_pair_distances_against_float64_numpy(dtype, metric):
    """The vectorised own/mover distances of a pruned pass (``_kernels._pair_distances``):
    the kernel's formula (cosine ``2 - 2 x.c``, clipped at 0) in float64, to 1e-12 of the
    squared norms involved, at D that is not a multiple of the vector width, and for no
    pair at all (a block where no row may prune)."""
    from fastanneal._kernels import _pair_distances
    rng = np.random.default_rng(31 + metric)
    for D in (1, 3, 13, 384):
        X = rng.standard_normal((50, D))
        C = rng.standard_normal((7, D))
        if metric == 1:
            X /= np.linalg.norm(X, axis=1, keepdims=True)
            C /= np.linalg.norm(C, axis=1, keepdims=True)
        X, C = X.astype(dtype), C.astype(dtype)
        rows = rng.integers(0, 50, 40)
        cols = rng.integers(0, 7, 40)
        rows[0], cols[0] = 3, 2
        if metric == 1:
            C[2] = X[3]                      # a row on its center: 2 - 2 x.c clipped at 0
        out = np.full(45, -1.0)
        _pair_distances(X, C, rows, cols, 40, metric, out)
        Xd, Cd = X.astype(np.float64)[rows], C.astype(np.float64)[cols]
        ref = (2.0 - 2.0 * (Xd * Cd).sum(1)) if metric == 1 else ((Xd - Cd) ** 2).sum(1)
        ref = np.maximum(ref, 0.0)
        scale = float((Xd ** 2).sum(1).max() + (Cd ** 2).sum(1).max())
        assert np.abs(out[:40] - ref).max() <= 1e-12 * scale * D
        assert (out[:40] >= 0).all() and (out[40:] == -1.0).all()
        _pair_distances(X, C, rows, cols, 0, metric, out)     # n = 0: nothing written
        assert (out[40:] == -1.0).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("metric", [0, 1])
def test_a_reallocation_trial_of_three_movers_equals_the_unpruned_pass(dtype, metric):
    """A re-allocation move jumps three centers at once (split ``s`` into two halves,
    merge ``r`` into ``l``): their distances are computed exactly for every row that
    might prune, some rows' nearest center becomes one of them (those take the full
    path), and the pass still equals the unpruned one while most rows stay pruned."""
    rng = np.random.default_rng(41 + metric + 2 * (dtype == np.float32))
    X, w, K = _data(rng, dtype, metric, n=4000)
    src = InMemorySource(X, w, metric)
    C = X[:K].astype(np.float64)
    for _ in range(6):                                  # settle: bounds for these centers
        m = src.moments(C, 0.0, 2, None, hard_sums=True)
        C = np.where(m.N[:, None] > 0, m.S / np.maximum(m.N, 1e-300)[:, None], C)
        if metric == 1:
            C /= np.linalg.norm(C, axis=1, keepdims=True)
    C2 = C.copy()
    s, r, l = 0, 1, 2
    lab = src._bounds.lab
    cell = X[lab == s].astype(np.float64)
    v = np.linalg.svd(cell - cell.mean(0), full_matrices=False)[2][0]
    side = (cell - cell.mean(0)) @ v > 0
    C2[s], C2[r] = cell[side].mean(0), cell[~side].mean(0)
    C2[l] = (m.S[r] + m.S[l]) / (m.N[r] + m.N[l])
    if metric == 1:
        C2 /= np.linalg.norm(C2, axis=1, keepdims=True)
    a = src.moments(C2, 0.0, 2, None, hard_sums=True)
    b = compute_moments(X, w, C2, 0.0, metric, 2, None, True)
    np.testing.assert_array_equal(
        src._bounds.lab, fastanneal.assign(X, C2.astype(dtype), ("euclidean", "cosine")[
            metric])[0])
    np.testing.assert_allclose(a.hard_counts, b.hard_counts, rtol=1e-12)
    for name in ("N", "S", "hard_sums", "hard_distortion"):
        _close(getattr(a, name), getattr(b, name), dtype, name)
    moved = np.isin(src._bounds.lab, (s, r, l)).sum()
    assert moved > 100                        # rows did change to the moved centers
    assert src._bounds.pruned > 0.5 * len(X)  # and the others stayed pruned
