"""Does the start temperature matter? The default fit of the known-answer sets where rows
stay soft (A-sets, grid100) and of strongly overlapping 2-D mixtures (``overlap2d``) against
colder and hotter starts, from the same seeds.

    python benchmarks/study_start_temperature.py [--seeds 10] [--json PATH]

Starts: ``auto_start_fraction`` 0.5 (the default: half the smallest per-cluster critical
temperature of the k-means++ partition), 2 and 8 (hotter: rows really soft at the first
temperature), and a cold start (``temperature_start`` = 1e-4 x the default's: the
annealing reduced to Lloyd passes and the re-allocation moves). Per set and start: fits
with every cluster found (CI = 0), the summed inertia relative to the default's, the fits
ending more than 1e-3 below / above the default's inertia, the median assignment entropy
(nats per row) at the first temperature, seconds. Writes JSON atomically (default
``benchmarks/results/study_start_temperature.json``).

``overlap2d``: 8 Gaussians of 150 points, unit variance, means drawn from N(0, 2.5^2 I) in
2-D (data seed 100 + seed; the family of ``tests/test_stop_when_hard.py`` and
``tests/test_annealing_quality.py``): the clusters overlap so much that CI = 0 is not the
question; the objective is.
"""
import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _known_answers as ka  # noqa: E402

import fastanneal as fa  # noqa: E402

SETS = ("a20", "a35", "a50", "grid100", "overlap2d")


def overlap2d(seed):
    """``(X, generating means)`` of the overlapping 2-D family (data seed ``100 + seed``)."""
    rng = np.random.default_rng(100 + seed)
    M = 2.5 * rng.standard_normal((8, 2))
    return np.concatenate([m + rng.standard_normal((150, 2)) for m in M]), M
STARTS = ("default 0.5", "hot 2", "hot 8", "cold 1e-4")


def fit(X, K, seed, start, t_default):
    kw = dict(random_state=seed)
    kind, val = start.split()
    if kind == "cold":
        kw["temperature_start"] = t_default * float(val)
    else:
        kw["auto_start_fraction"] = float(val)
    t = time.perf_counter()
    m = fa.AnnealedKMeans(K, **kw).fit(X)
    return m, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--json", default=str(HERE / "results" / "study_start_temperature.json"))
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    X0, C0 = ka.load("a20", 0)[:2]
    fa.AnnealedKMeans(C0.shape[0], random_state=0).fit(X0)          # compile first
    rows = []
    for name in SETS:
        acc = {s: dict(ci0=0, inertia=0.0, ent=[], sec=0.0, better=0, worse=0)
               for s in STARTS}
        for seed in range(a.seeds):
            X, C = overlap2d(seed) if name == "overlap2d" else ka.load(name, seed)[:2]
            K = C.shape[0]
            t_default = j_default = None
            for s in STARTS:
                m, sec = fit(X, K, seed, s, t_default)
                if t_default is None:
                    t_default, j_default = float(m.temperature_start_), float(m.inertia_)
                r = acc[s]
                r["better"] += int(m.inertia_ < j_default * (1 - 1e-3))
                r["worse"] += int(m.inertia_ > j_default * (1 + 1e-3))
                r["ci0"] += int(ka.centroid_index(m.cluster_centers_, C) == 0)
                r["inertia"] += float(m.inertia_)
                r["ent"].append(float(m.trace_.as_dict()["entropy"][0]))
                r["sec"] += sec
        base = acc[STARTS[0]]["inertia"]
        for s in STARTS:
            r = acc[s]
            row = dict(set=name, start=s, seeds=a.seeds, ci0=r["ci0"],
                       inertia_vs_default=r["inertia"] / base, better=r["better"],
                       worse=r["worse"],
                       entropy_first=float(np.median(r["ent"])), seconds=r["sec"])
            rows.append(row)
            print(f"{name:9s} {s:12s} CI=0 {row['ci0']:2d}/{a.seeds}  inertia "
                  f"x{row['inertia_vs_default']:.6f}  below/above default by >1e-3: "
                  f"{row['better']}/{row['worse']}  first-step entropy "
                  f"{row['entropy_first']:.3f}  {row['seconds']:.2f} s", flush=True)
    tmp = a.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"rows": rows, "date": time.strftime("%Y-%m-%d %H:%M:%S")}, f, indent=1)
    os.replace(tmp, a.json)
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
