"""Quality benchmark: one annealed fit vs scikit-learn KMeans (n_init=1 and n_init=10).

    python benchmarks/bench_quality.py             # CLINC150 + two synthetic sets, 5 seeds
    python benchmarks/bench_quality.py --quick     # CLINC150 subset + small synthetic, 2 seeds
    python benchmarks/bench_quality.py --datasets clinc150,clinc-domains --seeds 10 \
        --schedules geometric,geometric-norealloc        # the annealing-quality targets

For every method: ARI and NMI against the true labels, the k-means objective of the
returned partition (``SSE = sum_i w_i ||x_i - mean of its cluster||^2``, computed here in
float64 for every method alike, so spherical and Euclidean fits are compared on the same
scale), the objective of the fitted metric (``obj``: spherical k-means objective
``sum_i w_i (2 - 2 cos(x_i, c_k))`` with unit centers for the cosine datasets, SSE otherwise),
and wall time; ratios against ``sklearn n_init=10`` from the same run. Schedules are names
of ``AnnealedKMeans(schedule=...)``; ``NAME-norealloc`` adds ``reallocate=False``,
``NAME@F`` sets ``auto_start_fraction=F`` (a hotter or colder start).
``clinc-domains`` runs the ten per-domain subsets of CLINC150 (15 intents each, K = 15).
faiss (``Kmeans``, 25 iterations; spherical for cosine) runs when installed. Prints a
table, writes JSON (default ``benchmarks/results/bench_quality.json``).
"""
import _peer_threads  # noqa: F401,I001 -- first: before scikit-learn loads OpenMP
import argparse
import json
import os
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CLINC = HERE.parents[1] / "shared" / "data" / "clinc150.parquet"


def load_clinc(path=CLINC, n_labels=None):
    import pyarrow.parquet as pq
    t = pq.read_table(path, columns=["embedding", "label"])
    X = np.asarray(t.column("embedding").combine_chunks().flatten(), dtype=np.float32)
    X = X.reshape(t.num_rows, -1)
    labels = np.asarray(t.column("label").to_pylist())
    _, y = np.unique(labels, return_inverse=True)
    if n_labels:
        keep = y < n_labels
        X, y = X[keep], y[keep]
    return np.ascontiguousarray(X), y


def clinc_domains(names=None, path=CLINC):
    """``(domain, X, y)`` for the CLINC150 domains ``names`` (default: all ten, in
    ``_study.CLINC_DOMAINS`` order): float32 rows as stored, intents numbered 0..14."""
    import pyarrow.parquet as pq
    import _study
    t = pq.read_table(path, columns=["embedding", "label"])
    Xall = np.asarray(t.column("embedding").combine_chunks().flatten(),
                      dtype=np.float32).reshape(t.num_rows, -1)
    lab = np.asarray(t.column("label").to_pylist())
    for dom in (names or _study.CLINC_DOMAINS):
        keep = np.isin(lab, _study.CLINC_DOMAINS[dom])
        _, y = np.unique(lab[keep], return_inverse=True)
        yield dom, np.ascontiguousarray(Xall[keep]), y


def synthetic_blobs(n, d, k, rng, spread=1.0):
    means = rng.standard_normal((k, d)) * 3.0
    y = rng.integers(0, k, n)
    X = means[y] + spread * rng.standard_normal((n, d))
    return X.astype(np.float32), y


def synthetic_unequal_aniso(n, d, k, rng):
    sizes = rng.dirichlet(np.full(k, 0.7)) * n
    y = np.repeat(np.arange(k), np.maximum(sizes.astype(int), 5))[:n]
    rng.shuffle(y)
    means = rng.standard_normal((k, d)) * 2.5
    A = rng.standard_normal((k, d, d)) / np.sqrt(d) * 1.2
    X = means[y] + np.einsum("nij,nj->ni", A[y], rng.standard_normal((len(y), d)))
    return X.astype(np.float32), y


def partition_sse(X, labels):
    X = X.astype(np.float64)
    K = labels.max() + 1
    cnt = np.bincount(labels, minlength=K).astype(float)
    S = np.zeros((K, X.shape[1]))
    np.add.at(S, labels, X)
    sq = float((X * X).sum())
    nz = cnt > 0
    return sq - float(((S[nz] ** 2).sum(1) / cnt[nz]).sum())


def spherical_objective(X, labels):
    """``sum_i (2 - 2 x_i . c_k)`` with ``c_k`` the unit mean direction of cluster k (rows
    normalized first): the objective of ``metric="cosine"``."""
    X = X.astype(np.float64)
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    K = labels.max() + 1
    S = np.zeros((K, X.shape[1]))
    np.add.at(S, labels, X)
    return float(2.0 * X.shape[0] - 2.0 * np.linalg.norm(S, axis=1).sum())


def run_methods(name, X, y, K, metric, seeds, schedules):
    from sklearn.cluster import KMeans
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score
    import fastanneal as fa
    rows = []

    def record(method, seed, labels, seconds):
        rows.append({"dataset": name, "method": method, "seed": seed,
                     "ari": float(adjusted_rand_score(y, labels)),
                     "nmi": float(normalized_mutual_info_score(y, labels)),
                     "sse": partition_sse(X, labels),
                     "obj": (spherical_objective(X, labels) if metric == "cosine"
                             else partition_sse(X, labels)), "seconds": seconds})

    Xs = X
    if metric == "cosine":     # scikit-learn works on the unit vectors
        Xs = X / np.linalg.norm(X, axis=1, keepdims=True)
    fa.AnnealedKMeans(3, random_state=0).fit(X[:500])   # compile outside the timings
    for seed in seeds:
        for sched in schedules:
            name_, _, flag = sched.partition("-")
            name_, _, frac = name_.partition("@")
            kw = {"auto_start_fraction": float(frac)} if frac else {}
            t = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m = fa.AnnealedKMeans(K, metric=metric, schedule=name_, random_state=seed,
                                      reallocate=flag != "norealloc", **kw).fit(X)
            record(f"fastanneal {sched}", seed, m.labels_, time.perf_counter() - t)
        try:
            import faiss
        except ImportError:
            faiss = None
        if faiss is not None:
            t = time.perf_counter()
            fk = faiss.Kmeans(X.shape[1], K, niter=25, seed=seed, spherical=metric == "cosine",
                              verbose=False)
            Xf = np.ascontiguousarray(Xs, dtype=np.float32)
            fk.train(Xf)
            lab = fk.index.search(Xf, 1)[1][:, 0]
            record("faiss niter=25", seed, lab, time.perf_counter() - t)
        for n_init in (1, 10):
            t = time.perf_counter()
            km = KMeans(K, n_init=n_init, random_state=seed).fit(Xs)
            record(f"sklearn n_init={n_init}", seed, km.labels_, time.perf_counter() - t)
    return rows


def summarize(rows):
    out = []
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        R = [r for r in rows if r["dataset"] == ds]
        ref = [r for r in R if r["method"] == "sklearn n_init=10"]
        ref_t = np.mean([r["seconds"] for r in ref])
        ref_sse = np.mean([r["sse"] for r in ref])
        for meth in dict.fromkeys(r["method"] for r in R):
            M = [r for r in R if r["method"] == meth]
            out.append({"dataset": ds, "method": meth, "runs": len(M),
                        "ari": float(np.mean([r["ari"] for r in M])),
                        "ari_min": float(np.min([r["ari"] for r in M])),
                        "nmi": float(np.mean([r["nmi"] for r in M])),
                        "sse": float(np.mean([r["sse"] for r in M])),
                        "sse_vs_ref": float(np.mean([r["sse"] for r in M]) / ref_sse),
                        "obj": float(np.median([r["obj"] for r in M])),
                        "obj_vs_ref": float(np.median([r["obj"] for r in M])
                                            / np.median([r["obj"] for r in ref])),
                        "ari_median": float(np.median([r["ari"] for r in M])),
                        "seconds": float(np.mean([r["seconds"] for r in M])),
                        "time_vs_ref": float(np.mean([r["seconds"] for r in M]) / ref_t)})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--schedules", default="geometric,critical")
    ap.add_argument("--datasets", default="clinc150,blobs,aniso")
    ap.add_argument("--json", default=str(HERE / "results" / "bench_quality.json"))
    args = ap.parse_args(argv)
    seeds = list(range(args.seeds or (2 if args.quick else 5)))
    schedules = args.schedules.split(",")
    rng = np.random.default_rng(12345)
    rows = []
    for ds in args.datasets.split(","):
        if ds == "clinc150":
            if not CLINC.exists():
                print(f"skipping clinc150: {CLINC} not found")
                continue
            X, y = load_clinc(n_labels=30 if args.quick else None)
            rows += run_methods("clinc150" + ("[30 intents]" if args.quick else ""), X, y,
                                int(y.max() + 1), "cosine", seeds, schedules)
        elif ds == "clinc-domains":
            if not CLINC.exists():
                print(f"skipping clinc-domains: {CLINC} not found")
                continue
            for dom, X, y in clinc_domains():
                rows += run_methods(f"clinc150/{dom}", X, y, int(y.max() + 1), "cosine",
                                    seeds, schedules)
        elif ds == "blobs":
            n, k = (5000, 20) if args.quick else (30000, 50)
            X, y = synthetic_blobs(n, 32, k, rng, spread=2.2)
            rows += run_methods("blobs", X, y, k, "euclidean", seeds, schedules)
        elif ds == "aniso":
            n, k = (5000, 15) if args.quick else (30000, 40)
            X, y = synthetic_unequal_aniso(n, 16, k, rng)
            rows += run_methods("aniso-unequal", X, y, k, "euclidean", seeds, schedules)
        else:
            raise SystemExit(f"unknown dataset {ds!r}")
    summ = summarize(rows)
    print(f"\n{'dataset':<28} {'method':<30} {'ARI':>6} {'med':>6} {'min':>6} {'NMI':>6} "
          f"{'SSE/ref':>8} {'obj/ref':>8} {'sec':>7} {'t/ref':>6}")
    for s in summ:
        print(f"{s['dataset']:<28} {s['method']:<30} {s['ari']:>6.3f} {s['ari_median']:>6.3f} "
              f"{s['ari_min']:>6.3f} {s['nmi']:>6.3f} {s['sse_vs_ref']:>8.4f} "
              f"{s['obj_vs_ref']:>8.5f} {s['seconds']:>7.2f} {s['time_vs_ref']:>6.2f}")
    print("ref = sklearn KMeans n_init=10 in the same run; SSE = k-means objective of the "
          "returned partition")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rows": rows, "summary": summ, "cpus": os.cpu_count(),
                               "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    os.replace(tmp, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
