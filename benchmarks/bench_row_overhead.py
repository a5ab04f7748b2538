"""Per-row cost of a soft moments pass at small K and D (where a pass is mostly per-row
work, not arithmetic): nanoseconds per row of ``fastanneal.moments`` on 30,000 rows of
2-D Gaussian data at T = 10 (many rows soft), best of 40 calls, K in {1, 2, 20, 60}.

    python benchmarks/bench_row_overhead.py [--json PATH]

To compare two versions in the same hour, run it with ``PYTHONPATH=<other checkout>`` too.
Writes JSON (default ``benchmarks/results/bench_row_overhead.json``, atomically).
"""
import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

import fastanneal as fa

HERE = Path(__file__).resolve().parent


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=str(HERE / "results" / "bench_row_overhead.json"))
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    n = 30_000
    X = rng.normal(size=(n, 2)) * 10
    out = {}
    for K in (1, 2, 20, 60):
        C = X[:K].copy()
        m = fa.moments(X, C, 10.0)                        # compiles / loads the kernels
        best = np.inf
        for _ in range(40):
            t = time.perf_counter()
            fa.moments(X, C, 10.0)
            best = min(best, time.perf_counter() - t)
        out[K] = {"ns_per_row": best / n * 1e9, "kept_per_row": m.nnz / m.rows}
        print(f"K = {K:3d}: {best / n * 1e9:6.0f} ns/row ({m.nnz / m.rows:.2f} kept entries a row)")
    res = {"n": n, "D": 2, "T": 10.0, "rows": out, "fastanneal": fa.__file__,
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    tmp = a.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, a.json)
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
