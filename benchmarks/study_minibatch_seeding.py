"""How large a seeding sample should the mini-batch route take on data that is not large?

    python benchmarks/study_minibatch_seeding.py --seeds 3        # about two minutes here

``MiniBatchAnnealedKMeans`` seeds (k-means++, Lloyd and the re-allocation moves) on an
in-memory sample of ``init_size`` rows. The rule before the twenty-fourth session,
``max(100 K, 20,000)``, takes 20,000 of CLINC150's 22,500 rows: the seeding is then nearly
a full-batch fit, and the mini-batch route costs half of ``AnnealedKMeans``' time. The rule
now caps the sample at a quarter of the rows (at least 20 per cluster). Same process, same
seeds: both rules (passed as ``init_size``), ``AnnealedKMeans`` (full batch) and
scikit-learn's ``MiniBatchKMeans`` (its defaults), on CLINC150 (cosine, K = 150) and on
200,000 x 64 blobs (K = 100, where both rules give 20,000 rows). Prints a table (median
seconds and ARI over the seeds); writes JSON (default
``benchmarks/results/study_minibatch_seeding.json``).
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


def datasets(blobs):
    import _study
    ds = _study._clinc(None, False)
    out = [("clinc150", ds.X, ds.y, ds.K, "cosine")]
    if blobs:
        out.append(blobs_200k())
    return out


def blobs_200k():
    """The synthetic set of the mini-batch studies: ``(name, X, y, K, metric)``, 200,000 x
    64 float32 blobs around 100 centers."""
    from sklearn.datasets import make_blobs
    X, y = make_blobs(200_000, n_features=64, centers=100, cluster_std=1.0,
                      center_box=(-10, 10), random_state=0)
    return "blobs 200k x 64", X.astype(np.float32), y, 100, "euclidean"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--no-blobs", dest="blobs", action="store_false")
    ap.add_argument("--json", default=str(HERE / "results" / "study_minibatch_seeding.json"))
    a = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    from sklearn.cluster import MiniBatchKMeans
    from sklearn.metrics import adjusted_rand_score

    import fastanneal as fa
    t_all = time.perf_counter()
    rows = []
    for name, X, y, K, metric in datasets(a.blobs):
        n = X.shape[0]
        old = max(100 * K, 20_000)
        new = max(20 * K, min(old, n // 4))
        methods = {
            f"MiniBatchAnnealedKMeans, init_size {min(old, n):,} (the old rule)":
                lambda s: fa.MiniBatchAnnealedKMeans(K, metric=metric, init_size=old,
                                                     random_state=s).fit(X).labels_,
            f"MiniBatchAnnealedKMeans, init_size {new:,} (the rule now: default)":
                lambda s: fa.MiniBatchAnnealedKMeans(K, metric=metric,
                                                     random_state=s).fit(X).labels_,
            "AnnealedKMeans (full batch)":
                lambda s: fa.AnnealedKMeans(K, metric=metric, random_state=s).fit(X).labels_,
            "scikit-learn MiniBatchKMeans (defaults)":
                lambda s: MiniBatchKMeans(K, random_state=s).fit(X).labels_,
        }
        if n <= 25_000:
            for fn in methods.values():              # first calls outside the timings
                fn(0)
        for label, fn in methods.items():
            secs, aris = [], []
            for seed in range(a.seeds):
                t0 = time.perf_counter()
                lab = fn(seed)
                secs.append(time.perf_counter() - t0)
                aris.append(float(adjusted_rand_score(y, lab)))
            rows.append({"dataset": name, "method": label, "seconds": secs, "ari": aris,
                         "median_seconds": float(np.median(secs)),
                         "median_ari": float(np.median(aris))})
            print(f"{name:16s} {label:62s} {np.median(secs):7.2f} s  ARI {np.median(aris):.3f}"
                  f" (min {min(aris):.3f})", flush=True)
    out = {"rows": rows, "seeds": a.seeds, "seconds": time.perf_counter() - t_all,
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    import _study
    _study.write_json(a.json, out)


if __name__ == "__main__":
    main()
