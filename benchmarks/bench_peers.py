"""Peers: speed and quality of fastanneal against scikit-learn KMeans / MiniBatchKMeans,
faiss (if installed) and dask-ml (if installed), in one run.

    python benchmarks/bench_peers.py            # CLINC150 (22.5k x 384, K=150), blobs 200k x 64 K=100
    python benchmarks/bench_peers.py --quick    # CLINC150 3k rows, blobs 20k x 32 K=20, 1 seed

Every method fits the same float32 rows (CLINC150: unit vectors; fastanneal with
``metric="cosine"``, the peers Euclidean on the unit rows, which orders points the same way),
seeds interleaved. Per method: fit seconds (median over seeds), the time as a multiple of
scikit-learn ``KMeans(n_init=1)`` and of one GEMM ``X @ C.T`` of the same shape (both timed
in this run), the k-means objective (SSE) of the returned partition computed alike in float64
for every method, its ratio to the best SSE of the run, and ARI against the true labels.
BLAS is warmed up first (``docs/benchmarking.md``). Prints a table, writes JSON
(default ``benchmarks/results/bench_peers.json``).
"""
import _peer_threads  # noqa: F401,I001 -- first: before scikit-learn loads OpenMP
import argparse
import logging
import time
import warnings

import numpy as np

import _study


def gemm_seconds(X, K, repeats=3):
    C = X[:K].copy()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        X @ C.T
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def warm_up(X, K):
    import fastanneal as fa
    Xw = np.ascontiguousarray(np.random.default_rng(0).standard_normal((2048, 384)),
                              dtype=np.float32)
    Xw @ Xw[:512].T
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fa.AnnealedKMeans(4, random_state=0).fit(X[:2000])
        fa.AnnealedKMeans(4, metric="cosine", random_state=0).fit(X[:2000])


def methods(K, metric, n, have):
    """(name, fit(X, seed) -> labels) pairs. Peers run with their library defaults except
    where a setting is named in the method's label."""
    import fastanneal as fa
    from sklearn.cluster import KMeans, MiniBatchKMeans

    def fa_fit(met, **kw):
        return lambda X, seed: fa.AnnealedKMeans(K, metric=met, random_state=seed,
                                                 **kw).fit(X).labels_

    def fa_minibatch(X, seed):
        m = fa.AnnealedKMeans(K, metric=metric, batch_size=4096, random_state=seed).fit(X)
        return m.predict(X)

    def sk(n_init):
        return lambda X, seed: KMeans(K, n_init=n_init, random_state=seed).fit(X).labels_

    def mbk(X, seed):         # scikit-learn defaults: batch_size=1024, n_init="auto" (1)
        return MiniBatchKMeans(K, random_state=seed).fit(X).labels_

    out = [("fastanneal", fa_fit(metric)),
           # the algorithm of the previous release (no re-allocation moves): the engine
           # redesign must not make it slower
           ("fastanneal reallocate=False", fa_fit(metric, reallocate=False))]
    if metric == "cosine":    # the peers are Euclidean: also show fastanneal on their terms
        out.append(("fastanneal metric=euclidean", fa_fit("euclidean")))
    out += [("fastanneal batch_size=4096", fa_minibatch),
            ("sklearn KMeans n_init=1", sk(1)), ("sklearn KMeans n_init=10", sk(10)),
            ("sklearn MiniBatchKMeans", mbk)]
    if have["faiss"]:
        import faiss

        def fa_iss(niter, spherical=False):
            def fit(X, seed):
                km = faiss.Kmeans(X.shape[1], K, niter=niter, nredo=1, seed=seed + 1,
                                  verbose=False, spherical=spherical,
                                  max_points_per_centroid=n)      # no subsampling
                km.train(X)
                return km.index.search(X, 1)[1].ravel()
            return fit
        out.append(("faiss Kmeans niter=25 (default)", fa_iss(25)))
        out.append(("faiss Kmeans niter=100", fa_iss(100)))
        if metric == "cosine":
            out.append(("faiss Kmeans spherical niter=25", fa_iss(25, True)))
    if have["dask_ml"]:
        import dask
        import dask.array as da
        from dask_ml.cluster import KMeans as DKMeans

        def dml(X, seed):
            Xd = da.from_array(X, chunks=(max(2048, -(-len(X) // 8)), X.shape[1]))
            with dask.config.set(scheduler="threads"):
                m = DKMeans(n_clusters=K, random_state=seed).fit(Xd)
                return np.asarray(m.labels_.compute() if hasattr(m.labels_, "compute")
                                  else m.labels_)
        out.append(("dask-ml KMeans (k-means||)", dml))
    return out


class _LogCapture(logging.Handler):
    """Collects warnings that peers log (dask-ml reports a short k-means|| init this way)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def available():
    have = {}
    for name, mod in (("faiss", "faiss"), ("dask_ml", "dask_ml.cluster")):
        try:
            __import__(mod)
            have[name] = True
        except Exception:            # noqa: BLE001 -- optional peer, reported as absent
            have[name] = False
    return have


def run_dataset(name, X, y, K, metric, seeds, have, skip=()):
    from sklearn.metrics import adjusted_rand_score
    warm_up(X, K)
    gemm = gemm_seconds(X, K)
    rows = []
    meths = [(n, f) for n, f in methods(K, metric, len(X), have) if n not in skip]
    sub = X[np.random.default_rng(0).choice(len(X), min(len(X), max(20 * K, 2000)),
                                            replace=False)]
    for _, fit in meths:          # each peer's own first-call costs, outside the timings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit(sub, 0)
    cap = _LogCapture()
    logging.getLogger().addHandler(cap)
    try:
        for seed in seeds:
            for mname, fit in meths:
                cap.messages.clear()
                with warnings.catch_warnings(record=True) as wlist:
                    warnings.simplefilter("always")
                    t = time.perf_counter()
                    labels = np.asarray(fit(X, seed)).astype(np.int64)
                    sec = time.perf_counter() - t
                assert labels.shape == (len(X),)
                notes = sorted({str(w.message).splitlines()[0][:160] for w in wlist}
                               | {m[:160] for m in cap.messages})
                rows.append({"dataset": name, "method": mname, "seed": seed, "seconds": sec,
                             "sse": _study.partition_sse(X, labels, K),
                             "ari": float(adjusted_rand_score(y, labels)),
                             "clusters_used": int(len(np.unique(labels))), "notes": notes})
                print(f"  {name:<10} {mname:<32} seed {seed}: {sec:7.2f} s  "
                      f"SSE {rows[-1]['sse']:.6g}  ARI {rows[-1]['ari']:.3f}"
                      + (f"  [{'; '.join(notes)}]" if notes else ""), flush=True)
    finally:
        logging.getLogger().removeHandler(cap)
    return rows, gemm


def summarize(rows, gemms):
    out = []
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        R = [r for r in rows if r["dataset"] == ds]
        best = min(r["sse"] for r in R)
        ref_t = np.median([r["seconds"] for r in R if r["method"] == "sklearn KMeans n_init=1"])
        for m in dict.fromkeys(r["method"] for r in R):
            M = [r for r in R if r["method"] == m]
            sec = float(np.median([r["seconds"] for r in M]))
            sse = float(np.mean([r["sse"] for r in M]))
            secs = [r["seconds"] for r in M]
            out.append({"dataset": ds, "method": m, "runs": len(M), "seconds": sec,
                        "seconds_min": float(min(secs)), "seconds_max": float(max(secs)),
                        "notes": sorted({n for r in M for n in r.get("notes", [])}),
                        "time_vs_sklearn1": sec / ref_t, "time_vs_gemm": sec / gemms[ds],
                        "sse": sse, "sse_vs_best": sse / best,
                        "ari": float(np.mean([r["ari"] for r in M])),
                        "ari_min": float(np.min([r["ari"] for r in M]))})
    return out


def run(quick=False, seeds=None, datasets=("clinc150", "blobs"), skip=()):
    have = available()
    seeds = list(range(seeds if seeds is not None else (1 if quick else 3)))
    rows, gemms, shapes = [], {}, {}
    for ds in datasets:
        if ds == "clinc150":
            if not _study.clinc_available():
                print(f"skipping clinc150: {_study.CLINC} not found")
                continue
            d = _study.load("clinc150", quick)
            X, y, K, metric = d.X.astype(np.float32), d.y, d.K, "cosine"
        elif ds == "blobs":
            n, dim, K = (20000, 32, 20) if quick else (200000, 64, 100)
            rng = np.random.default_rng(7)
            means = rng.standard_normal((K, dim)) * 1.6
            y = rng.integers(0, K, n)
            X = (means[y] + rng.standard_normal((n, dim))).astype(np.float32)
            metric = "euclidean"
        else:
            raise SystemExit(f"unknown dataset {ds!r}")
        X = np.ascontiguousarray(X)
        shapes[ds] = {"n": len(X), "d": X.shape[1], "K": K}
        print(f"{ds}: n={len(X)}, d={X.shape[1]}, K={K}")
        r, g = run_dataset(ds, X, y, K, metric, seeds, have, skip)
        rows += r
        gemms[ds] = g
    return {"rows": rows, "summary": summarize(rows, gemms), "gemm_seconds": gemms,
            "shapes": shapes, "peers_available": have, "quick": quick}


def report(res):
    _study.print_table(res["summary"], [
        ("dataset", "dataset", "s"), ("method", "method", "s"), ("runs", "runs", "d"),
        ("seconds", "sec", ".2f"), ("seconds_min", "min", ".2f"), ("seconds_max", "max", ".2f"),
        ("time_vs_sklearn1", "t/sk1", ".2f"),
        ("time_vs_gemm", "t/GEMM", ".1f"), ("sse_vs_best", "SSE/best", ".4f"),
        ("ari", "ARI", ".3f"), ("ari_min", "ARI min", ".3f")],
        "peers (same run; t/sk1 = time / sklearn KMeans n_init=1; GEMM = one X @ C.T)")
    missing = [k for k, v in res["peers_available"].items() if not v]
    if missing:
        print("not installed (no figure):", ", ".join(missing))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--datasets", default="clinc150,blobs")
    ap.add_argument("--json", default=str(_study.RESULTS / "bench_peers.json"))
    args = ap.parse_args(argv)
    res = run(quick=args.quick, seeds=args.seeds, datasets=args.datasets.split(","))
    report(res)
    _study.write_json(args.json, res)


if __name__ == "__main__":
    main()
