"""Mini-batch quality at K = 1,000 on query-log-like data (the log of ``bench_scale.py``).

    python benchmarks/study_minibatch_k1000.py [--log PATH] [--skip-default]

Takes the first four row groups (262,144 rows) of the ``bench_scale.py`` log (1,000 true
topics, each at least 67 rows here) into memory and fits K = 1,000 with scikit-learn's
``MiniBatchKMeans(n_init=1, batch_size=4096)`` and ``MiniBatchAnnealedKMeans(metric="cosine")``
-- default, ``reallocate=False``, ``reallocate=False`` with 3 epochs and with 16,384-row
batches. Prints seconds and ARI against the topics; writes JSON. (It was written to find out
why the 10-million-row run of BENCHMARKS section 16 first reached ARI 0.61; see there.)
"""
import _peer_threads  # noqa: F401,I001 -- first: before scikit-learn loads OpenMP
import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "fastanneal_scale",
                                                   "log_10000000_384_1000.parquet"))
    ap.add_argument("--skip-default", action="store_true",
                    help="leave out the default fit (the re-allocation is slow at K = 1,000)")
    a = ap.parse_args()
    import pyarrow.parquet as pq
    from sklearn.cluster import MiniBatchKMeans

    import fastanneal as fa
    from fastanneal._cli_results import adjusted_rand_index
    warnings.simplefilter("ignore")
    t = pq.ParquetFile(a.log).read_row_groups([0, 1, 2, 3], columns=["embedding", "topic"])
    X = t.column(0).combine_chunks().flatten().to_numpy().reshape(t.num_rows, -1)
    y = t.column(1).to_numpy()
    runs = [("sklearn MiniBatchKMeans(n_init=1, batch_size=4096)",
             lambda: MiniBatchKMeans(1000, n_init=1, random_state=0, batch_size=4096).fit(X))]
    if not a.skip_default:
        runs.append(("MiniBatchAnnealedKMeans default",
                     lambda: fa.MiniBatchAnnealedKMeans(1000, metric="cosine",
                                                        random_state=0).fit(X)))
    for kw in ({}, {"n_epochs": 3}, {"n_epochs": 3, "batch_size": 16384}):
        runs.append((f"MiniBatchAnnealedKMeans reallocate=False {kw or ''}",
                     lambda kw=kw: fa.MiniBatchAnnealedKMeans(
                         1000, metric="cosine", reallocate=False, random_state=0,
                         **kw).fit(X)))
    out = []
    for name, fit in runs:
        t0 = time.perf_counter()
        est = fit()
        dt = time.perf_counter() - t0
        ari = adjusted_rand_index(y, est.labels_)
        out.append({"run": name, "seconds": dt, "ari": ari})
        print(f"{name:62s} {dt:7.1f} s  ARI {ari:.3f}", flush=True)
    path = HERE / "results" / "study_minibatch_k1000.json"
    with open(str(path) + ".tmp", "w") as f:
        json.dump({"rows": int(X.shape[0]), "topics": int(len(np.unique(y))), "runs": out}, f,
                  indent=1)
    os.replace(str(path) + ".tmp", path)


if __name__ == "__main__":
    main()
