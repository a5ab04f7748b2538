"""Is the ``probability`` column calibrated? A measurement, not yet a feature.

    python benchmarks/study_calibration.py                       # CLINC150 + 4 domains
    python benchmarks/study_calibration.py --datasets clinc150/home,clinc150/travel

For a default cosine fit with K = the number of intents, a row counts as "right" when its
intent is its cluster's majority intent. Its probability is the softmax responsibility of
its cluster (with the fitted cluster masses as prior) at a temperature ``T``:

* ``final``: the fit's final temperature (what ``predict_proba`` and the command's
  ``probability`` use today);
* ``c x median margin``: ``T = c * median(d_(2) - d_(1))`` over the rows, c in 0.1 .. 0.4
  (a temperature chosen from the data, no labels).

Reported: the expected calibration error (10 equal-width bins) and the mean probability next
to the accuracy. Writes ``benchmarks/results/study_calibration.json``.
"""
import argparse
import warnings

import numpy as np

import _study

FRACTIONS = (0.1, 0.15, 0.2, 0.25, 0.3, 0.4)


def ece(p, correct, bins=10):
    edges = np.linspace(0, 1, bins + 1)
    idx = np.clip(np.digitize(p, edges) - 1, 0, bins - 1)
    out = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            out += m.mean() * abs(p[m].mean() - correct[m].mean())
    return float(out)


def probabilities(d, logw, labels, T):
    z = -d / T + logw
    z -= z.max(axis=1, keepdims=True)
    P = np.exp(z)
    P /= P.sum(axis=1, keepdims=True)
    return P[np.arange(labels.shape[0]), labels]


def main(argv=None):
    import fastanneal
    from fastanneal._moments import pairwise_distances
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", default="clinc150,clinc150/banking,clinc150/home,"
                                          "clinc150/travel,clinc150/small_talk")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    rows = []
    print(f"{'dataset':22s} {'acc':>5s} {'final':>12s} " + " ".join(
        f"{f'{c}xmed':>12s}" for c in FRACTIONS))
    for name in args.datasets.split(","):
        ds = _study.load(name, args.quick)
        km = fastanneal.AnnealedKMeans(ds.K, metric="cosine", random_state=0).fit(ds.X)
        lab = km.labels_
        maj = np.array([np.bincount(ds.y[lab == k]).argmax() if (lab == k).any() else -1
                        for k in range(ds.K)])
        correct = (ds.y == maj[lab]).astype(float)
        d = np.asarray(pairwise_distances(ds.X, km.cluster_centers_, metric="cosine"), float)
        s = np.sort(d, axis=1)
        med = float(np.median(s[:, 1] - s[:, 0]))
        logw = np.log(np.maximum(km.cluster_weights_, 1e-300))
        res = {"dataset": name, "accuracy": float(correct.mean()), "median_margin": med}
        cells = []
        for key, T in [("final", km.temperature_)] + [(f"{c}xmed", c * med) for c in FRACTIONS]:
            p = probabilities(d, logw, lab, T)
            res[key] = {"T": float(T), "ece": ece(p, correct), "mean_p": float(p.mean())}
            cells.append(f"{res[key]['ece']:.3f}/{res[key]['mean_p']:.2f}")
        rows.append(res)
        print(f"{name:22s} {res['accuracy']:5.3f} " + " ".join(f"{c:>12s}" for c in cells),
              flush=True)
    print("cells: ECE / mean probability")
    _study.write_json(_study.RESULTS / "study_calibration.json", {"rows": rows})


if __name__ == "__main__":
    main()
