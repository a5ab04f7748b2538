"""Pruning in whole fits: a default fit with and without per-row bounds, same run.

    python benchmarks/bench_prune.py            # CLINC150 (K = 150) and a 100k x 384 mixture (K = 256)
    python benchmarks/bench_prune.py --quick    # CLINC150 domains (K = 15) and a 20k mixture (K = 64)

For each dataset: fit time of ``AnnealedKMeans(K, random_state=0)`` (cosine for CLINC150)
with ``_config.PRUNE`` off and on, interleaved repeats (median), the share of rows pruned
per pass (soft passes and hard passes separately), the time spent in moments passes, and
whether the two fits agree (labels identical, inertia to 1e-6). Also scikit-learn's
``KMeans(n_init=1)`` (Lloyd, and Elkan, which prunes with bounds too) in the same run.
Writes ``benchmarks/results/bench_prune.json``. The kernel-level ratios (one pass against
one GEMM) are in ``bench_kernels.py``.
"""
import _peer_threads  # noqa: F401,I001 -- first: before scikit-learn loads OpenMP
import argparse
import os
import sys
import time
import warnings

import numpy as np

import _study

HERE = os.path.dirname(os.path.abspath(__file__))


def mixture(n, d, k, rng):
    means = rng.standard_normal((k, d)) * 2.0
    X = means[rng.integers(0, k, n)] + rng.standard_normal((n, d))
    return np.ascontiguousarray(X, dtype=np.float32)


def fit(X, K, metric, prune, log):
    import fastanneal
    from fastanneal import _config, _sources
    _config.PRUNE = prune
    orig = _sources.pruned_moments
    stats = {"pass_s": 0.0}

    def counted(Xa, w, C, T, m, resp, lp, hs, bounds, block=None):
        t = time.perf_counter()
        out = orig(Xa, w, C, T, m, resp, lp, hs, bounds, block)
        stats["pass_s"] += time.perf_counter() - t
        log.append((resp, bounds.pruned / Xa.shape[0]))
        return out
    plain = _sources.compute_moments

    def counted_plain(*a, **kw):
        t = time.perf_counter()
        out = plain(*a, **kw)
        stats["pass_s"] += time.perf_counter() - t
        return out
    _sources.pruned_moments = counted
    _sources.compute_moments = counted_plain
    try:
        t = time.perf_counter()
        km = fastanneal.AnnealedKMeans(K, metric=metric, random_state=0).fit(X)
        dt = time.perf_counter() - t
    finally:
        _sources.pruned_moments = orig
        _sources.compute_moments = plain
        _config.PRUNE = True
    return km, dt, stats["pass_s"]


def sklearn_fit(X, K, algorithm):
    from sklearn.cluster import KMeans
    t = time.perf_counter()
    KMeans(K, n_init=1, random_state=0, algorithm=algorithm).fit(X)
    return time.perf_counter() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    rng = np.random.default_rng(0)
    sets = []
    if args.quick:
        ds = _study.load("clinc150/banking", False)
        sets.append(("clinc150/banking", ds.X.astype(np.float32), ds.K, "cosine"))
        sets.append(("mixture 20k x 384", mixture(20_000, 384, 64, rng), 64, "euclidean"))
    else:
        ds = _study.load("clinc150", False)
        sets.append(("clinc150", ds.X.astype(np.float32), ds.K, "cosine"))
        sets.append(("mixture 100k x 384", mixture(100_000, 384, 256, rng), 256, "euclidean"))
    import fastanneal
    fastanneal.AnnealedKMeans(4, random_state=0).fit(sets[0][1][:500])     # compile
    rows = []
    print(f"{'dataset':22s} {'K':>5s} {'off s':>7s} {'on s':>7s} {'on/off':>7s} "
          f"{'passes off/on s':>16s} {'pruned soft':>11s} {'pruned hard':>11s} "
          f"{'same labels':>11s} {'sk lloyd s':>10s} {'sk elkan s':>10s}")
    for name, X, K, metric in sets:
        res = {"off": [], "on": [], "pass_off": [], "pass_on": [], "sk_lloyd": [],
               "sk_elkan": []}
        log = []
        for _ in range(args.repeats):
            a, t_off, p_off = fit(X, K, metric, False, [])
            log.clear()
            b, t_on, p_on = fit(X, K, metric, True, log)
            res["off"].append(t_off)
            res["on"].append(t_on)
            res["pass_off"].append(p_off)
            res["pass_on"].append(p_on)
            res["sk_lloyd"].append(sklearn_fit(X, K, "lloyd"))
            res["sk_elkan"].append(sklearn_fit(X, K, "elkan"))
        soft = [p for r, p in log if r != 2]
        hard = [p for r, p in log if r == 2]
        same = bool(np.array_equal(a.labels_, b.labels_))
        med = {k: float(np.median(v)) for k, v in res.items()}
        row = {"dataset": name, "K": K, "n": int(X.shape[0]), "metric": metric, **med,
               "all": res, "pruned_soft_mean": float(np.mean(soft)) if soft else None,
               "pruned_hard_mean": float(np.mean(hard)) if hard else None,
               "passes": len(log), "same_labels": same,
               "inertia_rel_diff": abs(a.inertia_ - b.inertia_) / a.inertia_}
        rows.append(row)
        print(f"{name:22s} {K:>5d} {med['off']:7.2f} {med['on']:7.2f} "
              f"{med['on'] / med['off']:7.2f} {med['pass_off']:7.2f}/{med['pass_on']:<7.2f} "
              f"{row['pruned_soft_mean'] or 0:11.2f} {row['pruned_hard_mean'] or 0:11.2f} "
              f"{str(same):>11s} {med['sk_lloyd']:10.2f} {med['sk_elkan']:10.2f}", flush=True)
    out = os.path.join(HERE, "results", "bench_prune_quick.json" if args.quick
                       else "bench_prune.json")
    _study.write_json(out, {"rows": rows, "machine": _study.machine_info()})


if __name__ == "__main__":
    sys.exit(main())
