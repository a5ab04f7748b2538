"""Known answers: does a fit find every cluster? fastanneal vs k-means peers on look-alikes of
Fränti & Sieranoja's benchmark sets (Birch1 grid, A-sets, DIM-sets, unbalance).

    python benchmarks/bench_known_answers.py            # 8 sets, 10 seeds (~20 min, random
                                                        # swap dominates)
    python benchmarks/bench_known_answers.py --quick    # 8 sets, 3 seeds, fewer swaps (~4 min)
    python benchmarks/bench_known_answers.py --sets a50,unbalanced --methods fa,sk10,rs

Every set is drawn from Gaussians around known generating centers (``_known_answers.py``).
Per fit: the centroid index CI against those centers (0 = every cluster found, one center
each), the SSE relative to the SSE of the generating centers, and wall seconds. Methods (ids
for ``--methods``):

* ``fa``: fastanneal default, ``AnnealedKMeans(n_clusters=K, random_state=seed)``;
* ``fa-norealloc``: the default without the phase-transition re-allocation moves
  (``reallocate=False``): the annealing schedule and the polish alone;
* ``fa-critical``, ``fa-adaptive``: the same with ``schedule="critical"`` / ``"adaptive"``;
* ``fa-critical-norealloc``: ``schedule="critical"`` with ``reallocate=False``: the phase
  transitions (splits of effective clusters) and the polish alone;
* ``fa-kpp-lloyd``: scikit-learn Lloyd (``KMeans(init=C0, n_init=1)``) from the very k-means++
  seeds C0 the default fit of the same seed started from (recorded by wrapping fastanneal's
  ``kmeans_plusplus`` during that fit): what the annealing adds over its own seeding. Its
  time is the seeding time inside the default fit plus the Lloyd fit. Should fastanneal stop
  seeding by k-means++, scikit-learn's ``KMeans(n_init=1, random_state=seed)`` stands in and
  the table says so;
* ``sk1``, ``sk10``: scikit-learn ``KMeans(n_init=1)`` / ``KMeans(n_init=10)`` (k-means++);
* ``faiss``: ``faiss.Kmeans(niter=25, nredo=1)`` on all points, if faiss is installed (else
  reported as absent);
* ``rs``: random swap (Fränti 2018), 2 Lloyd iterations per trial swap. The swaps it needs
  grow about as K^2 (a trial frees a doubled center and lands it in the missed cluster with
  probability about 2 / K^2; measured on these sets, 4 seeds: at most 61 for K=20, 290 for
  K=16, 980 for K=50, 1620 for K=100), so it gets ``min(5000, max(500, K^2))`` trials
  (``--quick``: ``min(2000, max(400, 0.4 K^2))``; ``--swaps`` fixes one count): the slow
  reference that should reach CI = 0, not a time-matched peer -- its time ratio is reported
  like every other.

Seeds are interleaved, all methods fit in one process, each after one warm-up fit on a
subsample of the set (compiles and BLAS start-up outside the timings). Per set and method:
how many seeds reach CI = 0, median and max CI, median relative SSE, median seconds and its
ratio to the median of ``sk10`` in the same run (seconds are wall time on shared cores: read
the ratios, and those of one run loosely). Prints a table per set and an overview, writes
JSON atomically (``benchmarks/results/bench_known_answers.json``, ``--quick``:
``bench_known_answers_quick.json``).
"""
import _peer_threads  # noqa: F401,I001 -- first: before scikit-learn loads OpenMP
import argparse
import time
import warnings
from contextlib import contextmanager, nullcontext

import numpy as np

import _known_answers as ka
import _study

METHODS = {                    # id -> label in the tables
    "fa": "fastanneal (default)",
    "fa-norealloc": "fastanneal reallocate=False",
    "fa-critical": "fastanneal critical",
    "fa-critical-norealloc": "fastanneal critical, reallocate=False",
    "fa-adaptive": "fastanneal adaptive",
    "fa-kpp-lloyd": "Lloyd from fastanneal k-means++",
    "sk1": "sklearn KMeans n_init=1",
    "sk10": "sklearn KMeans n_init=10",
    "faiss": "faiss Kmeans niter=25",
    "rs": "random swap",
}
REF = "sk10"


def n_swaps_for(K, quick, fixed=None):
    """Trial swaps of random swap for K clusters (see the module docstring)."""
    if fixed is not None:
        return int(fixed)
    if quick:
        return int(min(2000, max(400, 2 * K * K // 5)))
    return int(min(5000, max(500, K * K)))


@contextmanager
def spy_kpp():
    """Record what fastanneal's k-means++ returns inside a fit, and its seconds: every binding
    of ``kmeans_plusplus`` in the loaded fastanneal modules is wrapped for the duration
    (wherever the library calls it from), then restored. Yields a list of (centers, seconds)."""
    import sys
    import fastanneal.estimator  # noqa: F401 -- fastanneal loads lazily: bring in the seeding
    seen, patched = [], []
    for mod in [m for name, m in list(sys.modules.items())
                if name.split(".")[0] == "fastanneal" and m is not None]:
        original = getattr(mod, "kmeans_plusplus", None)
        if not callable(original):
            continue

        def wrapper(*args, _original=original, **kwargs):
            t = time.perf_counter()
            C = _original(*args, **kwargs)
            seen.append((np.array(C, dtype=np.float64), time.perf_counter() - t))
            return C

        setattr(mod, "kmeans_plusplus", wrapper)
        patched.append((mod, original))
    try:
        yield seen
    finally:
        for mod, original in patched:
            setattr(mod, "kmeans_plusplus", original)


def fastanneal_seeds(X, K, seed):
    """(centers, seconds) of the k-means++ seeding inside ``AnnealedKMeans(K,
    random_state=seed).fit(X)`` (an untimed fit under ``spy_kpp``), or None where the fit
    seeds otherwise."""
    import fastanneal as fa
    with spy_kpp() as seen, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fa.AnnealedKMeans(n_clusters=K, random_state=seed).fit(X)
    return seen[0] if seen else None


def available():
    """Optional peers: name -> importable (absent ones are reported, not skipped silently)."""
    try:
        import faiss  # noqa: F401
        return {"faiss": True}
    except Exception:            # noqa: BLE001 -- optional peer, reported as absent
        return {"faiss": False}


def make_methods(ids, K, n_swaps, seeds):
    """(id, fit(X, seed) -> (centers, extra dict)) pairs for the requested method ids.
    ``seeds``: seed -> (k-means++ centers, seconds) captured from the default fastanneal fit
    of that seed (filled during the run; ``fa-kpp-lloyd`` fits an untimed default when the
    entry is missing)."""
    import fastanneal as fa
    from sklearn.cluster import KMeans

    def fa_fit(**kw):
        def fit(X, seed):
            m = fa.AnnealedKMeans(n_clusters=K, random_state=seed, **kw).fit(X)
            return m.cluster_centers_, {}
        return fit

    def kpp_lloyd(X, seed):
        got = seeds.get(seed) or fastanneal_seeds(X, K, seed)
        if got is None:           # fastanneal did not seed by k-means++: scikit-learn's own
            t = time.perf_counter()
            km = KMeans(K, n_init=1, random_state=seed).fit(X)
            return km.cluster_centers_, {"n_iter": int(km.n_iter_), "seeds": "sklearn",
                                         "seed_seconds": 0.0,
                                         "fit_seconds": time.perf_counter() - t}
        C0, seed_seconds = got
        t = time.perf_counter()
        km = KMeans(K, init=C0, n_init=1).fit(X)
        return km.cluster_centers_, {"n_iter": int(km.n_iter_), "seeds": "fastanneal",
                                     "seed_seconds": seed_seconds,
                                     "fit_seconds": time.perf_counter() - t}

    def sk(n_init):
        def fit(X, seed):
            return KMeans(K, n_init=n_init, random_state=seed).fit(X).cluster_centers_, {}
        return fit

    def fa_iss(X, seed):
        import faiss
        km = faiss.Kmeans(X.shape[1], K, niter=25, nredo=1, seed=seed + 1, verbose=False,
                          max_points_per_centroid=len(X))        # no subsampling
        km.train(np.ascontiguousarray(X, dtype=np.float32))
        return np.asarray(km.centroids, dtype=np.float64), {}

    def rs(X, seed, swaps=n_swaps):
        C, _, _, accepted = ka.random_swap_kmeans(X, K, np.random.default_rng(seed), swaps)
        return C, {"n_swaps": swaps, "accepted": accepted}

    table = {"fa": fa_fit(), "fa-norealloc": fa_fit(reallocate=False),
             "fa-critical": fa_fit(schedule="critical"),
             "fa-critical-norealloc": fa_fit(schedule="critical", reallocate=False),
             "fa-adaptive": fa_fit(schedule="adaptive"), "fa-kpp-lloyd": kpp_lloyd,
             "sk1": sk(1), "sk10": sk(10), "faiss": fa_iss, "rs": rs}
    return [(i, table[i]) for i in ids]


def warm_up(X, meths):
    """BLAS start-up (one GEMM with >= 384 output columns, ``docs/benchmarking.md``) and
    one fit per method on a subsample of the set, outside the timings."""
    Xw = np.random.default_rng(0).standard_normal((2048, 384))
    Xw @ Xw[:512].T
    sub = X[np.random.default_rng(0).choice(len(X), min(len(X), 2000), replace=False)]
    for mid, fit in meths:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if mid == "rs":
                fit(sub, 0, swaps=2)
            else:
                fit(sub, 0)


def run_set(name, seeds, ids, quick, fixed_swaps, data_seed):
    X, true_C, _ = ka.load(name, data_seed)
    K = len(true_C)
    n_swaps = n_swaps_for(K, quick, fixed_swaps)
    kpp = {}                                  # seed -> fastanneal's k-means++ seeds
    meths = make_methods(ids, K, n_swaps, kpp)
    warm_up(X, meths)
    rows = []
    for seed in seeds:
        for mid, fit in meths:
            spy = spy_kpp() if mid == "fa" else nullcontext([])
            with warnings.catch_warnings(), spy as seen:
                warnings.simplefilter("ignore")
                t = time.perf_counter()
                C, extra = fit(X, seed)
                seconds = time.perf_counter() - t
            if mid == "fa-kpp-lloyd":
                # the seeding time inside the default fit + scikit-learn's Lloyd from the seeds
                seconds = extra["seed_seconds"] + extra["fit_seconds"]
            if seen:
                kpp[seed] = seen[0]
            rows.append({"set": name, "method": mid, "seed": seed,
                         "ci": ka.centroid_index(C, true_C),
                         "rel_sse": ka.relative_sse(X, C, true_C),
                         "seconds": seconds, **extra})
    lloyd_seeds = {r["seeds"] for r in rows if r["method"] == "fa-kpp-lloyd"}
    # seeds where the default fit ends where plain Lloyd from its own seeds ends (same CI,
    # SSE within 0.1 %): the annealing changed nothing that a cluster count can see
    by = {(r["method"], r["seed"]): r for r in rows}
    same = [abs(by["fa", s]["rel_sse"] - by["fa-kpp-lloyd", s]["rel_sse"])
            <= 1e-3 * by["fa", s]["rel_sse"] and by["fa", s]["ci"] == by["fa-kpp-lloyd", s]["ci"]
            for s in seeds if ("fa", s) in by and ("fa-kpp-lloyd", s) in by]
    info = {"n": len(X), "D": X.shape[1], "K": K, "n_swaps": n_swaps,
            "description": ka.DESCRIPTIONS[name],
            "fa_kpp_lloyd_seeds": ",".join(sorted(lloyd_seeds)) or None,
            "fa_same_as_kpp_lloyd": f"{sum(same)}/{len(same)}" if same else None}
    return rows, info


def summarize(rows):
    out = []
    for s in dict.fromkeys(r["set"] for r in rows):
        R = [r for r in rows if r["set"] == s]
        ref = [r["seconds"] for r in R if r["method"] == REF]
        ref_t = float(np.median(ref)) if ref else None
        for mid in dict.fromkeys(r["method"] for r in R):
            M = [r for r in R if r["method"] == mid]
            ci = np.array([r["ci"] for r in M])
            t = float(np.median([r["seconds"] for r in M]))
            out.append({"set": s, "method": mid, "label": METHODS[mid], "runs": len(M),
                        "ci0": int((ci == 0).sum()), "ci0_of": f"{int((ci == 0).sum())}/{len(M)}",
                        "ci_median": float(np.median(ci)), "ci_max": int(ci.max()),
                        "rel_sse_median": float(np.median([r["rel_sse"] for r in M])),
                        "seconds_median": t,
                        "time_vs_sk10": t / ref_t if ref_t else None})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 seeds, fewer random swaps")
    ap.add_argument("--sets", default=",".join(ka.SETS), help="comma list of " + ", ".join(ka.SETS))
    ap.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (10; --quick: 3)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="comma list of " + ", ".join(METHODS))
    ap.add_argument("--swaps", type=int, default=None, help="random-swap trials for every set")
    ap.add_argument("--data-seed", type=int, default=0, help="seed of the generated sets")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sets = args.sets.split(",")
    for s in sets:
        if s not in ka.SETS:
            raise SystemExit(f"unknown set {s!r}; known: {', '.join(ka.SETS)}")
    ids = args.methods.split(",")
    for m in ids:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}; known: {', '.join(METHODS)}")
    have = available()
    if "faiss" in ids and not have["faiss"]:
        print("faiss: absent (not installed), reported as absent")
        ids.remove("faiss")
    seeds = list(range(args.seeds or (3 if args.quick else 10)))

    rows, infos, summ = [], {}, []
    t0 = time.perf_counter()
    for s in sets:
        r, info = run_set(s, seeds, ids, args.quick, args.swaps, args.data_seed)
        rows += r
        infos[s] = info
        S = summarize(r)
        summ += S
        _study.print_table(
            S, [("label", "method", ""), ("ci0_of", "CI=0", ""), ("ci_median", "CI med", ".1f"),
                ("ci_max", "CI max", "d"), ("rel_sse_median", "SSE/true", ".4f"),
                ("seconds_median", "sec", ".3f"), ("time_vs_sk10", "t/sk10", ".2f")],
            title=f"{s}: n={info['n']}, D={info['D']}, K={info['K']}, {len(seeds)} seeds; "
                  f"random swap {info['n_swaps']} trials"
                  + ("" if info["fa_kpp_lloyd_seeds"] in (None, "fastanneal") else
                     f"; Lloyd seeds: {info['fa_kpp_lloyd_seeds']} (fastanneal's not captured)"))
        if info["fa_same_as_kpp_lloyd"]:
            print(f"fastanneal default = Lloyd from its own k-means++ seeds (same CI, SSE within "
                  f"0.1 %) on {info['fa_same_as_kpp_lloyd']} seeds")

    # overview: CI=0 counts (and time / sk10) of every method on every set
    over = []
    for s in sets:
        line = {"set": s}
        for x in summ:
            if x["set"] == s:
                tr = x["time_vs_sk10"]
                line[x["method"]] = x["ci0_of"] + (f" ({tr:.2f}x)" if tr is not None else "")
        over.append(line)
    _study.print_table(over, [("set", "set", "")] + [(m, m, "") for m in ids],
                       title="CI=0 over seeds (median time / sklearn n_init=10)")
    print(f"\nCI = centroid index vs the generating centers (0 = all clusters found); "
          f"SSE/true = SSE / SSE of the generating centers; {time.perf_counter() - t0:.0f} s")

    name = "bench_known_answers_quick.json" if args.quick else "bench_known_answers.json"
    _study.write_json(args.json or _study.RESULTS / name, {
        "benchmark": "known_answers", "quick": args.quick, "seeds": seeds,
        "data_seed": args.data_seed, "methods": {m: METHODS[m] for m in ids},
        "reference": REF, "peers": {"faiss": "present" if have["faiss"] else "absent"},
        "sets": infos, "rows": rows, "summary": summ})


if __name__ == "__main__":
    main()
