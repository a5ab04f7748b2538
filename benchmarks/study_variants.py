"""A default against a variant of it, from the same seeds: what a candidate default change
would cost or gain, on every data family the defaults were tuned on.

    python benchmarks/study_variants.py --variant SETTLE_TOL=1e-4 [--variant max_iter=2,SETTLE_TOL=1e-4]
        [--seeds 10] [--clinc-seeds 3] [--no-clinc150] [--overlap-sets 30] [--json PATH]

A variant is a comma-separated list of ``NAME=VALUE``: an upper-case ``NAME`` is a constant
of ``fastanneal._engine`` (set for the fit, restored after), any other an
``AnnealedKMeans`` parameter. ``base`` is the default ``AnnealedKMeans(K, metric=...,
random_state=seed)``. Data (those of ``study_settle.py``): the ten per-domain subsets of
CLINC150 (K = 15, cosine), all of CLINC150 (K = 150, cosine; ``--clinc-seeds``), overlapping
2-D Gaussians (``--overlap-sets`` data sets, two fit seeds each) and the eight known-answer
sets of ``bench_known_answers.py``. Per dataset and variant: the objective of the fitted
metric relative to ``base`` (median, worst, how many seeds worse / better by > 1e-4), ARI
(CLINC, overlap) or fits with every cluster found (CI = 0), moment passes (deterministic:
the time proxy that does not depend on the machine's load) and seconds (the variants
interleaved per seed; wall time on shared cores). Writes JSON atomically (default
``benchmarks/results/study_variants.json``).
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
from study_settle import objective, overlap_2d, variant_means  # noqa: E402

import fastanneal as fa  # noqa: E402
from fastanneal import _engine  # noqa: E402


def parse_variant(spec):
    """``"A=1,b=2"`` -> ``(engine constants, estimator parameters)``."""
    consts, params = {}, {}
    for tok in filter(None, (t.strip() for t in spec.split(","))):
        name, _, val = tok.partition("=")
        if not val:
            raise SystemExit(f"variant item {tok!r}: expected NAME=VALUE")
        try:
            v = int(val)
        except ValueError:
            try:
                v = float(val)
            except ValueError:
                v = {"True": True, "False": False, "None": None}.get(val, val)
        if name.isupper():
            if not hasattr(_engine, name):
                raise SystemExit(f"fastanneal._engine has no constant {name}")
            consts[name] = v
        else:
            params[name] = v
    return consts, params


def fit(X, K, seed, metric, consts, params):
    saved = {k: getattr(_engine, k) for k in consts}
    for k, v in consts.items():
        setattr(_engine, k, v)
    try:
        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = fa.AnnealedKMeans(K, metric=metric, random_state=seed, **params).fit(X)
        return m, time.perf_counter() - t
    finally:
        for k, v in saved.items():
            setattr(_engine, k, v)


def run(name, X, K, metric, seeds, variants, truth=None, centers=None):
    from sklearn.metrics import adjusted_rand_score
    rows = []
    for seed in seeds:
        rec = {"dataset": name, "seed": seed}
        for vname, (consts, params) in variants.items():
            m, sec = fit(X, K, seed, metric, consts, params)
            r = {"objective": objective(X, m, metric), "seconds": sec,
                 "passes": int(m.n_iter_), "steps": int(m.n_steps_)}
            if truth is not None:
                r["ari"] = float(adjusted_rand_score(truth, m.labels_))
            if centers is not None:
                r["ci"] = ka.centroid_index(m.cluster_centers_, centers)
            rec[vname] = r
        rows.append(rec)
    return rows


def summarize(rows, names):
    out = []
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        R = [r for r in rows if r["dataset"] == ds]
        s = {"dataset": ds, "seeds": len(R)}
        for v in names:
            variant_means(s, R, v)
            if v != "base":
                rel = np.array([r[v]["objective"] / r["base"]["objective"] for r in R])
                s[f"obj_rel_median_{v}"] = float(np.median(rel))
                s[f"obj_rel_max_{v}"] = float(rel.max())
                s[f"worse_1e4_{v}"] = int((rel > 1 + 1e-4).sum())
                s[f"better_1e4_{v}"] = int((rel < 1 - 1e-4).sum())
                s[f"time_ratio_{v}"] = s[f"seconds_{v}"] / s["seconds_base"]
        out.append(s)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", action="append", required=True,
                    help="NAME=VALUE[,NAME=VALUE...] (repeatable)")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--clinc-seeds", type=int, default=3)
    ap.add_argument("--no-clinc150", action="store_true", help="skip the K = 150 fits")
    ap.add_argument("--no-domains", action="store_true", help="skip the CLINC150 domains")
    ap.add_argument("--overlap-sets", type=int, default=30,
                    help="overlapping 2-D data sets (two fits each)")
    ap.add_argument("--known-answers", default=",".join(ka.SETS),
                    help="comma-separated known-answer sets ('' for none)")
    ap.add_argument("--json", default=str(HERE / "results" / "study_variants.json"))
    args = ap.parse_args(argv)
    variants = {"base": ({}, {})}
    for spec in args.variant:
        variants[spec] = parse_variant(spec)
    names = list(variants)
    seeds = list(range(args.seeds))
    g0 = np.random.default_rng(0)
    for warm in (g0.random((300, 4)), g0.random((300, 2))):      # compile before timing
        fa.AnnealedKMeans(3, random_state=0).fit(warm)
    fa.AnnealedKMeans(3, metric="cosine", random_state=0).fit(
        g0.random((300, 8)).astype(np.float32))
    rows = []
    if _study.CLINC.exists():
        Xall, lab = _study.load_clinc_table(_study.CLINC)
        if not args.no_domains:
            for dom, intents in _study.CLINC_DOMAINS.items():
                keep = np.isin(lab, intents.split() if isinstance(intents, str) else intents)
                _, y = np.unique(lab[keep], return_inverse=True)
                rows += run(f"clinc150/{dom}", np.ascontiguousarray(Xall[keep]), 15, "cosine",
                            seeds, variants, truth=y)
                print(f"  {dom} done", flush=True)
        if not args.no_clinc150:
            _, y = np.unique(lab, return_inverse=True)
            rows += run("clinc150", Xall, 150, "cosine", list(range(args.clinc_seeds)),
                        variants, truth=y)
    else:
        print(f"skipping CLINC150: {_study.CLINC} not found")
    for ds in range(args.overlap_sets):              # overlapping 2-D clusters
        X, y = overlap_2d(ds)
        rows += run("overlap-2d", X, 8, "euclidean", [0, 1], variants, truth=y)
    for name in filter(None, args.known_answers.split(",")):
        for seed in seeds:
            X, C, _ = ka.load(name, seed)
            rows += run(name, X, len(C), "euclidean", [seed], variants, centers=C)
    summ = summarize(rows, names)
    table = []
    for s in summ:
        row = {"dataset": s["dataset"]}
        qk = "ari" if "ari_base" in s else "ci0"
        fmt = ".4f" if qk == "ari" else "d"
        row["quality"] = " / ".join(format(s[f"{qk}_{v}"], fmt) for v in names)
        row["passes"] = " / ".join(f"{s[f'passes_{v}']:.1f}" for v in names)
        row["obj"] = " | ".join(f"{s[f'obj_rel_median_{v}']:.6f} / {s[f'obj_rel_max_{v}']:.6f}"
                                f" ({s[f'worse_1e4_{v}']}w {s[f'better_1e4_{v}']}b)"
                                for v in names[1:])
        row["time"] = " / ".join(f"{s[f'time_ratio_{v}']:.2f}" for v in names[1:])
        table.append(row)
    _study.print_table(table, [("dataset", "dataset", "s"),
                               ("obj", "objective vs base: median / worst (seeds worse, "
                                       "better by > 1e-4)", "s"),
                               ("quality", "ARI or CI=0 fits: " + " / ".join(names), "s"),
                               ("passes", "passes: " + " / ".join(names), "s"),
                               ("time", "time vs base", "s")],
                       title="variants of the default, same seeds")
    _study.write_json(args.json, {"variants": {k: {"engine": c, "params": p}
                                               for k, (c, p) in variants.items()},
                                  "rows": rows, "summary": summ,
                                  "machine": _study.machine_info()})


if __name__ == "__main__":
    main()
