"""Hubness study: k-occurrence skewness of CLINC150 embeddings, and how hub rows'
responsibilities resolve along an annealing schedule.

    python benchmarks/study_hubness.py            # all 22,500 CLINC150 queries
    python benchmarks/study_hubness.py --quick    # 20 queries per intent (3,000 rows)

1. k-occurrence ``N_k(x)``: how often ``x`` is among the ``k`` nearest neighbours (cosine,
   self excluded) of the other rows, for k = 5, 10, 20; its skewness (Radovanovic et al.
   2010: > 1 means a few hubs appear in many neighbour lists). Null reference: a Gaussian
   sample with the same mean and covariance (same n, D). Hubs = top 1 % of ``N_10``,
   anti-hubs = ``N_10 = 0``; Spearman correlation of ``N_10`` with the distance to the mean.
2. Along a geometric schedule (soft Lloyd with :func:`fastanneal.moments`, 4 passes per
   temperature, from k-means++ seeds, cosine; T from ``2 T_c`` to ``0.01 T_c``): mean entropy of the
   responsibilities of hub rows, anti-hub rows and the rest, and each row's resolution
   temperature (largest T of the schedule from which on its entropy stays < 0.1 nats).
3. The default ``AnnealedKMeans`` fit: entropy at its final temperature, and how often a
   row's cluster is dominated by the row's own intent (purity) for hubs vs the rest.

Prints tables, writes JSON (default ``benchmarks/results/study_hubness.json``).
"""
import _peer_threads  # noqa: F401,I001 -- first: before scikit-learn loads OpenMP
import argparse
import time
import warnings

import numpy as np

import _study

KS = (5, 10, 20)


def knn_indices(X, k, block=2048):
    """Indices of the k nearest rows (largest dot product = cosine on unit rows), self
    excluded; blocked so no n x n matrix is held."""
    n = X.shape[0]
    Xf = np.ascontiguousarray(X, dtype=np.float32)
    out = np.empty((n, k), dtype=np.int64)
    for s in range(0, n, block):
        e = min(n, s + block)
        S = Xf[s:e] @ Xf.T
        S[np.arange(e - s), np.arange(s, e)] = -np.inf
        idx = np.argpartition(-S, k, axis=1)[:, :k]
        out[s:e] = idx
    return out


def k_occurrence(X, ks=KS):
    """{k: N_k counts} from one neighbour search at max(ks) (nearest first)."""
    kmax = max(ks)
    n = X.shape[0]
    Xf = np.ascontiguousarray(X, dtype=np.float32)
    idx = knn_indices(X, kmax)
    # order each row's neighbours by similarity so that prefixes are the k-NN
    sims = np.einsum("ij,ikj->ik", Xf, Xf[idx])
    order = np.argsort(-sims, axis=1)
    idx = np.take_along_axis(idx, order, axis=1)
    return {k: np.bincount(idx[:, :k].ravel(), minlength=n) for k in ks}


def skewness(v):
    v = np.asarray(v, dtype=np.float64)
    s = v.std()
    return float(((v - v.mean()) ** 3).mean() / s ** 3) if s > 0 else 0.0


def spearman(a, b):
    from scipy.stats import spearmanr
    return float(spearmanr(a, b).statistic)


def gaussian_null(X, rng):
    mu = X.mean(0)
    C = np.cov(X, rowvar=False, bias=True)
    ev, V = np.linalg.eigh(C)
    Z = rng.standard_normal(X.shape) * np.sqrt(np.maximum(ev, 0))
    G = mu + Z @ V.T
    return G / np.linalg.norm(G, axis=1, keepdims=True)   # same geometry: unit rows


def row_entropy(R):
    R = np.asarray(R, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        L = np.where(R > 0, R * np.log(R), 0.0)
    return -L.sum(1)


def schedule_study(X, K, groups, rng, n_steps, passes=4):
    """Soft Lloyd along a geometric schedule; entropy per group at every temperature."""
    import fastanneal as fa
    from sklearn.cluster import kmeans_plusplus
    Xf = np.ascontiguousarray(X, dtype=np.float32)
    C = kmeans_plusplus(X, K, random_state=int(rng.integers(2 ** 31)))[0]
    lam = float(np.linalg.eigvalsh(np.cov(X, rowvar=False, bias=True))[-1])
    Tc = 2.0 * lam
    temps = Tc * np.geomspace(2.0, 1e-2, n_steps)
    curves = {g: [] for g in groups}
    H_all = np.empty((n_steps, X.shape[0]))
    for j, T in enumerate(temps):
        for _ in range(passes):
            m = fa.moments(Xf, C, T, metric="cosine")
            C = m.finalize(previous_centers=C).centers
        H = row_entropy(fa.responsibilities(Xf, C, T, metric="cosine"))
        H_all[j] = H
        for g, mask in groups.items():
            curves[g].append(float(H[mask].mean()))
    # resolution temperature: largest schedule T from which on the entropy stays < 0.1
    resolved = H_all < 0.1
    stays = np.flip(np.cumprod(np.flip(resolved, 0), 0), 0).astype(bool)
    first = np.where(stays.any(0), stays.argmax(0), -1)
    t_res = np.where(first >= 0, temps[np.clip(first, 0, None)], np.nan) / Tc
    res = {g: float(np.nanmedian(t_res[mask])) if np.isfinite(t_res[mask]).any() else None
           for g, mask in groups.items()}
    unresolved = {g: float(np.mean(~np.isfinite(t_res[mask]))) for g, mask in groups.items()}
    return {"T_over_Tc": (temps / Tc).tolist(), "T_c": Tc, "entropy": curves,
            "resolution_T_over_Tc_median": res, "never_resolved_fraction": unresolved}


def purity_by_row(labels, y):
    """For each row: is its true class the majority class of its cluster?"""
    K = labels.max() + 1
    out = np.zeros(len(y), dtype=bool)
    for k in range(K):
        m = labels == k
        if m.any():
            maj = np.bincount(y[m]).argmax()
            out[m] = y[m] == maj
    return out


def run(quick=False, seed=0, n_steps=None):
    ds = _study.load("clinc150", quick)
    X, y, K = ds.X, ds.y, ds.K
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    occ = k_occurrence(X)
    null = k_occurrence(gaussian_null(X, rng))
    N10 = occ[10]
    hub_cut = np.quantile(N10, 0.99)
    hubs = N10 >= max(hub_cut, 1)
    anti = N10 == 0
    rest = ~hubs & ~anti
    groups = {"hubs": hubs, "anti-hubs": anti, "rest": rest}
    dist_mean = np.linalg.norm(X - X.mean(0), axis=1)
    occ_rows = [{"k": k, "skew_clinc": skewness(occ[k]), "skew_null": skewness(null[k]),
                 "max_clinc": int(occ[k].max()), "max_null": int(null[k].max()),
                 "antihub_frac": float(np.mean(occ[k] == 0)),
                 "antihub_frac_null": float(np.mean(null[k] == 0))} for k in KS]
    t_occ = time.perf_counter() - t0

    sched = schedule_study(X, K, groups, rng, n_steps or (14 if quick else 24))

    import fastanneal as fa
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = fa.AnnealedKMeans(K, metric="cosine", random_state=seed).fit(
            X.astype(np.float32))
    H_fin = row_entropy(est.predict_proba(X.astype(np.float32)))
    pur = purity_by_row(est.labels_, y)
    final = {g: {"rows": int(mask.sum()), "entropy_final_T": float(H_fin[mask].mean()),
                 "purity": float(pur[mask].mean())} for g, mask in groups.items()}
    return {"dataset": ds.name, "n": int(X.shape[0]), "d": int(X.shape[1]), "K": K,
            "quick": quick, "k_occurrence": occ_rows,
            "hub_threshold_N10": float(hub_cut),
            "spearman_N10_vs_dist_to_mean": spearman(N10, dist_mean),
            "N10_hist": np.bincount(np.minimum(N10, 100)).tolist(),
            "N10_hist_null": np.bincount(np.minimum(null[10], 100)).tolist(),
            "schedule": sched, "final_fit": final,
            "final_temperature": float(est.temperature_),
            "default_start_T_over_Tc": float(est.temperature_start_ / est.critical_temperature_),
            "default_end_T_over_Tc": float(est.temperature_ / est.critical_temperature_),
            "seconds_k_occurrence": t_occ, "seconds_total": time.perf_counter() - t0}


def report(res):
    print(f"\n{res['dataset']}: n={res['n']}, D={res['d']}, K={res['K']}")
    _study.print_table(res["k_occurrence"], [
        ("k", "k", "d"), ("skew_clinc", "skew N_k", ".2f"), ("skew_null", "Gaussian null", ".2f"),
        ("max_clinc", "max N_k", "d"), ("max_null", "null max", "d"),
        ("antihub_frac", "anti-hubs", ".3f"), ("antihub_frac_null", "null anti", ".3f")],
        "k-occurrence (cosine k-NN, self excluded)")
    print(f"Spearman(N_10, distance to the mean) = {res['spearman_N10_vs_dist_to_mean']:.3f}; "
          f"hubs: N_10 >= {res['hub_threshold_N10']:.0f}")
    s = res["schedule"]
    rows = []
    for j, t in enumerate(s["T_over_Tc"]):
        rows.append({"t": t, **{g: s["entropy"][g][j] for g in s["entropy"]}})
    _study.print_table(rows, [("t", "T/T_c", ".2e"), ("hubs", "H hubs", ".3f"),
                              ("anti-hubs", "H anti-hubs", ".3f"), ("rest", "H rest", ".3f")],
                       "mean entropy of the responsibilities (nats) along the schedule")
    print("median resolution temperature (T/T_c):",
          {g: (None if v is None else round(v, 5))
           for g, v in s["resolution_T_over_Tc_median"].items()},
          "never resolved:", {g: round(v, 3) for g, v in s["never_resolved_fraction"].items()})
    rows = [{"g": g, **v} for g, v in res["final_fit"].items()]
    _study.print_table(rows, [("g", "group", "s"), ("rows", "rows", "d"),
                              ("entropy_final_T", "H at final T", ".4f"),
                              ("purity", "purity", ".3f")],
                       f"default AnnealedKMeans fit (final T = {res['final_temperature']:.3g}; its "
                       f"schedule runs from {res['default_start_T_over_Tc']:.3f} to "
                       f"{res['default_end_T_over_Tc']:.4f} T_c)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(_study.RESULTS / "study_hubness.json"))
    args = ap.parse_args(argv)
    if not _study.clinc_available():
        raise SystemExit(f"{_study.CLINC} not found: the hubness study needs CLINC150")
    res = run(quick=args.quick, seed=args.seed)
    report(res)
    _study.write_json(args.json, res)


if __name__ == "__main__":
    main()
