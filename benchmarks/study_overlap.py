"""Heavily overlapping low-dimensional mixtures: where does the default fit stand against
k-means restarts? (the README's "Not everywhere" line under the hardening study)

    python benchmarks/study_overlap.py [--seeds 8] [--json PATH]

Data: scikit-learn ``make_blobs(n_samples=4000 + 125 * seed, centers=30, n_features=2,
cluster_std=1.5, random_state=seed)`` (the cluster centers drawn in the default box
(-10, 10): 30 clusters of spread 1.5 in a 20 x 20 square overlap heavily), seeds 0..7.
Fits, all with ``random_state=seed``: the default ``AnnealedKMeans(30)``,
``schedule="critical"``, ``n_init=3``, one k-means++ Lloyd run (scikit-learn ``KMeans(30,
n_init=1)``) and ten restarts (``n_init=10``). Reported per seed: each fit's SSE relative to
the ten restarts' (``SSE / SSE_10 - 1``, in %; negative: lower than the restarts) and its
time in seconds (read loosely: shared cores). Writes JSON atomically (default
``benchmarks/results/study_overlap.json``).
"""
import _peer_threads  # noqa: F401,I001 -- first: before scikit-learn loads OpenMP
import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _study  # noqa: E402
from bench_quality import partition_sse as sse  # noqa: E402

import fastanneal as fa  # noqa: E402

FITS = ("default", "critical", "n_init=3", "kmeans++ x1")


def main(argv=None):
    from sklearn.cluster import KMeans
    from sklearn.datasets import make_blobs
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--json", default=str(HERE / "results" / "study_overlap.json"))
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    X0, _ = make_blobs(500, centers=5, n_features=2, random_state=0)
    fa.AnnealedKMeans(5, random_state=0).fit(X0)                     # compile outside timings
    rows = []
    print(f"{'seed':>4s} {'n':>5s} " + " ".join(f"{f:>12s}" for f in FITS)
          + "   (SSE vs ten restarts, %)")
    for seed in range(args.seeds):
        X, _ = make_blobs(n_samples=4000 + 125 * seed, centers=30, n_features=2,
                          cluster_std=1.5, random_state=seed)
        makers = {
            "default": lambda: fa.AnnealedKMeans(30, random_state=seed),
            "critical": lambda: fa.AnnealedKMeans(30, schedule="critical", random_state=seed),
            "n_init=3": lambda: fa.AnnealedKMeans(30, n_init=3, random_state=seed),
            "kmeans++ x1": lambda: KMeans(30, n_init=1, random_state=seed),
            "ten restarts": lambda: KMeans(30, n_init=10, random_state=seed),
        }
        got = {}
        for name, make in makers.items():
            t = time.perf_counter()
            m = make().fit(X)
            got[name] = (sse(X, m.labels_), time.perf_counter() - t)
        ref = got["ten restarts"][0]
        row = {"seed": seed, "n": int(X.shape[0]), "sse_ten_restarts": ref,
               "seconds_ten_restarts": got["ten restarts"][1]}
        for name in FITS:
            row[f"vs_ten_pct[{name}]"] = 100.0 * (got[name][0] / ref - 1.0)
            row[f"seconds[{name}]"] = got[name][1]
        rows.append(row)
        print(f"{seed:4d} {X.shape[0]:5d} " + " ".join(
            f"{row[f'vs_ten_pct[{f}]']:+12.3f}" for f in FITS), flush=True)
    summary = {}
    for name in FITS:
        v = np.array([r[f"vs_ten_pct[{name}]"] for r in rows])
        summary[name] = {"above_ten_restarts": int((v > 1e-9).sum()), "seeds": len(v),
                         "min_pct": float(v.min()), "median_pct": float(np.median(v)),
                         "max_pct": float(v.max()),
                         "mean_seconds": float(np.mean([r[f"seconds[{name}]"] for r in rows]))}
        s = summary[name]
        print(f"{name:>12s}: above ten restarts on {s['above_ten_restarts']} of {s['seeds']} "
              f"seeds; {s['min_pct']:+.2f} .. {s['max_pct']:+.2f} % (median "
              f"{s['median_pct']:+.2f} %), {s['mean_seconds']:.2f} s a fit")
    print(f"ten restarts: {np.mean([r['seconds_ten_restarts'] for r in rows]):.2f} s a fit")
    _study.write_json(args.json, {"rows": rows, "summary": summary,
                                  "machine": _study.machine_info()})


if __name__ == "__main__":
    main()
