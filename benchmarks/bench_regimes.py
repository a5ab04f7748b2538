"""Temperature regimes: static hot, static cold, exponential decay and adaptive.

    python benchmarks/bench_regimes.py            # synthetic (3 seeds) + CLINC150 subsample
    python benchmarks/bench_regimes.py --quick    # small versions of both (about a minute)
    python benchmarks/bench_regimes.py --no-anchor  # without the anchored gradient rows

Every temperature is relative to the data scale ``s`` = mean of ``d(x_i, mean)`` over the
rows, exactly as ``AnnealedKMeans`` computes it (Euclidean: the trace of the covariance;
cosine with unit rows: ``d = 2 - 2 x.c`` to the unnormalized mean, ``= 2 (1 - ||mean||^2)``):

* ``static T=1.0``  : ``T = 1.0 s`` at every step (constant schedule);
* ``static T=0.05`` : ``T = 0.05 s`` at every step;
* ``exponential``   : geometric from ``1.0 s`` to ``0.005 s`` over the budget;
* ``adaptive``      : :class:`fastanneal.adaptive.AdaptiveSchedule` (default gains) from
  ``1.0 s``, clamped to ``[0.005 s, 50 s]``.

Each regime gets the same budget (``n_steps`` temperatures; the gradient solver takes
``steps_per_temperature`` Adam steps per temperature, soft Lloyd up to 4 iterations) and the
same k-means++ seeds, then the same Lloyd polish at ``T = 0``. The regime comparison uses the
gradient solver (Adam on ``L = L_comp - lam L_sep``, its defaults: ``lam = 0.1``,
``phi = identity``, ``learning_rate = 0.05``, no anchor), and again with the free-energy
anchor (``anchor_weight = 1``; ``--no-anchor`` skips these rows); the Lloyd solver runs the
exponential and adaptive regimes.

Columns (all measured at termination, i.e. the last annealing temperature, before the
polish, unless said otherwise):

* ``dmu_min`` / ``dmu_mean``: min and mean over pairs ``k != l`` of ``||mu_k - mu_l||``,
  ``mu_k = S_k / N_k`` the soft centroids (Euclidean centroids, also for cosine);
* ``H_end``: mean assignment entropy (nats) at the last temperature;
* ``var_g``: variance over the temperature steps of the separation-gradient norm
  ``g_t = ||dL_sep/dC||`` (gradient solver: the value fed to the schedule, i.e. at the
  last Adam step of each temperature; Lloyd: ``value_and_grad`` at the centers after each
  temperature step); ``cv_g`` = std / mean, scale-free;
* ``t*``: first step from which on, to the end of the schedule (at least 3 steps), the
  hard labels change for at most 0.1 % of the rows between consecutive steps and the
  entropy stays below 0.1 nats; ``-`` = did not converge;
* ``ARI_pre``: ARI of the hard labels of the centers at termination; ``ARI``, ``J``: after
  the polish (the deployed rule), ``J`` per unit weight, in units of ``s``.

Writes ``benchmarks/results/bench_regimes.json`` (``--quick``: ``bench_regimes_quick.json``):
all runs with their temperature, entropy and gradient-norm paths, the summary, the winners.
"""
import _peer_threads  # noqa: F401,I001 -- first: before scikit-learn loads OpenMP
import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
CLINC = HERE.parents[1] / "shared" / "data" / "clinc150.parquet"

H_THRESHOLD = 0.1        # nats
LABEL_TOL = 1e-3         # fraction of rows
MIN_TAIL = 3             # steps


# ----------------------------------------------------------------------------- data
def polysemous_mixture(rng, n=4000, d=16, k=10, spread=1.2, frac_between=0.2):
    """Gaussian mixture with overlapping components plus polysemous points.

    Means ``~ N(0, spread^2 I)`` (neighbouring components overlap with unit noise), equal
    weights; a fraction ``frac_between`` of the points is drawn between two random
    components, ``x = (1 - a) m_k + a m_l + noise``, ``a ~ U(0.3, 0.7)``, labelled with the
    nearer end. Parameters fixed before any run.
    """
    means = rng.standard_normal((k, d)) * spread * math.sqrt(2.0)
    n_b = int(frac_between * n)
    y = rng.integers(0, k, n - n_b)
    X = means[y] + rng.standard_normal((n - n_b, d))
    pk = rng.integers(0, k, n_b)
    pl = (pk + 1 + rng.integers(0, k - 1, n_b)) % k
    a = rng.uniform(0.3, 0.7, n_b)
    Xb = (1 - a)[:, None] * means[pk] + a[:, None] * means[pl] + rng.standard_normal((n_b, d))
    yb = np.where(a < 0.5, pk, pl)
    X = np.concatenate([X, Xb])
    y = np.concatenate([y, yb])
    perm = rng.permutation(n)
    return np.ascontiguousarray(X[perm]), y[perm]


def load_clinc(per_intent, rng, path=CLINC):
    import pyarrow.parquet as pq
    t = pq.read_table(path, columns=["embedding", "label"])
    X = np.asarray(t.column("embedding").combine_chunks().flatten(), dtype=np.float32)
    X = X.reshape(t.num_rows, -1)
    _, y = np.unique(np.asarray(t.column("label").to_pylist()), return_inverse=True)
    if per_intent:
        keep = np.concatenate([rng.choice(np.nonzero(y == c)[0], per_intent, replace=False)
                               for c in range(y.max() + 1)])
        keep.sort()
        X, y = X[keep], y[keep]
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    return np.ascontiguousarray(X), y


# ----------------------------------------------------------------------------- runs
def data_scale(src):
    """As AnnealedKMeans.fit: mean d of the rows to the (unnormalized) weighted mean."""
    mean = src.mean()
    m0 = src.moments(mean[None, :], 1.0, 2, None, hard_sums=False)
    return m0.hard_distortion / src.total_weight


def regimes(n_steps):
    from fastanneal.adaptive import AdaptiveSchedule
    from fastanneal.schedules import ConstantSchedule, GeometricSchedule
    return {
        "static T=1.0": (lambda: ConstantSchedule(n_steps), 1.0, 1.0),
        "static T=0.05": (lambda: ConstantSchedule(n_steps), 0.05, 0.05),
        "exponential": (lambda: GeometricSchedule(n_steps), 1.0, 0.005),
        "adaptive": (lambda: AdaptiveSchedule(n_steps=n_steps), 1.0, 0.005),
    }


def convergence_step(labels, H):
    """First step t with, for all s >= t: H_s < threshold, and for s > t at most LABEL_TOL
    of the rows changed label from s - 1; needs MIN_TAIL steps. None if there is none."""
    n = len(H)
    t_star = None
    for t in range(n - 1, -1, -1):
        ok = H[t] < H_THRESHOLD
        if ok and t < n - 1:
            ok = np.mean(labels[t + 1] != labels[t]) <= LABEL_TOL
        if not ok:
            break
        t_star = t
    if t_star is None or n - t_star < MIN_TAIL:
        return None
    return t_star


def one_run(src, y, K, C0, regime, solver, n_steps, inner, scale, seed, lam=0.1, rho=0.0):
    from sklearn.metrics import adjusted_rand_score
    from fastanneal._engine import EngineConfig, anneal
    from fastanneal._gradient_solver import anneal_gradient
    from fastanneal._trace import Trace
    from fastanneal.gradient import value_and_grad

    make, r0, r1 = regimes(n_steps)[regime]
    metric_name = "cosine" if src.metric == 1 else "euclidean"
    labels, g_hook = [], []

    def record(C, T):
        labels.append(src.assign(C)[0].copy())
        if solver == "lloyd":
            g_hook.append(value_and_grad(src.X, C, T, lam=lam, weights=src.w,
                                         metric=metric_name).separation_grad_norm)

    def hook(st):
        # the engine calls it after every step but the last, with the centers at the end
        # of that step (st.last["temperature"] is the step's temperature; st.temperature
        # already the next one); the last step is recorded from the result below
        record(st.centers, st.last["temperature"])

    # the same budget for every regime: no early end once the partition is hard
    cfg = EngineConfig(n_clusters=K, mass_constrained=False, stop_when_hard=False)
    trace = Trace()
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if solver == "lloyd":
            res = anneal(src, C0, make(), r0 * scale, r1 * scale, cfg,
                         np.random.default_rng(seed), scale, trace, state_hook=hook)
        else:
            res = anneal_gradient(src, C0, make(), r0 * scale, r1 * scale, cfg,
                                  np.random.default_rng(seed), scale, trace, state_hook=hook,
                                  steps_per_temperature=inner, separation_weight=lam,
                                  anchor_weight=rho)
    seconds = time.perf_counter() - t0
    d = trace.as_dict()
    record(res.centers, float(d["temperature"][d["step"] >= 0][-1]))
    ann = d["step"] >= 0
    H = d["entropy"][ann]
    g = np.asarray(g_hook) if solver == "lloyd" else d["grad_norm"][ann]
    m = res.last_moments
    nz = m.N > 0
    mu = m.S[nz] / m.N[nz, None]
    sq = np.einsum("ij,ij->i", mu, mu)
    D2 = np.maximum(sq[:, None] + sq[None, :] - 2 * mu @ mu.T, 0.0)
    iu = np.triu_indices(len(mu), 1)
    dist = np.sqrt(D2[iu])
    t_star = convergence_step(labels, H)
    lab_post, dmin, _ = src.assign(res.centers)
    W = src.total_weight
    return {
        "regime": regime, "solver": solver, "seed": seed, "anchor_weight": rho,
        "dmu_min": float(dist.min()) if dist.size else math.nan,
        "dmu_mean": float(dist.mean()) if dist.size else math.nan,
        "H_end": float(H[-1]),
        "var_g": float(np.var(g)), "cv_g": float(np.std(g) / np.mean(g)),
        "t_star": t_star,
        "ari_pre": float(adjusted_rand_score(y, labels[-1])),
        "ari": float(adjusted_rand_score(y, lab_post)),
        "J": float(src.w @ dmin / W / scale),
        "T_end_rel": float(d["temperature"][ann][-1] / scale),
        "empty_end": int((~nz).sum()),
        "seconds": seconds,
        "T_rel": [float(v) for v in d["temperature"][ann] / scale],
        "H": [float(v) for v in H], "g": [float(v) for v in g],
    }


def run_dataset(name, X, y, K, metric, seeds, n_steps, inner, anchor):
    from fastanneal._sources import InMemorySource
    from fastanneal.estimator import kmeans_plusplus
    w = np.ones(len(X))
    src = InMemorySource(X, w, metric)
    scale = data_scale(src)
    configs = [("gradient", r, 0.0) for r in regimes(n_steps)]
    if anchor:
        configs += [("gradient", r, 1.0) for r in regimes(n_steps)]
    configs += [("lloyd", "exponential", 0.0), ("lloyd", "adaptive", 0.0)]
    rows = []
    for seed in seeds:
        C0 = kmeans_plusplus(X, w, K, np.random.default_rng(seed))
        if metric == 1:
            C0 /= np.linalg.norm(C0, axis=1, keepdims=True)
        for solver, regime, rho in configs:
            r = one_run(src, y, K, C0, regime, solver, n_steps, inner, scale, seed, rho=rho)
            r["dataset"] = name
            r["scale"] = scale
            rows.append(r)
            ts = "-" if r["t_star"] is None else r["t_star"]
            print(f"  {name} seed={seed} {label(r):<24} {r['seconds']:6.1f}s  ARI={r['ari']:.3f}"
                  f" H_end={r['H_end']:.3f} t*={ts}", flush=True)
    return rows


def label(r):
    s = r["solver"] + ("+anchor" if r["anchor_weight"] else "")
    return f"{s} {r['regime']}"


# ----------------------------------------------------------------------------- summary
COLS = [  # key, header, format, better ("max"/"min")
    ("dmu_min", "dmu_min", "{:>8.3f}", "max"),
    ("dmu_mean", "dmu_mean", "{:>8.3f}", "max"),
    ("H_end", "H_end", "{:>7.3f}", "min"),
    ("var_g", "var_g", "{:>9.3g}", "min"),
    ("cv_g", "cv_g", "{:>6.2f}", "min"),
    ("t_star", "t*", "{:>5}", "min"),
    ("ari_pre", "ARI_pre", "{:>7.3f}", "max"),
    ("ari", "ARI", "{:>6.3f}", "max"),
    ("J", "J/s", "{:>7.4f}", "min"),
]


def summarize(rows):
    out = []
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        R = [r for r in rows if r["dataset"] == ds]
        for lab in dict.fromkeys(label(r) for r in R):
            M = [r for r in R if label(r) == lab]
            s = {"dataset": ds, "method": lab, "solver": M[0]["solver"],
                 "anchor_weight": M[0]["anchor_weight"], "regime": M[0]["regime"],
                 "runs": len(M), "seconds": float(np.mean([r["seconds"] for r in M]))}
            for key, *_ in COLS:
                if key == "t_star":
                    ts = [r["t_star"] for r in M]
                    s["t_star"] = (None if any(t is None for t in ts)
                                   else float(np.mean(ts)))
                    s["converged_runs"] = sum(t is not None for t in ts)
                else:
                    s[key] = float(np.mean([r[key] for r in M]))
            out.append(s)
    return out


def winners(summ, group):
    """Best regime per dataset and column among the rows of ``group`` (a predicate)."""
    res = []
    for ds in dict.fromkeys(s["dataset"] for s in summ):
        S = [s for s in summ if s["dataset"] == ds and group(s)]
        for key, head, _, better in COLS:
            vals = [(s[key], s["regime"]) for s in S if s[key] is not None
                    and not (isinstance(s[key], float) and math.isnan(s[key]))]
            if not vals:
                res.append({"dataset": ds, "column": head, "winner": None,
                            "note": "no run converged"})
                continue
            best = (max if better == "max" else min)(v for v, _ in vals)
            tied = [r for v, r in vals if math.isclose(v, best, rel_tol=1e-3, abs_tol=1e-9)]
            res.append({"dataset": ds, "column": head, "better": better, "value": best,
                        "winner": " = ".join(tied)})
    return res


def print_table(summ):
    head = f"{'dataset':<20} {'solver / regime':<30}" + "".join(
        f" {h:>{len(fmt.format(0)) if k != 't_star' else 5}}" for k, h, fmt, _ in COLS) + \
        f" {'sec':>6}"
    print(head)
    print("-" * len(head))
    for s in summ:
        cells = []
        for k, h, fmt, _ in COLS:
            v = s[k]
            if k == "t_star":
                cells.append(" " + (f"{v:>5.1f}" if v is not None else f"{'-':>5}"))
            else:
                cells.append(" " + fmt.format(v))
        print(f"{s['dataset']:<20} {s['method']:<30}" + "".join(cells) + f" {s['seconds']:>6.1f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-anchor", dest="anchor", action="store_false",
                    help="skip the gradient solver with the free-energy anchor")
    ap.add_argument("--clinc-per-intent", type=int, default=None,
                    help="CLINC150 rows per intent (default 40; --quick 8)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    quick = args.quick
    if args.json is None:
        args.json = str(HERE / "results" / ("bench_regimes_quick.json" if quick
                                            else "bench_regimes.json"))
    n_steps, inner = (10, 3) if quick else (20, 5)
    syn_seeds = [0] if quick else [0, 1, 2]
    per_intent = args.clinc_per_intent or (8 if quick else 40)
    import numba
    print(f"numba threads: {numba.get_num_threads()}; budget: {n_steps} temperatures, "
          f"{inner} Adam steps per temperature (gradient), <= 4 soft-Lloyd iterations (lloyd)")
    t_all = time.perf_counter()
    rows = []
    rng = np.random.default_rng(2024)
    n_syn, k_syn = (1500, 8) if quick else (4000, 10)
    X, y = polysemous_mixture(rng, n=n_syn, k=k_syn)
    syn_name = f"mixture n={n_syn} K={k_syn}"
    rows += run_dataset(syn_name, X, y, k_syn, 0, syn_seeds, n_steps, inner, args.anchor)
    clinc_name = None
    if CLINC.exists():
        Xc, yc = load_clinc(per_intent, np.random.default_rng(0))
        clinc_name = f"CLINC150 {per_intent}/intent"
        rows += run_dataset(clinc_name, Xc, yc, 150, 1, [0], n_steps, inner, args.anchor)
    else:
        print(f"skipping CLINC150: {CLINC} not found")
    summ = summarize(rows)
    print()
    print_table(summ)
    print("Temperatures relative to s = mean d(x, mean); dmu, H_end, var_g, t*, ARI_pre at "
          "the last annealing temperature; ARI, J after the T=0 polish (J in units of s).")
    print(f"t*: labels change <= {LABEL_TOL:.1%} of rows per step and H < {H_THRESHOLD} nats "
          f"from t* to the end (>= {MIN_TAIL} steps); '-': some run did not converge.")
    groups = {"gradient solver (no anchor)":
              lambda s: s["solver"] == "gradient" and not s["anchor_weight"],
              "lloyd solver": lambda s: s["solver"] == "lloyd"}
    if args.anchor:
        groups["gradient solver + anchor"] = (
            lambda s: s["solver"] == "gradient" and bool(s["anchor_weight"]))
    win = {}
    print("\nWinners (best mean per column; ties within 0.1 %):")
    for gname, pred in groups.items():
        win[gname] = winners(summ, pred)
        for w_ in win[gname]:
            val = "" if w_.get("value") is None else f" ({w_['value']:.4g})"
            print(f"  [{gname}] {w_['dataset']}: {w_['column']:<8} -> "
                  f"{w_['winner'] or w_.get('note')}{val}")
    total = time.perf_counter() - t_all
    print(f"\ntotal {total:.0f} s")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({
        "command": "python benchmarks/bench_regimes.py" + (" --quick" if quick else "")
                   + ("" if args.anchor else " --no-anchor"),
        "config": {"n_steps": n_steps, "adam_steps_per_temperature": inner,
                   "separation_weight": 0.1, "learning_rate": 0.05, "phi": "identity",
                   "regimes_relative_to_scale": {k: [v[1], v[2]] for k, v in
                                                 regimes(n_steps).items()},
                   "synthetic": {"n": n_syn, "k": k_syn, "d": 16, "seeds": syn_seeds},
                   "clinc150": {"per_intent": per_intent, "seeds": [0]} if clinc_name else None,
                   "t_star": {"H_threshold": H_THRESHOLD, "label_tol": LABEL_TOL,
                              "min_tail": MIN_TAIL}},
        "rows": rows, "summary": summ, "winners": win, "seconds": total,
        "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    os.replace(tmp, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
