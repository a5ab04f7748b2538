"""Is the ``probability`` column calibrated? The library's default against labelled query sets.

    python benchmarks/study_calibration.py                  # CLINC150 + its 10 domains, 3 seeds
    python benchmarks/study_calibration.py --seeds 1 --datasets clinc150/home,clinc150/travel

For a default cosine fit with K = the number of intents, a row counts as "right" when its
intent is its cluster's majority intent. Its probability is ``predict_proba`` of its cluster:

* ``default``: what ``AnnealedKMeans.predict_proba`` and the command's ``probability`` column
  give: a softmax with the cluster masses as prior at ``probability_temperature_``, a
  fraction (0.25) of the median margin ``d_(2) - d_(1)`` chosen from the data after the fit;
* ``final``: the fit's final annealing temperature (what they gave before);
* ``c x median margin``: the same rule with other fractions, to show the sensitivity.

Reported: the expected calibration error (ECE, 10 equal-width bins) and the mean
probability next to the accuracy, per dataset and seed; a reliability diagram (SVG, the
library's own chart code) pooled over the ten domains and for all of CLINC150. Writes
``benchmarks/results/study_calibration.json`` and ``study_calibration_reliability.svg``.

The fraction 0.25 was chosen on these same sets (it has the lowest mean ECE of 0.05-0.5):
an in-sample choice, reported as such.
"""
import argparse
import warnings

import numpy as np

import _study

FRACTIONS = (0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)
BINS = 10


def ece(p, correct, bins=BINS):
    edges = np.linspace(0, 1, bins + 1)
    idx = np.clip(np.digitize(p, edges) - 1, 0, bins - 1)
    out = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            out += m.mean() * abs(p[m].mean() - correct[m].mean())
    return float(out)


def reliability(p, correct, bins=BINS):
    """Per bin: mean probability, accuracy, rows (bins with rows only)."""
    edges = np.linspace(0, 1, bins + 1)
    idx = np.clip(np.digitize(p, edges) - 1, 0, bins - 1)
    out = []
    for b in range(bins):
        m = idx == b
        if m.any():
            out.append((float(p[m].mean()), float(correct[m].mean()), int(m.sum())))
    return out


def probabilities(d, logw, labels, T):
    z = -d / T + logw
    z -= z.max(axis=1, keepdims=True)
    P = np.exp(z)
    P /= P.sum(axis=1, keepdims=True)
    return P[np.arange(labels.shape[0]), labels]


def main(argv=None):
    import fastanneal
    from fastanneal._moments import pairwise_distances
    from fastanneal.report import svg_chart
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", default="clinc150," + ",".join(
        f"clinc150/{d}" for d in _study.CLINC_DOMAINS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    rows = []
    pooled = {"domains": ([], []), "clinc150": ([], [])}
    print(f"{'dataset':28s} {'seed':>4s} {'acc':>5s} {'default':>11s} {'final':>11s} "
          + " ".join(f"{f'{c}xmed':>8s}" for c in FRACTIONS))
    for name in args.datasets.split(","):
        ds = _study.load(name, args.quick)
        for seed in range(args.seeds):
            km = fastanneal.AnnealedKMeans(ds.K, metric="cosine", random_state=seed).fit(ds.X)
            lab = km.labels_
            maj = np.array([np.bincount(ds.y[lab == k]).argmax() if (lab == k).any() else -1
                            for k in range(ds.K)])
            correct = (ds.y == maj[lab]).astype(float)
            p_def = km.predict_proba(ds.X)[np.arange(lab.shape[0]), lab]
            p_fin = km.predict_proba(ds.X, temperature="final")[np.arange(lab.shape[0]), lab]
            d = np.asarray(pairwise_distances(ds.X, km.cluster_centers_, metric="cosine"),
                           float)
            s = np.sort(d, axis=1)
            med = float(np.median(s[:, 1] - s[:, 0]))
            logw = np.log(np.maximum(km.cluster_weights_, 1e-300))
            res = {"dataset": name, "seed": seed, "rows": int(lab.shape[0]), "K": ds.K,
                   "accuracy": float(correct.mean()), "median_margin": med,
                   "probability_temperature": float(km.probability_temperature_),
                   "default": {"ece": ece(p_def, correct), "mean_p": float(p_def.mean()),
                               "reliability": reliability(p_def, correct)},
                   "final": {"T": float(km.temperature_), "ece": ece(p_fin, correct),
                             "mean_p": float(p_fin.mean())}}
            for c in FRACTIONS:
                p = probabilities(d, logw, lab, c * med)
                res[f"{c}xmed"] = {"ece": ece(p, correct), "mean_p": float(p.mean())}
            rows.append(res)
            key = "clinc150" if name == "clinc150" else "domains"
            pooled[key][0].append(p_def)
            pooled[key][1].append(correct)
            print(f"{name:28s} {seed:>4d} {res['accuracy']:5.3f} "
                  f"{res['default']['ece']:5.3f}/{res['default']['mean_p']:.2f} "
                  f"{res['final']['ece']:5.3f}/{res['final']['mean_p']:.2f} "
                  + " ".join(f"{res[f'{c}xmed']['ece']:8.3f}" for c in FRACTIONS), flush=True)
    print("cells: ECE / mean probability (default, final); ECE only for the fractions")
    e = np.array([r["default"]["ece"] for r in rows])
    ok = int((e <= 0.1).sum())
    print(f"default: ECE <= 0.1 on {ok} of {len(rows)} fits; mean {e.mean():.3f}, "
          f"max {e.max():.3f} ({rows[int(e.argmax())]['dataset']})")
    series, summary = [], {"fits": len(rows), "ece_le_0.1": ok, "mean_ece": float(e.mean()),
                           "max_ece": float(e.max())}
    colors = {"clinc150": "#0969da", "domains": "#cf222e"}
    for key, (ps, cs) in pooled.items():
        if not ps:
            continue
        p, c = np.concatenate(ps), np.concatenate(cs)
        rel = reliability(p, c)
        summary[f"pooled_{key}"] = {"ece": ece(p, c), "reliability": rel}
        series.append({"x": [r[0] for r in rel], "y": [r[1] for r in rel],
                       "color": colors[key],
                       "label": f"{'CLINC150' if key == 'clinc150' else 'ten domains'} "
                                f"(ECE {ece(p, c):.3f})"})
    series.append({"x": [0, 1], "y": [0, 1], "color": "#57606a", "dash": True,
                   "marker": False, "label": "perfect calibration"})
    svg = svg_chart(series, "reliability of predict_proba (default temperature)",
                    "mean probability in the bin", "rows sharing the cluster's majority intent",
                    width=520, height=420)
    out = _study.RESULTS / "study_calibration_reliability.svg"
    out.write_text(svg, encoding="utf-8")
    _study.write_json(_study.RESULTS / "study_calibration.json",
                      {"rows": rows, "summary": summary, "machine": _study.machine_info()})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
