"""Do fits drift with the thread count or the Dask chunking? (README "Reproducibility",
``docs/guide/dask.md``)

    python benchmarks/study_reproducibility.py [--json PATH]

Data: heavily overlapping clusters, 20,000 x 32 float64, K = 20 (centers ~ N(0, I), rows =
center + N(0, I): neighbouring clusters overlap), and separated ones (centers ~ N(0, 25 I)).
For the default solver and ``solver="gradient"``:

* **threads**: the same fit in two fresh processes, ``NUMBA_NUM_THREADS=1`` and ``=2`` (the
  kernels' row ranges, hence the float additions, follow the thread count);
* **Dask chunking**: the fit on a ``dask.array`` of 2,000-row chunks (a local cluster of two
  one-thread workers) against the in-memory fit.

Reported: the number of rows whose label differs (after matching the clusters by their
centers), the ARI between the two fits, the relative difference of the objective ``J`` and
the largest center difference. Writes JSON atomically (default
``benchmarks/results/study_reproducibility.json``).
"""
import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _study  # noqa: E402

N, D, K = 20_000, 32, 20
CHILD = r"""
import json, sys, warnings, numpy as np
sys.path.insert(0, sys.argv[1])
from study_reproducibility import data, fit
warnings.simplefilter("ignore")
m = fit(data(sys.argv[2]), sys.argv[3])
print(json.dumps({"centers": m.cluster_centers_.tolist(), "labels": m.labels_.tolist(),
                  "inertia": m.inertia_}))
"""


def data(kind):
    rng = np.random.default_rng(7)
    spread = 1.0 if kind == "overlapping" else 5.0
    C = rng.normal(size=(K, D)) * spread
    return C[rng.integers(0, K, N)] + rng.normal(size=(N, D))


def fit(X, solver):
    import fastanneal as fa
    return fa.AnnealedKMeans(K, solver=solver, random_state=0).fit(X)


def compare(a_centers, a_labels, a_J, b_centers, b_labels, b_J):
    from scipy.optimize import linear_sum_assignment

    from fastanneal.cli import adjusted_rand_index
    A, B = np.asarray(a_centers), np.asarray(b_centers)
    cost = ((A[:, None, :] - B[None]) ** 2).sum(-1)
    r, c = linear_sum_assignment(cost)
    perm = np.empty(K, dtype=np.int64)
    perm[c] = r                               # b's cluster c is a's cluster perm[c]
    la, lb = np.asarray(a_labels), perm[np.asarray(b_labels)]
    return {"labels_differ": int((la != lb).sum()),
            "ari": float(adjusted_rand_index(la, lb)),
            "J_rel_diff": abs(a_J - b_J) / abs(a_J),
            "max_center_diff": float(np.abs(A[r] - B[c]).max())}


def in_process(kind, solver, threads):
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", CHILD, str(HERE), kind, solver],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=str(HERE / "results" / "study_reproducibility.json"))
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    import dask.array as da
    from distributed import Client, LocalCluster
    rows = []
    print(f"{'data':12s} {'solver':9s} {'what':22s} {'labels differ':>14s} {'ARI':>7s} "
          f"{'J rel diff':>11s} {'max center diff':>16s}")

    def report(kind, solver, what, r):
        rows.append({"data": kind, "solver": solver, "what": what, **r})
        print(f"{kind:12s} {solver:9s} {what:22s} {r['labels_differ']:14d} {r['ari']:7.4f} "
              f"{r['J_rel_diff']:11.2e} {r['max_center_diff']:16.2e}", flush=True)

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        for kind in ("overlapping", "separated"):
            X = data(kind)
            for solver in ("lloyd", "gradient"):
                one, two = (in_process(kind, solver, t) for t in (1, 2))
                report(kind, solver, "threads 1 vs 2",
                       compare(one["centers"], one["labels"], one["inertia"],
                               two["centers"], two["labels"], two["inertia"]))
                import fastanneal as fa
                mem = fit(X, solver)
                dk = fa.AnnealedKMeans(K, solver=solver, random_state=0,
                                       scheduler=client).fit(da.from_array(X, chunks=(2000, -1)))
                lab = dk.predict(X)
                report(kind, solver, "dask 2,000-row chunks",
                       compare(mem.cluster_centers_, mem.labels_, mem.inertia_,
                               dk.cluster_centers_, lab, dk.inertia_))
    _study.write_json(args.json, {"rows": rows, "n": N, "d": D, "k": K,
                                  "machine": _study.machine_info()})


if __name__ == "__main__":
    main()
