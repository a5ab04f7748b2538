"""What does ending a settled schedule cost? The default fit with and without the "settled"
end of the schedule (``docs/theory.md`` section 6.9), from the same seeds.

    python benchmarks/study_settle.py [--seeds 10] [--clinc-seeds 3] [--json PATH]

``on`` is the default ``AnnealedKMeans(n_clusters=K, random_state=seed)``; ``off`` the same
fit with only that criterion switched off (``fastanneal._engine.SETTLE_TOL`` set below zero
for the fit: the one-hot end of section 6.8 stays, so the two differ only by the settled
end). Data: the ten per-domain subsets of CLINC150 (K = 15, cosine), all of CLINC150
(K = 150, cosine; fewer seeds: a fit takes seconds), 30 sets of eight overlapping 2-D
Gaussians (two fit seeds each) and the eight known-answer sets of
``bench_known_answers.py``. Per dataset: the objective of the fitted metric relative to
``off`` (median and worst over seeds, and how many seeds lost more than 1e-4), ARI against
the true labels (CLINC) or fits with every cluster found (known-answer sets, CI = 0), the
step where the schedule settled (median), moment passes and seconds (means; wall time on
shared cores, the two variants interleaved per seed). Writes JSON atomically (default
``benchmarks/results/study_settle.json``).
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

import _known_answers as ka  # noqa: E402
import _study  # noqa: E402

import fastanneal as fa  # noqa: E402
from fastanneal import _engine  # noqa: E402


def fit(X, K, seed, metric, settle):
    saved = _engine.SETTLE_TOL
    if not settle:
        _engine.SETTLE_TOL = -1.0            # |dJ| <= negative: never settled
    try:
        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = fa.AnnealedKMeans(K, metric=metric, random_state=seed).fit(X)
        return m, time.perf_counter() - t
    finally:
        _engine.SETTLE_TOL = saved


def objective(X, m, metric):
    """The fitted metric's objective of the returned partition, float64 (cosine: spherical
    k-means with unit mean directions; Euclidean: SSE about the cluster means), as
    ``bench_quality.py`` computes it."""
    from bench_quality import partition_sse, spherical_objective
    f = spherical_objective if metric == "cosine" else partition_sse
    return float(f(X, m.labels_))


def overlap_2d(ds):
    """Overlapping 2-D clusters, data set ``ds`` (8 Gaussians, means 2.5 N(0, 1), 150 rows
    each; the data of tests/test_stop_when_hard.py): the annealing path has plateaus
    followed by late transitions. ``(X, true labels)``."""
    g = np.random.default_rng(100 + ds)
    M = 2.5 * g.standard_normal((8, 2))
    X = np.concatenate([m + g.standard_normal((150, 2)) for m in M])
    return X, np.repeat(np.arange(8), 150)


def run(name, X, K, metric, seeds, truth=None, centers=None):
    from sklearn.metrics import adjusted_rand_score
    rows = []
    for seed in seeds:
        rec = {"dataset": name, "seed": seed}
        for variant in ("off", "on"):
            m, sec = fit(X, K, seed, metric, variant == "on")
            rec[variant] = {"objective": objective(X, m, metric), "seconds": sec,
                            "passes": int(m.n_iter_), "steps": int(m.n_steps_),
                            "settled_step": m.settled_step_,
                            "hardened_step": m.hardened_step_}
            if truth is not None:
                rec[variant]["ari"] = float(adjusted_rand_score(truth, m.labels_))
            if centers is not None:
                rec[variant]["ci"] = ka.centroid_index(m.cluster_centers_, centers)
        rows.append(rec)
    return rows


def variant_means(s, R, v):
    """Into the summary ``s``: the mean passes, seconds, ARI and the fits with CI = 0 of
    variant ``v`` over the seed records ``R``."""
    s[f"passes_{v}"] = float(np.mean([r[v]["passes"] for r in R]))
    s[f"seconds_{v}"] = float(np.mean([r[v]["seconds"] for r in R]))
    if "ari" in R[0][v]:
        s[f"ari_{v}"] = float(np.mean([r[v]["ari"] for r in R]))
    if "ci" in R[0][v]:
        s[f"ci0_{v}"] = int(sum(r[v]["ci"] == 0 for r in R))


def summarize(rows):
    out = []
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        R = [r for r in rows if r["dataset"] == ds]
        rel = np.array([r["on"]["objective"] / r["off"]["objective"] for r in R])
        st = [r["on"]["settled_step"] for r in R if r["on"]["settled_step"] is not None]
        s = {"dataset": ds, "seeds": len(R), "obj_rel_median": float(np.median(rel)),
             "obj_rel_max": float(rel.max()), "worse_1e4": int((rel > 1 + 1e-4).sum()),
             "better_1e4": int((rel < 1 - 1e-4).sum()),
             "settled": len(st), "settled_step": float(np.median(st)) if st else None}
        for v in ("off", "on"):
            variant_means(s, R, v)
        s["time_ratio"] = s["seconds_on"] / s["seconds_off"]
        out.append(s)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--clinc-seeds", type=int, default=3)
    ap.add_argument("--no-clinc150", action="store_true", help="skip the K = 150 fits")
    ap.add_argument("--overlap-sets", type=int, default=30,
                    help="overlapping 2-D data sets (two fits each)")
    ap.add_argument("--json", default=str(HERE / "results" / "study_settle.json"))
    args = ap.parse_args(argv)
    seeds = list(range(args.seeds))
    fa.AnnealedKMeans(3, random_state=0).fit(np.random.default_rng(0).random((300, 4)))
    rows = []
    if _study.CLINC.exists():
        Xall, lab = _study.load_clinc_table(_study.CLINC)
        for dom, intents in _study.CLINC_DOMAINS.items():
            keep = np.isin(lab, intents.split() if isinstance(intents, str) else intents)
            _, y = np.unique(lab[keep], return_inverse=True)
            rows += run(f"clinc150/{dom}", np.ascontiguousarray(Xall[keep]), 15, "cosine",
                        seeds, truth=y)
        if not args.no_clinc150:
            _, y = np.unique(lab, return_inverse=True)
            rows += run("clinc150", Xall, 150, "cosine", list(range(args.clinc_seeds)),
                        truth=y)
    else:
        print(f"skipping CLINC150: {_study.CLINC} not found")
    # --overlap-sets data sets, two fit seeds each (small fits)
    for ds in range(args.overlap_sets):
        X, y = overlap_2d(ds)
        rows += run("overlap-2d", X, 8, "euclidean", [0, 1], truth=y)
    for name in ka.SETS:
        per_seed = []
        for seed in seeds:
            X, C, _ = ka.load(name, seed)
            per_seed += run(name, X, len(C), "euclidean", [seed], centers=C)
        rows += per_seed
    summ = summarize(rows)

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    table = []
    for s in summ:
        q = (f"ARI {s['ari_off']:.4f} -> {s['ari_on']:.4f}" if "ari_on" in s
             else f"CI=0 {s['ci0_off']} -> {s['ci0_on']}")
        table.append({**s, "quality": q,
                      "obj": f"{s['obj_rel_median']:.6f} / {s['obj_rel_max']:.6f}",
                      "wb": f"{s['worse_1e4']} / {s['better_1e4']}",
                      "pp": f"{s['passes_off']:.1f} -> {s['passes_on']:.1f}",
                      "st": f"{s['settled']}/{s['seeds']} @ {f(s['settled_step'], '.0f')}"})
    _study.print_table(table, [("dataset", "dataset", "s"), ("obj", "obj on/off med / max", "s"),
                               ("wb", "worse/better >1e-4", "s"), ("quality", "quality", "s"),
                               ("st", "settled @ step", "s"), ("pp", "passes", "s"),
                               ("time_ratio", "time on/off", ".2f")],
                       title="settled end of the schedule: on vs off, same seeds")
    _study.write_json(args.json, {"rows": rows, "summary": summ,
                                  "settle_tol": _engine.SETTLE_TOL,
                                  "settle_entropy": _engine.SETTLE_ENTROPY})


if __name__ == "__main__":
    main()
