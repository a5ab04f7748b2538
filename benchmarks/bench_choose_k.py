"""Choosing K: does the top-ranked K of ``fastanneal.suggest_k`` equal the true K? Beside the
silhouette score, the gap statistic, BIC-based X-means and HDBSCAN, in the same run.

    python benchmarks/bench_choose_k.py             # all sets, 3 seeds
    python benchmarks/bench_choose_k.py --quick     # 1 seed
    python benchmarks/bench_choose_k.py --sets a20,iris --seeds 2
    python benchmarks/bench_choose_k.py --clinc     # CLINC150 (K=150) and its ten domains

Sets (true K known): every known-answer look-alike of ``bench_known_answers.py`` (grid100,
A-sets a20/a35/a50, DIM-sets dim32/dim128/dim1024, unbalanced), Gaussian blobs
(scikit-learn ``make_blobs``) in 2 / 16 / 128 / 1024 dimensions, and scikit-learn's labelled
iris, wine and digits (standardized; their classes are not clean clusters: read those rows
loosely). Every method searches K in ``[2, k_max]`` with ``k_max = 2 K_true`` (at least 8).
``--no-large`` leaves out grid100 and a50 (the peers' sweeps to K = 200 / 100 take most of
the run). The cost target is measured in the same run: one default
``AnnealedKMeans(k_max)`` fit per set and seed (``fit@k_max`` in the table).

* ``fastanneal``: ``suggest_k(X, k_max)``, the widest plateau (``docs/theory.md`` §9);
* ``silhouette``: scikit-learn KMeans (n_init=3) at every K, the best silhouette score;
* ``gap``: the gap statistic (Tibshirani et al. 2001) with 5 uniform reference sets in the
  bounding box, KMeans n_init=3, the smallest K with ``gap(K) >= gap(K+1) - s(K+1)``;
* ``xmeans-bic``: KMeans (n_init=3) at every K, the K of the best BIC of the spherical
  Gaussian model of Pelleg & Moore (2000) (X-means scores its splits with this BIC);
* ``hdbscan``: scikit-learn HDBSCAN (min_cluster_size = 5 % of the smallest true
  cluster, at least 5), the number of clusters it finds (no K range).

``--clinc``: real query intents (not clean clusters): ``suggest_k`` on all of CLINC150 (cosine,
``k_max = 300``; the peers' sweeps over 2..300 are left out: hours here) and on each of its
ten domains (15 intents, 2,250 queries, ``k_max = 30``, with the peers), reporting the
suggested K, whether a clear plateau supports it (``KSuggestion.supported``) and the ranking.

Prints a table per set (K found per seed, seconds) and an overview (how often each method
hits the true K), and writes JSON atomically (``benchmarks/results/bench_choose_k.json``).
"""
import _peer_threads  # noqa: F401,I001 -- first: before scikit-learn loads OpenMP
import argparse
import time
import warnings

import numpy as np

import _known_answers as ka
import _study

METHODS = ["fastanneal", "silhouette", "gap", "xmeans-bic", "hdbscan"]
REAL = ("iris", "wine", "digits")


def make_sets(seed):
    from sklearn import datasets
    from sklearn.preprocessing import StandardScaler
    out = {}
    for name in ("grid100", "a20", "a35", "a50", "dim32", "dim128", "dim1024", "unbalanced"):
        X, C = ka.load(name, seed)[:2]
        out[name] = (np.asarray(X, dtype=np.float64), C.shape[0], None)
    for D, K in ((2, 6), (16, 10), (128, 12), (1024, 8)):
        X, y = datasets.make_blobs(n_samples=150 * K, n_features=D, centers=K,
                                   cluster_std=1.0, center_box=(-10, 10), random_state=seed)
        out[f"blobs-d{D}"] = (X, K, y)
    for name, loader in (("iris", datasets.load_iris), ("wine", datasets.load_wine),
                         ("digits", datasets.load_digits)):
        d = loader()
        X = StandardScaler().fit_transform(d.data)
        out[name] = (X, int(len(np.unique(d.target))), d.target)
    return out


def kmeans_sweep(X, ks, seed):
    from sklearn.cluster import KMeans
    return {k: KMeans(k, n_init=3, random_state=seed).fit(X) for k in ks}


def by_silhouette(X, fits, seed):
    from sklearn.metrics import silhouette_score
    n = X.shape[0]
    sample = min(n, 3000)
    scores = {k: silhouette_score(X, f.labels_, sample_size=sample, random_state=seed)
              for k, f in fits.items()}
    return max(scores, key=scores.get)


def by_bic(X, fits):
    """Pelleg & Moore's BIC of a k-means model (spherical Gaussians, one shared variance)."""
    n, d = X.shape
    best, arg = -np.inf, None
    for k, f in fits.items():
        sizes = np.bincount(f.labels_, minlength=k).astype(float)
        var = f.inertia_ / max(n - k, 1) / d
        if var <= 0:
            continue
        ll = (np.sum(sizes[sizes > 0] * np.log(sizes[sizes > 0])) - n * np.log(n)
              - n * d / 2 * np.log(2 * np.pi * var) - (n - k) * d / 2)
        p = k * (d + 1)
        bic = ll - p / 2 * np.log(n)
        if bic > best:
            best, arg = bic, k
    return arg


def by_gap(X, ks, fits, seed, B=5):
    from sklearn.cluster import KMeans
    rng = np.random.default_rng(seed)
    lo, hi = X.min(axis=0), X.max(axis=0)
    logW = {k: np.log(fits[k].inertia_) for k in ks}
    ref = {k: [] for k in ks}
    for b in range(B):
        R = rng.uniform(lo, hi, size=X.shape)
        for k in ks:
            ref[k].append(np.log(KMeans(k, n_init=1, random_state=seed + b).fit(R).inertia_))
    gap = {k: np.mean(ref[k]) - logW[k] for k in ks}
    s = {k: np.std(ref[k]) * np.sqrt(1 + 1 / B) for k in ks}
    for k in ks[:-1]:
        if gap[k] >= gap[k + 1] - s[k + 1]:
            return k
    return ks[-1]


def by_hdbscan(X, K):
    from sklearn.cluster import HDBSCAN
    n = X.shape[0]
    mcs = max(5, int(0.05 * n / K))
    lab = HDBSCAN(min_cluster_size=mcs).fit(X).labels_
    return int(len(set(lab) - {-1}))


def run_set(X, K, seed, metric="euclidean"):
    import fastanneal
    k_max = max(8, 2 * K)
    ks = list(range(2, k_max + 1))
    res = {}
    t = time.perf_counter()
    s = fastanneal.suggest_k(X, k_max=k_max, metric=metric, random_state=seed)
    res["fastanneal"] = (s.best, time.perf_counter() - t)
    res["supported"] = bool(s.supported)
    t = time.perf_counter()
    fastanneal.AnnealedKMeans(k_max, metric=metric, random_state=seed).fit(X)
    res["fit_kmax"] = time.perf_counter() - t
    t = time.perf_counter()
    fits = kmeans_sweep(X, ks, seed)
    t_sweep = time.perf_counter() - t
    t = time.perf_counter()
    res["silhouette"] = (by_silhouette(X, fits, seed), t_sweep + time.perf_counter() - t)
    t = time.perf_counter()
    res["xmeans-bic"] = (by_bic(X, fits), t_sweep + time.perf_counter() - t)
    t = time.perf_counter()
    res["gap"] = (by_gap(X, ks, fits, seed), t_sweep + time.perf_counter() - t)
    t = time.perf_counter()
    res["hdbscan"] = (by_hdbscan(X, K), time.perf_counter() - t)
    return res


def run_clinc(quick):
    import fastanneal
    rows = []
    ds = _study.load("clinc150", quick)
    t = time.perf_counter()
    s = fastanneal.suggest_k(ds.X, k_max=2 * ds.K, metric="cosine", random_state=0)
    dt = time.perf_counter() - t
    print(f"clinc150     n={ds.X.shape[0]} true K {ds.K}: suggested {s.best} "
          f"(supported {s.supported}; top 5 {s.ranking[:5]}; widest "
          f"{np.round(np.sort(s.width)[::-1][:3], 2).tolist()}) {dt:.1f}s", flush=True)
    rows.append(dict(set="clinc150", seed=0, true_k=ds.K, method="fastanneal",
                     k=int(s.best), seconds=dt, supported=bool(s.supported),
                     ranking=[int(k) for k in s.ranking[:10]]))
    for dom in _study.CLINC_DOMAINS:
        ds = _study.load(f"clinc150/{dom}", quick)
        res = run_set(ds.X, ds.K, 0, metric="cosine")
        for m in METHODS:
            rows.append(dict(set=f"clinc150/{dom}", seed=0, true_k=ds.K, method=m,
                             k=int(res[m][0]), seconds=float(res[m][1]),
                             supported=res.get("supported")))
        print(f"{dom:12s} true K {ds.K:3d}  " + "  ".join(
            f"{m} {res[m][0]:>3d}" for m in METHODS)
            + f"  (fastanneal supported: {res['supported']})", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--sets", default=None)
    ap.add_argument("--clinc", action="store_true")
    ap.add_argument("--no-large", action="store_true",
                    help="leave out grid100 and a50 (the peers' sweeps dominate the run)")
    args = ap.parse_args(argv)
    n_seeds = args.seeds or (1 if args.quick else 3)
    warnings.simplefilter("ignore")
    import fastanneal
    Xw = np.random.default_rng(0).normal(size=(200, 4))
    fastanneal.suggest_k(Xw, k_max=4, random_state=0)          # compile outside the timings
    if args.clinc:
        rows = run_clinc(args.quick)
        _study.write_json(_study.RESULTS / "bench_choose_k_clinc.json", {"rows": rows})
        return
    rows = []
    for seed in range(n_seeds):
        sets = make_sets(seed)
        names = args.sets.split(",") if args.sets else list(sets)
        if args.no_large:
            names = [n for n in names if n not in ("grid100", "a50")]
        for name in names:
            X, K, _ = sets[name]
            res = run_set(X, K, seed)
            for m in METHODS:
                rows.append(dict(set=name, seed=seed, true_k=K, method=m, k=int(res[m][0]),
                                 seconds=float(res[m][1]), supported=res["supported"],
                                 fit_kmax_seconds=float(res["fit_kmax"])))
            print(f"{name:12s} seed {seed}  true K {K:3d}  " + "  ".join(
                f"{m} {res[m][0]:>3d} ({res[m][1]:.2f}s)" for m in METHODS)
                + f"  fit@k_max {res['fit_kmax']:.2f}s", flush=True)
    print()
    print("| method | true K found | on the synthetic sets | median seconds / fastanneal's |")
    print("|---|---|---|---|")
    fa_t = {(r["set"], r["seed"]): r["seconds"] for r in rows if r["method"] == "fastanneal"}
    summary = {}
    for m in METHODS:
        rs = [r for r in rows if r["method"] == m]
        hit = sum(r["k"] == r["true_k"] for r in rs)
        syn = [r for r in rs if r["set"] not in REAL]
        hit_syn = sum(r["k"] == r["true_k"] for r in syn)
        ratio = float(np.median([r["seconds"] / fa_t[(r["set"], r["seed"])] for r in rs]))
        summary[m] = dict(hits=hit, runs=len(rs), hits_synthetic=hit_syn,
                          runs_synthetic=len(syn), time_ratio_median=ratio)
        print(f"| {m} | {hit} / {len(rs)} | {hit_syn} / {len(syn)} | {ratio:.2f} |")
    # the cost target: suggest_k against one default fit at k_max, per set (median of seeds)
    print()
    print("| set | suggest_k s | fit@k_max s | ratio |")
    print("|---|---|---|---|")
    cost = {}
    for name in dict.fromkeys(r["set"] for r in rows):
        rs = [r for r in rows if r["method"] == "fastanneal" and r["set"] == name]
        a = float(np.median([r["seconds"] for r in rs]))
        b = float(np.median([r["fit_kmax_seconds"] for r in rs]))
        cost[name] = dict(suggest_k=a, fit_kmax=b, ratio=a / b)
        print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.2f} |")
    summary["cost"] = cost
    _study.write_json(_study.RESULTS / ("bench_choose_k_quick.json" if args.quick
                                        else "bench_choose_k.json"),
                      {"rows": rows, "summary": summary, "n_seeds": n_seeds})


if __name__ == "__main__":
    main()
