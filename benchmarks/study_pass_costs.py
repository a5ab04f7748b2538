"""Where a default fit's time goes, pass by pass, on one CLINC150 domain.

    python benchmarks/study_pass_costs.py --domain home --fits 10

Fits the default ``AnnealedKMeans(15)`` for seeds ``0..fits-1`` (after one warm-up fit)
with the in-memory source's ``moments`` wrapped to time every pass, and groups the passes
by kind: the rule (softmax / hard), the number of centers (``2K`` are the half-centers of
the re-allocation's move statistics) and whether hard sums were asked for (Lloyd passes of
the polish and of the re-allocation trials). Prints, per kind, passes per fit, milliseconds
per pass and per fit, and the fraction of rows the pass pruned; and the median fit time.
Writes JSON (default ``benchmarks/results/study_pass_costs.json``). Sub-millisecond
passes on a shared 2-core machine: compare kinds and codes within one run.
"""
import argparse
import collections
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

RULES = {0: "softmax", 1: "entmax15", 2: "hard"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--domain", default="home")
    ap.add_argument("--fits", type=int, default=10)
    ap.add_argument("--json", default=str(HERE / "results" / "study_pass_costs.json"))
    a = ap.parse_args(argv)

    import fastanneal as fa
    from fastanneal import _sources
    from bench_quality import clinc_domains

    (_, X, _), = list(clinc_domains([a.domain]))
    orig = _sources.InMemorySource.moments
    kinds = collections.defaultdict(lambda: [0, 0.0, 0])

    def timed(self, centers, T, resp=0, log_prior=None, hard_sums=False):
        t = time.perf_counter()
        m = orig(self, centers, T, resp, log_prior, hard_sums)
        dt = time.perf_counter() - t
        b = getattr(self, "_bounds", None)
        k = kinds[(RULES.get(int(resp), str(resp)), int(np.shape(centers)[0]), bool(hard_sums))]
        k[0] += 1
        k[1] += dt
        k[2] += b.pruned if b is not None else 0
        return m

    _sources.InMemorySource.moments = timed
    try:
        fa.AnnealedKMeans(15, random_state=0).fit(X)      # warm-up (compile, BLAS)
        kinds.clear()
        fit_s = []
        for seed in range(a.fits):
            t = time.perf_counter()
            fa.AnnealedKMeans(15, random_state=seed).fit(X)
            fit_s.append(time.perf_counter() - t)
    finally:
        _sources.InMemorySource.moments = orig
    rows = []
    print(f"CLINC150/{a.domain}: {X.shape[0]} x {X.shape[1]}, K = 15, {a.fits} default fits, "
          f"median fit {1e3 * float(np.median(fit_s)):.1f} ms")
    print(f"{'rule':9s} {'K':>4s} {'hard sums':>9s} {'passes/fit':>10s} {'ms/pass':>8s} "
          f"{'ms/fit':>7s} {'pruned':>7s}")
    for (rule, K, hs), (n, sec, pruned) in sorted(kinds.items()):
        r = dict(rule=rule, centers=K, hard_sums=hs, passes_per_fit=n / a.fits,
                 ms_per_pass=1e3 * sec / n, ms_per_fit=1e3 * sec / a.fits,
                 pruned_fraction=pruned / n / X.shape[0])
        rows.append(r)
        print(f"{rule:9s} {K:4d} {str(hs):>9s} {r['passes_per_fit']:10.1f} "
              f"{r['ms_per_pass']:8.3f} {r['ms_per_fit']:7.1f} {r['pruned_fraction']:7.2f}")
    out = dict(domain=a.domain, fits=a.fits, fit_seconds=fit_s,
               median_fit_seconds=float(np.median(fit_s)), kinds=rows,
               date=time.strftime("%Y-%m-%d %H:%M:%S"))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1))
    print("wrote", a.json)


if __name__ == "__main__":
    main()
