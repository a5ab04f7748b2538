"""Objective against ARI on one CLINC150 domain: does a lower spherical k-means objective
mean a partition closer to the intents?

    python benchmarks/study_domain_landscape.py --domain home --fits 40 --restarts 200

Fits the default ``AnnealedKMeans(15, metric="cosine")`` for seeds ``0..fits-1`` and
scikit-learn ``KMeans(15, n_init=1)`` (k-means++ + Lloyd on the unit rows) for seeds
``0..restarts-1``; prints the distinct (objective, ARI) end points of fastanneal with their
counts, the best scikit-learn runs by objective, the correlation of objective and ARI over
the scikit-learn runs and the objective of the intent partition itself; writes JSON.
The objective is ``sum_i (2 - 2 x_i . c_k)`` with unit mean directions (what the cosine fit
minimises; ``bench_quality.spherical_objective``).
"""
import argparse
import collections
import sys
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--domain", default="home")
    ap.add_argument("--fits", type=int, default=40)
    ap.add_argument("--restarts", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from sklearn.cluster import KMeans
    from sklearn.metrics import adjusted_rand_score

    from bench_quality import CLINC, clinc_domains, spherical_objective
    import fastanneal as fa
    if not CLINC.exists():
        print(f"{CLINC} not found")
        return 1
    _, X, y = next(clinc_domains([args.domain]))
    Xu = X / np.linalg.norm(X, axis=1, keepdims=True)
    K = int(y.max() + 1)
    out = {"domain": args.domain, "rows": int(X.shape[0]), "K": K,
           "intent_objective": spherical_objective(X, y), "fastanneal": [], "sklearn": []}
    t0 = time.perf_counter()
    for s in range(args.fits):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = fa.AnnealedKMeans(K, metric="cosine", random_state=s).fit(X)
        out["fastanneal"].append({"seed": s, "obj": spherical_objective(X, m.labels_),
                                  "ari": float(adjusted_rand_score(y, m.labels_))})
    for s in range(args.restarts):
        km = KMeans(K, n_init=1, random_state=s).fit(Xu)
        out["sklearn"].append({"seed": s, "obj": spherical_objective(X, km.labels_),
                               "ari": float(adjusted_rand_score(y, km.labels_))})
    out["seconds"] = time.perf_counter() - t0

    print(f"{args.domain}: {X.shape[0]} rows, K = {K}; the intents' own partition has "
          f"objective {out['intent_objective']:.2f}")
    c = collections.Counter((round(r["obj"], 2), round(r["ari"], 3)) for r in out["fastanneal"])
    print(f"\nfastanneal default, {args.fits} seeds: (objective, ARI) x count")
    for (o, a), n in sorted(c.items()):
        print(f"  {o:10.2f}  {a:.3f}  x{n}")
    sk = sorted(out["sklearn"], key=lambda r: r["obj"])
    print(f"\nscikit-learn n_init=1, {args.restarts} seeds, best ten by objective:")
    for r in sk[:10]:
        print(f"  {r['obj']:10.2f}  {r['ari']:.3f}")
    o = np.array([r["obj"] for r in sk])
    a = np.array([r["ari"] for r in sk])
    out["sklearn_corr_obj_ari"] = float(np.corrcoef(o, a)[0, 1])
    print(f"  correlation of objective and ARI over the runs: {out['sklearn_corr_obj_ari']:.2f}")
    fo = np.array([r["obj"] for r in out["fastanneal"]])
    fa_a = np.array([r["ari"] for r in out["fastanneal"]])
    best = fo <= fo.min() + 0.1
    print(f"\nbest objective found: {fo.min():.2f} (fastanneal; scikit-learn's best {o.min():.2f});"
          f" {best.sum()} of {len(fo)} fastanneal fits within 0.1 of it, ARI there "
          f"{fa_a[best].min():.3f}-{fa_a[best].max():.3f}; fastanneal median ARI "
          f"{np.median(fa_a):.3f}")
    if args.json:
        from _study import write_json
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
