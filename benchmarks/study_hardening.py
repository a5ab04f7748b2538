"""Hardening study (issue 8, fidelity studies): what the deployed hard rule gets from a soft fit.

    python benchmarks/study_hardening.py             # full sizes, 3 seeds  (a few minutes)
    python benchmarks/study_hardening.py --quick     # quick sizes, 2 seeds (CI, < 1 min)

Four problems: digits, clinc150/banking (unit rows; squared Euclidean distance, i.e.
``metric="euclidean"`` on the unit vectors, so centers are plain means and every objective is
the k-means objective), blobs-overlapping, anisotropic. Four parts (docs/theory.md sections 1-2, 6.6):

1. **Hardening gap vs ``temperature_end_ratio``** in {0.8, 0.4, 0.2, 0.05, 0.01}. The estimator
   defines ``T_end = temperature_end_ratio * T_start`` with ``T_start = "auto"`` =
   ``0.5 * min_k 2 lambda_max(C_k)`` over the clusters of the initial (k-means++) partition,
   so the ratio is relative to the start temperature, not to a fixed data scale; the absolute
   ``T_end`` and ``T_end / s_med`` (median squared center separation) are printed too.
   Fit with ``polish=False`` (the soft result as trained); at its final centers ``C`` and final
   ``T`` we compute, with :func:`fastanneal.moments` and an independent float64 NumPy
   reference: ``F_T`` (free energy), ``D_T = sum r d`` (expected distortion of the randomized
   soft rule), ``J = sum min d`` (the deployed nearest-center rule). **Hardening gap**
   (docs/theory.md section 6.6: soft objective at the final T minus the hard objective of the same
   centers), reported in both forms, because "soft objective" can mean either:
   ``D_T - J >= 0`` (the library's ``hardening_gap``: what the argmax rule gains over the
   randomized rule) and ``F_T - J <= 0`` (``-(J - F_T)``; the free energy is a lower bound on
   ``J``, ``0 <= J - F_T <= T W log K``). Plus the k-means objective after polishing (a
   ``polish=True, reallocate=False`` fit, same seed: the polish alone, without the
   re-allocation moves that follow it by default), and ARI of the hard labels before and
   after polishing.
2. **One traced schedule** (``diagnostics="full"``, one record per soft-Lloyd iteration) on
   blobs-overlapping: ``F_T``, ``D_T`` and ``J`` of the same centers along the schedule, and
   whether ``J`` moves when the soft objective improves.
3. **Purification**: reference solution = the default polished fit (seed 0); ``s_med`` = median
   over pairs ``k < l`` of ``||c_k - c_l||^2`` at its centers. At ``T = f * s_med``,
   ``f`` in {1, 0.5, 0.25, 0.1, 0.05}, the soft fixed point is soft Lloyd at constant ``T``
   started from the reference centers (``schedule="constant"``, ``temperature_start=T``,
   ``polish=False``). At those centers: the randomized rule (``D_T``, and the k-means SSE of
   partitions sampled from ``r``, mean of 5 samples) vs its argmax rule (``J`` of the same
   centers and the SSE of the argmax partition).
4. **Soft + polish vs pure hard local search**: (a) fastanneal default (polish on); (b) Lloyd
   from k-means++ (scikit-learn, ``n_init=1``, ``algorithm="lloyd"``, initial centers given,
   the same seeds as (c)); (c) Hartigan single-point exchange from the same k-means++ seeds;
   (c') Hartigan after (b); (d) Hartigan from the fastanneal labels; (e) Lloyd from the
   fastanneal labels; reference: scikit-learn ``n_init=10``. SSE = k-means objective of the
   returned partition (float64, ``_study.partition_sse``), its ratio to the best SSE seen on
   that problem, ARI, wall time.

Prints one table per part; writes JSON (default ``benchmarks/results/study_hardening.json``).
"""
import _peer_threads  # noqa: F401,I001 -- first: before scikit-learn loads OpenMP
import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from numba import njit

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
try:
    import fastanneal as fa  # noqa: F401
except ImportError:          # run from a checkout without an install
    sys.path.insert(0, str(HERE.parent))
import fastanneal as fa  # noqa: E402

import _study  # noqa: E402

PROBLEMS = ("digits", "clinc150/banking", "blobs-overlapping", "anisotropic")
RATIOS = (0.8, 0.4, 0.2, 0.05, 0.01)
PURIFY_FACTORS = (1.0, 0.5, 0.25, 0.1, 0.05)
TRACE_PROBLEM = "blobs-overlapping"
N_SAMPLES = 5                  # partitions sampled from r per temperature (purification)


# ---------------------------------------------------------------- Hartigan (single point exchange)
@njit(cache=False)
def _hartigan(X, labels, K, max_passes):
    """Hartigan-Wong style single point exchange on the k-means objective.

    Point ``i`` in cluster ``a`` (``n_a >= 2``) moves to ``b`` when
    ``n_b / (n_b + 1) ||x - c_b||^2 < n_a / (n_a - 1) ||x - c_a||^2`` (the exact SSE change of
    the move); means are updated incrementally. Stops after a full pass without a move.
    Returns (labels, n_moves, n_passes)."""
    n, D = X.shape
    lab = labels.copy()
    cnt = np.zeros(K, np.int64)
    C = np.zeros((K, D))
    for i in range(n):
        cnt[lab[i]] += 1
        for j in range(D):
            C[lab[i], j] += X[i, j]
    for k in range(K):
        if cnt[k] > 0:
            for j in range(D):
                C[k, j] /= cnt[k]
    moves = 0
    passes = 0
    for p in range(max_passes):
        passes += 1
        moved = 0
        for i in range(n):
            a = lab[i]
            na = cnt[a]
            if na < 2:
                continue
            da = 0.0
            for j in range(D):
                t = X[i, j] - C[a, j]
                da += t * t
            remove = na / (na - 1.0) * da
            best = remove
            bk = -1
            for b in range(K):
                if b == a:
                    continue
                db = 0.0
                for j in range(D):
                    t = X[i, j] - C[b, j]
                    db += t * t
                add = cnt[b] / (cnt[b] + 1.0) * db
                if add < best:
                    best = add
                    bk = b
            # strict improvement beyond rounding (else rounding could cycle)
            if bk >= 0 and remove - best > 1e-12 * remove:
                nb = cnt[bk]
                for j in range(D):
                    C[a, j] = (na * C[a, j] - X[i, j]) / (na - 1.0)
                    C[bk, j] = (nb * C[bk, j] + X[i, j]) / (nb + 1.0)
                cnt[a] = na - 1
                cnt[bk] = nb + 1
                lab[i] = bk
                moved += 1
        moves += moved
        if moved == 0:
            break
    return lab, moves, passes


def hartigan(X, labels, K, max_passes=1000):
    lab, moves, passes = _hartigan(np.ascontiguousarray(X, dtype=np.float64),
                                   np.asarray(labels, dtype=np.int64), int(K), int(max_passes))
    return lab, int(moves), int(passes)


# ---------------------------------------------------------------- float64 references
def ref_objectives(X, C, T):
    """F_T, D_T, J of centers C at temperature T (float64 NumPy, independent of the library)."""
    d = _study.sq_distances(X, C)
    dmin = d.min(1)
    z = -(d - dmin[:, None]) / T
    e = np.exp(z)
    s = e.sum(1)
    r = e / s[:, None]
    F = float(np.sum(dmin - T * np.log(s)))
    D = float(np.sum(r * d))
    J = float(dmin.sum())
    return F, D, J, r, d


def median_separation(C):
    """Median over pairs k < l of ||c_k - c_l||^2."""
    K = C.shape[0]
    iu = np.triu_indices(K, 1)
    return float(np.median(_study.sq_distances(C, C)[iu]))


def sample_partition(r, rng):
    u = rng.random(r.shape[0])
    lab = (np.cumsum(r, axis=1) < u[:, None]).sum(1)
    return np.minimum(lab, r.shape[1] - 1)


def fit(X, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = time.perf_counter()
        m = fa.AnnealedKMeans(**kw).fit(X)
        sec = time.perf_counter() - t
    msgs = sorted({str(w.message)[:90] for w in caught})
    return m, sec, msgs


def ari(y, lab):
    from sklearn.metrics import adjusted_rand_score
    return float(adjusted_rand_score(y, lab))


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-300)


# ---------------------------------------------------------------- part 1
def part_gap(ds, seeds):
    X, y, K = ds.X, ds.y, ds.K
    rows = []
    for ratio in RATIOS:
        for seed in seeds:
            m, sec, msgs = fit(X, n_clusters=K, temperature_end_ratio=ratio, polish=False,
                               random_state=seed)
            C = np.asarray(m.cluster_centers_, dtype=np.float64)
            T = m.temperature_
            mo = fa.moments(X, C, T)
            F, D, J = mo.free_energy, mo.soft_distortion, mo.hard_distortion
            Fr, Dr, Jr, _, _ = ref_objectives(X, C, T)
            # (reallocate=False: the polish alone -- the default fit also runs the
            # phase-transition re-allocation moves after it, which change J by far more
            # than hardening does, 2e-3 on digits)
            mp, sec_p, _ = fit(X, n_clusters=K, temperature_end_ratio=ratio, polish=True,
                               reallocate=False, random_state=seed)
            s_med = median_separation(C)
            W = float(X.shape[0])
            rows.append({
                "dataset": ds.name, "ratio": ratio, "seed": seed,
                "T_start": m.temperature_start_, "T_end": T, "T_end_over_smed": T / s_med,
                "F": F, "D": D, "J": J,
                "gap_D_minus_J": D - J, "gap_F_minus_J": F - J,
                "rel_gap_D": (D - J) / J, "rel_gap_F": (F - J) / J,
                "bound_TWlogK": T * W * np.log(K),
                "sse_soft_labels": _study.partition_sse(X, m.labels_, K),
                "sse_polished": _study.partition_sse(X, mp.labels_, K),
                "inertia_polished": mp.inertia_,
                "ari_hard": ari(y, m.labels_), "ari_polished": ari(y, mp.labels_),
                "ref_max_rel_err": max(rel(F, Fr), rel(D, Dr), rel(J, Jr)),
                # library attributes: measured at the centers the last annealing pass started
                # from (one soft-Lloyd update before cluster_centers_)
                "attr_free_energy": m.free_energy_, "attr_soft_distortion": m.soft_distortion_,
                "attr_hardening_gap": m.hardening_gap_, "inertia_attr": m.inertia_,
                "attr_gap_vs_final_centers": m.hardening_gap_ - (D - J),
                "seconds": sec, "seconds_polished": sec_p, "warnings": msgs,
            })
    return rows


def summarize_gap(rows):
    out = []
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        for ratio in RATIOS:
            R = [r for r in rows if r["dataset"] == ds and r["ratio"] == ratio]
            if not R:
                continue
            mean = {k: float(np.mean([r[k] for r in R])) for k in (
                "T_end", "T_end_over_smed", "F", "D", "J", "gap_D_minus_J", "gap_F_minus_J",
                "rel_gap_D", "rel_gap_F", "sse_soft_labels", "sse_polished", "ari_hard",
                "ari_polished", "ref_max_rel_err", "attr_gap_vs_final_centers")}
            mean.update(dataset=ds, ratio=ratio, runs=len(R),
                        polish_gain=(mean["J"] - mean["sse_polished"]) / mean["sse_polished"])
            out.append(mean)
    return out


# ---------------------------------------------------------------- part 2
def part_trace(ds, seed=0):
    X, K = ds.X, ds.K
    # tol=0: every temperature runs its max_iter=4 soft-Lloyd iterations, so F_T can be
    # compared between iterations at one temperature (the default tol stops after one)
    # (stop_when_hard=False: the whole schedule, as the study is about; the default ends
    # it once the partition has settled, here after 9 records instead of 81)
    m, sec, msgs = fit(X, n_clusters=K, diagnostics="full", tol=0.0, random_state=seed,
                       stop_when_hard=False)
    tr = m.trace_.as_dict()
    keep = ("step", "iteration", "temperature", "free_energy", "soft_distortion",
            "hard_distortion", "hardening_gap", "certificate_gap", "certificate_ok", "entropy")
    curve = {k: tr[k].tolist() for k in keep}
    step, T = tr["step"], tr["temperature"]
    F, D, J = tr["free_energy"], tr["soft_distortion"], tr["hard_distortion"]
    ann = step >= 0
    tolJ = 1e-9 * abs(J[ann]).max()
    # consecutive records at the same temperature (soft Lloyd iterations): F_T is comparable
    same = [(i - 1, i) for i in range(1, len(step)) if ann[i] and step[i] == step[i - 1]]
    f_impr = [(a, b) for a, b in same if F[b] < F[a] - tolJ]
    j_flat = sum(abs(J[b] - J[a]) <= tolJ for a, b in f_impr)
    j_up = sum(J[b] > J[a] + tolJ for a, b in f_impr)
    j_down = sum(J[b] < J[a] - tolJ for a, b in f_impr)
    # across the schedule: the last annealing record where J (resp. D) still moves
    idx = np.flatnonzero(ann)
    dJ = np.abs(np.diff(J[idx])) > tolJ
    dD = np.abs(np.diff(D[idx])) > tolJ
    last_J_move = int(idx[1:][dJ][-1]) if dJ.any() else None
    last_D_move = int(idx[1:][dD][-1]) if dD.any() else None
    # independent check at the final (polished) centers
    C = np.asarray(m.cluster_centers_, dtype=np.float64)
    _, _, Jr, _, _ = ref_objectives(X, C, 1.0)
    summary = {
        "dataset": ds.name, "seed": seed, "records": int(len(step)),
        "T_start": m.temperature_start_, "T_end": m.temperature_,
        "same_T_pairs": len(same), "F_improves": len(f_impr),
        "J_flat_when_F_improves": int(j_flat), "J_up_when_F_improves": int(j_up),
        "J_down_when_F_improves": int(j_down),
        "J_first": float(J[idx[0]]), "J_last_anneal": float(J[idx[-1]]),
        "D_first": float(D[idx[0]]), "D_last_anneal": float(D[idx[-1]]),
        "F_first": float(F[idx[0]]), "F_last_anneal": float(F[idx[-1]]),
        "J_polished": float(J[-1]), "J_polished_ref": Jr,
        # after the first temperature step, how far each objective still travels
        "rel_change_F_after_step0": _travel(F, step, ann), "rel_change_D_after_step0":
        _travel(D, step, ann), "rel_change_J_after_step0": _travel(J, step, ann),
        "last_record_J_moves": last_J_move, "last_record_D_moves": last_D_move,
        "order_ok_all": bool(np.all(F[ann] <= J[ann] + tolJ) and np.all(J[ann] <= D[ann] + tolJ)),
        "certificate_ok_all": bool(np.all(tr["certificate_ok"])),
        "seconds": sec, "warnings": msgs,
    }
    return summary, curve


def _travel(v, step, ann):
    """(v at the last record of step 0 - v at the last annealing record) / v at the end."""
    i0 = np.flatnonzero(step == 0)[-1]
    i1 = np.flatnonzero(ann)[-1]
    return float((v[i0] - v[i1]) / v[i1])


# ---------------------------------------------------------------- part 3
def part_purify(ds, rng_seed=0):
    X, y, K = ds.X, ds.y, ds.K
    ref, _, _ = fit(X, n_clusters=K, random_state=0)
    C0 = np.asarray(ref.cluster_centers_, dtype=np.float64)
    s_med = median_separation(C0)
    J0 = float(ref.inertia_)
    rng = np.random.default_rng(rng_seed)
    rows = []
    for f in PURIFY_FACTORS:
        T = f * s_med
        m, sec, msgs = fit(X, n_clusters=K, init=C0, schedule="constant", n_steps=30,
                           max_iter=5, temperature_start=T, polish=False, random_state=0)
        C = np.asarray(m.cluster_centers_, dtype=np.float64)
        mo = fa.moments(X, C, T)
        Fr, Dr, Jr, r, d = ref_objectives(X, C, T)
        lab_max = d.argmin(1)
        sse_max = _study.partition_sse(X, lab_max, K)
        samp = [sample_partition(r, rng) for _ in range(N_SAMPLES)]
        sse_s = [_study.partition_sse(X, s, K) for s in samp]
        expd_s = [float(d[np.arange(len(s)), s].sum()) for s in samp]
        mind = _study.sq_distances(C, C)
        np.fill_diagonal(mind, np.inf)
        rows.append({
            "dataset": ds.name, "factor": f, "T": T, "s_med": s_med,
            "T_over_Tc": T / ref.critical_temperature_,
            "F": mo.free_energy, "D_randomized": mo.soft_distortion,
            "J_argmax": mo.hard_distortion,
            "sse_argmax_partition": sse_max,
            "sse_sampled_mean": float(np.mean(sse_s)), "sse_sampled_min": float(np.min(sse_s)),
            "dist_sampled_mean": float(np.mean(expd_s)),
            "ari_argmax": ari(y, lab_max), "ari_sampled": float(np.mean([ari(y, s) for s in samp])),
            "J_reference": J0, "entropy_per_point": mo.entropy / X.shape[0],
            # centers closer than 1e-3 s_med (squared) count as one: merged above T_c
            "n_distinct_centers": int(K - np.sum(np.triu(mind < 1e-3 * s_med, 1).any(0))),
            "ref_max_rel_err": max(rel(mo.free_energy, Fr), rel(mo.soft_distortion, Dr),
                                   rel(mo.hard_distortion, Jr)),
            "seconds": sec, "warnings": msgs,
        })
    return rows


# ---------------------------------------------------------------- part 4
def part_search(ds, seeds):
    from sklearn.cluster import KMeans, kmeans_plusplus
    X, y, K = ds.X, ds.y, ds.K
    rows = []

    def rec(method, seed, lab, sec, **extra):
        rows.append(dict(dataset=ds.name, method=method, seed=seed,
                         sse=_study.partition_sse(X, np.asarray(lab), K), ari=ari(y, lab),
                         seconds=sec, **extra))

    def means(lab):
        cnt = np.bincount(lab, minlength=K).astype(float)
        S = np.zeros((K, X.shape[1]))
        np.add.at(S, lab, X)
        return S / np.maximum(cnt, 1)[:, None]

    def lloyd(C):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = time.perf_counter()
            km = KMeans(K, init=C, n_init=1, algorithm="lloyd", max_iter=1000).fit(X)
            return km.labels_, time.perf_counter() - t

    def hart(lab0):
        t = time.perf_counter()
        lab, moves, passes = hartigan(X, lab0, K)
        return lab, time.perf_counter() - t, moves, passes

    for seed in seeds:
        m, sec, _ = fit(X, n_clusters=K, random_state=seed)
        rec("fastanneal (soft+polish)", seed, m.labels_, sec)
        lab_fa = np.asarray(m.labels_)
        t = time.perf_counter()
        C0, _ = kmeans_plusplus(X, K, random_state=seed)
        t_pp = time.perf_counter() - t
        lab_pp = _study.sq_distances(X, C0).argmin(1)
        sse_pp = _study.partition_sse(X, lab_pp, K)
        lab_l, t_l = lloyd(C0)
        rec("Lloyd from k-means++", seed, lab_l, t_pp + t_l)
        lab_h, t_h, mv, ps = hart(lab_pp)
        rec("Hartigan from k-means++", seed, lab_h, t_pp + t_h, start_sse=sse_pp, moves=mv,
            passes=ps)
        lab_lh, t_lh, mv, ps = hart(lab_l)
        rec("Lloyd then Hartigan (k-means++)", seed, lab_lh, t_pp + t_l + t_lh,
            start_sse=_study.partition_sse(X, lab_l, K), moves=mv, passes=ps)
        lab_fh, t_fh, mv, ps = hart(lab_fa)
        rec("Hartigan from fastanneal labels", seed, lab_fh, sec + t_fh,
            start_sse=_study.partition_sse(X, lab_fa, K), moves=mv, passes=ps)
        lab_fl, t_fl = lloyd(means(lab_fa))
        rec("Lloyd from fastanneal labels", seed, lab_fl, sec + t_fl,
            start_sse=_study.partition_sse(X, lab_fa, K))
        t = time.perf_counter()
        km = KMeans(K, n_init=10, algorithm="lloyd", random_state=seed).fit(X)
        rec("sklearn n_init=10", seed, km.labels_, time.perf_counter() - t)
    best = min(r["sse"] for r in rows)
    for r in rows:
        r["sse_ratio_best"] = r["sse"] / best
    return rows


def summarize_search(rows):
    out = []
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        R = [r for r in rows if r["dataset"] == ds]
        for meth in dict.fromkeys(r["method"] for r in R):
            M = [r for r in R if r["method"] == meth]
            out.append({"dataset": ds, "method": meth, "runs": len(M),
                        "sse": float(np.mean([r["sse"] for r in M])),
                        "sse_ratio_best": float(np.mean([r["sse_ratio_best"] for r in M])),
                        "sse_ratio_worst": float(np.max([r["sse_ratio_best"] for r in M])),
                        "ari": float(np.mean([r["ari"] for r in M])),
                        "seconds": float(np.mean([r["seconds"] for r in M])),
                        "moves": (float(np.mean([r["moves"] for r in M]))
                                  if "moves" in M[0] else None)})
    return out


# ---------------------------------------------------------------- driver
def _warm_up():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((300, 3))
    fit(X, n_clusters=3, random_state=0)
    fit(X, n_clusters=3, random_state=0, diagnostics="full", polish=False)
    hartigan(X, rng.integers(0, 3, 300), 3)
    fa.moments(X, X[:3], 1.0)


def run(quick=False, seeds=None, problems=PROBLEMS, verbose=True):
    """Run the four parts; returns the results dict (no file written)."""
    t_all = time.perf_counter()
    seeds = list(range(seeds if seeds else (2 if quick else 3)))
    _warm_up()
    datasets = [_study.load(name, quick) for name in problems]
    out = {"study": "hardening", "quick": bool(quick), "seeds": seeds,
           "clinc_source": str(_study.CLINC if _study.clinc_available() else _study.BUNDLED),
           "problems": {d.name: {"n": d.X.shape[0], "dim": d.X.shape[1], "K": d.K,
                                 "description": d.description,
                                 "distance": "squared Euclidean (metric='euclidean')"}
                        for d in datasets},
           "definitions": {
               "T_end": "temperature_end_ratio * T_start; T_start='auto' = 0.5 * min_k "
                        "2 lambda_max(C_k) over the clusters of the k-means++ partition",
               "hardening_gap_D": "D_T - J: expected distortion of the randomized soft rule "
                                  "minus the hard objective of the same centers (>= 0)",
               "hardening_gap_F": "F_T - J = -(J - F_T): free energy minus the hard objective "
                                  "of the same centers (<= 0, >= -T W log K)",
               "s_med": "median over pairs k<l of ||c_k - c_l||^2 at the default polished fit "
                        "(seed 0)",
               "sse": "k-means objective of a partition, each cluster around its own mean"}}
    log = print if verbose else (lambda *a, **k: None)

    def table(rows, cols, title):
        if verbose:
            _study.print_table(rows, cols, title)

    t = time.perf_counter()
    gap_rows = [r for d in datasets for r in part_gap(d, seeds)]
    out["gap"] = {"runs": gap_rows, "summary": summarize_gap(gap_rows),
                  "seconds": time.perf_counter() - t}
    table(out["gap"]["summary"], [
        ("dataset", "problem", ""), ("ratio", "T_end/T0", "g"), ("T_end", "T_end", ".3g"),
        ("T_end_over_smed", "T_end/s_med", ".2g"), ("J", "J (hard)", ".6g"),
        ("gap_D_minus_J", "D_T-J", ".3g"), ("gap_F_minus_J", "F_T-J", ".3g"),
        ("rel_gap_D", "(D_T-J)/J", ".1e"), ("sse_polished", "SSE polished", ".6g"),
        ("polish_gain", "(J-SSEpol)/SSEpol", ".1e"), ("ari_hard", "ARI hard", ".3f"),
        ("ari_polished", "ARI pol", ".3f"), ("ref_max_rel_err", "ref err", ".0e")],
        "1. Hardening gap at the final centers vs temperature_end_ratio "
        "(polish=False; mean over seeds)")

    t = time.perf_counter()
    dtr = next(d for d in datasets if d.name == TRACE_PROBLEM)
    summ, curve = part_trace(dtr)
    out["trace"] = {"summary": summ, "curve": curve, "seconds": time.perf_counter() - t}
    table([summ], [("dataset", "problem", ""), ("records", "records", "d"),
                   ("F_improves", "F improves (same T)", "d"),
                   ("J_flat_when_F_improves", "J flat", "d"),
                   ("J_down_when_F_improves", "J down", "d"),
                   ("J_up_when_F_improves", "J up", "d"),
                   ("J_first", "J first", ".6g"), ("J_last_anneal", "J end anneal", ".6g"),
                   ("D_last_anneal", "D_T end", ".6g"), ("F_last_anneal", "F_T end", ".6g"),
                   ("J_polished", "J polished", ".6g"),
                   ("rel_change_D_after_step0", "dD/D after step 0", ".1e"),
                   ("rel_change_J_after_step0", "dJ/J after step 0", ".1e"),
                   ("order_ok_all", "F<=J<=D all", "")],
          "2. One traced schedule (diagnostics='full'): does J move when the soft "
          "objective improves?")
    step = np.asarray(curve["step"])
    sel = [i for i in range(len(step)) if i + 1 == len(step) or step[i + 1] != step[i]]
    table([{k: curve[k][i] for k in ("step", "temperature", "free_energy", "soft_distortion",
                                      "hard_distortion")} for i in sorted(set(sel[::2] + [sel[-1]]))],
          [("step", "step", "d"), ("temperature", "T", ".4g"), ("free_energy", "F_T", ".7g"),
           ("soft_distortion", "D_T", ".7g"), ("hard_distortion", "J", ".7g")],
          "   last iteration of every second temperature step (step -1 = polish)")

    t = time.perf_counter()
    pur = [r for d in datasets for r in part_purify(d)]
    out["purification"] = {"rows": pur, "samples_per_T": N_SAMPLES,
                           "seconds": time.perf_counter() - t}
    table(pur, [("dataset", "problem", ""), ("factor", "T/s_med", "g"), ("T", "T", ".3g"),
                ("T_over_Tc", "T/T_c", ".2f"),
                ("n_distinct_centers", "distinct", "d"),
                ("D_randomized", "D_T (rand.)", ".6g"), ("J_argmax", "J (argmax)", ".6g"),
                ("sse_sampled_mean", "SSE sampled", ".6g"),
                ("sse_argmax_partition", "SSE argmax", ".6g"),
                ("J_reference", "J ref (T=0)", ".6g"), ("ari_sampled", "ARI samp", ".3f"),
                ("ari_argmax", "ARI argmax", ".3f")],
          "3. Purification: randomized (soft) rule vs its argmax at the soft fixed point")

    t = time.perf_counter()
    srch = [r for d in datasets for r in part_search(d, seeds)]
    out["search"] = {"runs": srch, "summary": summarize_search(srch),
                     "seconds": time.perf_counter() - t}
    table(out["search"]["summary"], [
        ("dataset", "problem", ""), ("method", "method", ""), ("sse", "SSE", ".7g"),
        ("sse_ratio_best", "SSE/best", ".5f"), ("sse_ratio_worst", "worst", ".5f"),
        ("ari", "ARI", ".3f"), ("moves", "moves", ".0f"), ("seconds", "s", ".3f")],
        "4. Soft+polish vs hard local search (mean over seeds; best = lowest SSE seen on "
        "the problem)")
    out["seconds_total"] = time.perf_counter() - t_all
    log(f"\ntotal {out['seconds_total']:.1f} s")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--problems", default=",".join(PROBLEMS))
    ap.add_argument("--json", default=str(HERE / "results" / "study_hardening.json"))
    args = ap.parse_args(argv)
    res = run(quick=args.quick, seeds=args.seeds, problems=tuple(args.problems.split(",")))
    _study.write_json(args.json, res)


if __name__ == "__main__":
    main()
