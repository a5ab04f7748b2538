"""The mini-batch route against scikit-learn's ``MiniBatchKMeans``: time and quality, default
and lighter settings, in one run.

    python benchmarks/study_minibatch_frontier.py --seeds 5      # about a minute here, quiet

Issue 16's target: "a mini-batch fit at least as fast as MiniBatchKMeans at equal or better
quality" on CLINC150 (22,500 x 384, K = 150, cosine) and on 200,000 x 64 blobs (K = 100).
``MiniBatchAnnealedKMeans``' default spends most of a small set's time seeding (k-means++,
Lloyd and the re-allocation moves on a sample of a quarter of the rows); the lighter
settings drop the moves, seed on 20 rows per cluster and anneal over fewer temperatures:

* ``default``: ``MiniBatchAnnealedKMeans(K)``;
* ``no moves``: ``reallocate=False``;
* ``light``: ``reallocate=False, init_size=20 * K, n_steps=10``;
* scikit-learn ``MiniBatchKMeans(K)`` (its defaults: batch 1,024, k-means++ on 3,072 rows,
  early stopping).

The seeds are interleaved (all methods for seed 0, then seed 1, ...), every method runs
once before the timings (compilation, caches). Quality: ARI against the generating labels
(CLINC150: the intents) and the k-means objective of the returned partition (SSE of the
rows, unit rows for cosine) relative to the best partition any method found. Prints a
table (medians over the seeds) and writes JSON (default
``benchmarks/results/study_minibatch_frontier.json``).
"""
import _peer_threads  # noqa: F401,I001 -- first: before scikit-learn loads OpenMP
import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def datasets(names):
    import _study
    out = []
    if "clinc150" in names:
        ds = _study._clinc(None, False)
        X = np.ascontiguousarray(ds.X, dtype=np.float32)
        X /= np.linalg.norm(X, axis=1, keepdims=True)       # cosine: the rows the fit sees
        out.append(("clinc150", X, ds.y, ds.K, "cosine"))
    if "blobs" in names:
        from study_minibatch_seeding import blobs_200k
        out.append(blobs_200k())
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--datasets", default="clinc150,blobs")
    ap.add_argument("--json", default=str(HERE / "results" / "study_minibatch_frontier.json"))
    a = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    from sklearn.cluster import MiniBatchKMeans
    from sklearn.metrics import adjusted_rand_score

    import fastanneal as fa
    from _study import partition_sse
    t_all = time.perf_counter()
    rows, summary = [], []
    for name, X, y, K, metric in datasets(a.datasets.split(",")):
        methods = {
            "fastanneal default": lambda s: fa.MiniBatchAnnealedKMeans(
                K, metric=metric, random_state=s).fit(X).labels_,
            "fastanneal no moves (reallocate=False)": lambda s: fa.MiniBatchAnnealedKMeans(
                K, metric=metric, reallocate=False, random_state=s).fit(X).labels_,
            "fastanneal light (no moves, init_size=20K, n_steps=10)":
                lambda s: fa.MiniBatchAnnealedKMeans(
                    K, metric=metric, reallocate=False, init_size=20 * K, n_steps=10,
                    random_state=s).fit(X).labels_,
            "scikit-learn MiniBatchKMeans (defaults)":
                lambda s: MiniBatchKMeans(K, random_state=s).fit(X).labels_,
        }
        for fn in methods.values():                 # first calls outside the timings
            fn(0)
        res = {m: [] for m in methods}
        for seed in range(a.seeds):
            for m, fn in methods.items():
                t0 = time.perf_counter()
                lab = fn(seed)
                dt = time.perf_counter() - t0
                res[m].append((dt, float(adjusted_rand_score(y, lab)), partition_sse(X, lab),
                               os.getloadavg()[0]))
        best = min(r[2] for rs in res.values() for r in rs)
        ref = float(np.median([r[0] for r in res["scikit-learn MiniBatchKMeans (defaults)"]]))
        print(f"\n{name} (N = {X.shape[0]:,}, D = {X.shape[1]}, K = {K}, {metric}; "
              f"{a.seeds} seeds, medians)")
        print(f"{'method':56s} {'s':>6s} {'x MBKM':>7s} {'ARI':>6s} {'ARI min':>8s} "
              f"{'SSE/best':>9s}")
        for m, rs in res.items():
            secs = [r[0] for r in rs]
            aris = [r[1] for r in rs]
            sse = [r[2] / best for r in rs]
            for seed, r in enumerate(rs):
                rows.append({"dataset": name, "method": m, "seed": seed, "seconds": r[0],
                             "ari": r[1], "sse": r[2], "load1": r[3]})
            s = {"dataset": name, "method": m, "median_seconds": float(np.median(secs)),
                 "time_vs_mbkm": float(np.median(secs)) / ref,
                 "median_ari": float(np.median(aris)), "min_ari": float(min(aris)),
                 "mean_ari": float(np.mean(aris)),
                 "median_sse_vs_best": float(np.median(sse))}
            summary.append(s)
            print(f"{m:56s} {s['median_seconds']:6.2f} {s['time_vs_mbkm']:7.2f} "
                  f"{s['median_ari']:6.3f} {s['min_ari']:8.3f} {s['median_sse_vs_best']:9.4f}",
                  flush=True)
    loads = [r["load1"] for r in rows]
    print(f"\n1-min load average during the timings: {min(loads):.1f}-{max(loads):.1f}")
    out = {"rows": rows, "summary": summary, "seeds": a.seeds,
           "seconds": time.perf_counter() - t_all, "cpus": os.cpu_count(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    import _study
    _study.write_json(a.json, out)


if __name__ == "__main__":
    main()
