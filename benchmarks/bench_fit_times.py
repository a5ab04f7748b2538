"""Seconds of a default fit on a few sets, for same-hour comparisons of two versions of the
code (run it once per version, e.g. ``PYTHONPATH=/path/to/other/checkout``):

    python benchmarks/bench_fit_times.py [--repeats 3] [--json PATH]

Sets: a 100,000 x 384 Gaussian mixture at K = 256 (``bench_kernels.mixture``), the
known-answer sets a35 and dim128 (``_known_answers``), and CLINC150's home domain (cosine,
K = 15) when the CLINC150 data is at hand. Per set: the median of ``--repeats`` fits
(``random_state`` 0, 1, ...) after one warm-up fit on a slice. Prints the version's path and
a line per set; writes JSON atomically (default: not written).
"""
import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _known_answers as ka  # noqa: E402
import _study  # noqa: E402
from bench_kernels import mixture  # noqa: E402

import fastanneal as fa  # noqa: E402


def sets():
    rng = np.random.default_rng(0)
    out = {}
    X, _ = mixture(100_000, 384, 256, rng)
    out["mixture 100k x 384, K=256"] = (X, 256, "euclidean")
    for name in ("a35", "dim128"):
        X, C = ka.load(name, 0)[:2]
        out[name] = (np.asarray(X, float), C.shape[0], "euclidean")
    if _study.clinc_available():
        d = _study.load("clinc150/home")
        out["clinc150/home"] = (d.X, d.K, d.metric)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    print(fa.__file__)
    rows = []
    for name, (X, K, metric) in sets().items():
        fa.AnnealedKMeans(K, metric=metric, random_state=0).fit(X[:max(2000, 4 * K)])
        ts = []
        for r in range(args.repeats):
            t = time.perf_counter()
            fa.AnnealedKMeans(K, metric=metric, random_state=r).fit(X)
            ts.append(time.perf_counter() - t)
        rows.append({"set": name, "median_s": float(np.median(ts)), "seconds": ts})
        print(f"{name:28s} {np.median(ts):8.3f} s", flush=True)
    if args.json:
        _study.write_json(args.json, {"code": fa.__file__, "rows": rows,
                                      "machine": _study.machine_info()})


if __name__ == "__main__":
    main()
