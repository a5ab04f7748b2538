"""What does ``suggest_k`` say on data without clusters? Single Gaussians (1-3 dimensions,
isotropic and elongated), uniform boxes, a heavy-tailed density and a ring, beside the
known-K sets of ``bench_choose_k.py``.

    python benchmarks/study_unimodal.py --seeds 6        # about two minutes here

Per set: the width (in ``log T``) of the suggested K's plateau (median and largest over the
seeds), how many of the seeds report it ``supported``, and the suggested K. A plateau is a
range of temperatures over which the annealing path holds K effective clusters; a
continuous density without clusters has such ranges too (its codebook splits in a regular
cascade: a Gaussian's halves have 1 - 2/pi of its variance along the split, a uniform
box's a quarter), so this measures how wide those are, against the plateaus of real
clusters. Writes JSON (default ``benchmarks/results/study_unimodal.json``).
"""
import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

N = 2000


def no_cluster_sets():
    """``name -> generator(rng) -> X``: densities without cluster structure."""
    def gauss(D, ratio):
        return lambda r: r.standard_normal((N, D)) * np.linspace(1.0, ratio, D)

    def ring(r):
        a = r.uniform(0, 2 * np.pi, N)
        return np.c_[np.cos(a), np.sin(a)] + 0.05 * r.standard_normal((N, 2))

    sets = {}
    for D in (1, 2, 3):
        for ratio in ((1.0,) if D == 1 else (1.0, 0.6, 0.3)):
            sets[f"gauss-d{D}" + ("" if ratio == 1.0 else f"-x{ratio}")] = gauss(D, ratio)
    sets["gauss-d16-elongated"] = lambda r: (r.standard_normal((N, 16))
                                             * np.geomspace(1, 0.05, 16))
    sets["uniform-d1"] = lambda r: r.uniform(-1, 1, (N, 1))
    sets["uniform-d2"] = lambda r: r.uniform(-1, 1, (N, 2))
    sets["uniform-d2-x0.5"] = lambda r: r.uniform(-1, 1, (N, 2)) * [1.0, 0.5]
    sets["laplace-d2"] = lambda r: r.laplace(size=(N, 2))
    sets["student-t3-d2"] = lambda r: r.standard_t(3, size=(N, 2))
    sets["ring-d2"] = ring
    return sets


def best_width(s):
    i = int(np.nonzero(s.ks == s.best)[0][0])
    return float(s.width[i])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--k-max", type=int, default=20, help="for the sets without clusters")
    ap.add_argument("--json", default=str(HERE / "results" / "study_unimodal.json"))
    a = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    import fastanneal
    from bench_choose_k import make_sets
    fastanneal.suggest_k(np.random.default_rng(0).normal(size=(200, 4)), k_max=4,
                         random_state=0)                  # compile outside the timings
    t0 = time.perf_counter()
    rows = []
    for name, gen in no_cluster_sets().items():
        runs = []
        for seed in range(a.seeds):
            X = gen(np.random.default_rng(1000 + seed))
            s = fastanneal.suggest_k(X, k_max=a.k_max, random_state=seed)
            runs.append({"best": int(s.best), "width": best_width(s),
                         "supported": bool(s.supported)})
        rows.append({"set": name, "clusters": False, "runs": runs})
    for seed in range(a.seeds):
        for name, (X, K, _) in make_sets(seed).items():
            s = fastanneal.suggest_k(X, k_max=max(8, 2 * K), random_state=seed)
            row = next((r for r in rows if r["set"] == name), None)
            if row is None:
                row = {"set": name, "clusters": True, "K": int(K), "runs": []}
                rows.append(row)
            row["runs"].append({"best": int(s.best), "width": best_width(s),
                                "supported": bool(s.supported)})
    print(f"{'set':22s} {'clusters':>8s} {'width median':>12s} {'max':>6s} {'min':>6s} "
          f"{'supported':>9s}  suggested K")
    for r in rows:
        w = np.array([x["width"] for x in r["runs"]])
        r["width_median"], r["width_max"], r["width_min"] = (float(np.median(w)),
                                                              float(w.max()), float(w.min()))
        r["supported"] = int(sum(x["supported"] for x in r["runs"]))
        ks = [x["best"] for x in r["runs"]]
        print(f"{r['set']:22s} {('K=' + str(r['K'])) if r['clusters'] else 'none':>8s} "
              f"{r['width_median']:12.2f} {r['width_max']:6.2f} {r['width_min']:6.2f} "
              f"{r['supported']:>4d} / {len(r['runs'])}  {ks}")
    none = [x for r in rows if not r["clusters"] for x in r["runs"]]
    some = [x for r in rows if r["clusters"] for x in r["runs"]]
    summary = {
        "no_clusters_supported": sum(x["supported"] for x in none), "no_clusters_runs": len(none),
        "no_clusters_width_max": max(x["width"] for x in none),
        "clusters_supported": sum(x["supported"] for x in some), "clusters_runs": len(some),
        "clusters_width_below_no_cluster_max": sum(
            x["width"] <= max(y["width"] for y in none) for x in some),
    }
    print(json.dumps(summary))
    out = {"rows": rows, "summary": summary, "seeds": a.seeds, "k_max": a.k_max, "n": N,
           "seconds": time.perf_counter() - t0, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    import _study
    _study.write_json(a.json, out)


if __name__ == "__main__":
    main()
