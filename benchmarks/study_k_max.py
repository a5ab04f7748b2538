"""Does ``suggest_k`` depend on ``k_max``? The known-K sets of ``bench_choose_k.py`` with
``k_max = max(8, 2 K)`` (the benchmark's setting) and with ``k_max = K`` (a user who sets
it to the K they suspect).

    python benchmarks/study_k_max.py --seeds 6

fastanneal only (no peers): per setting, how often the suggestion is the true K, the
misses, and the seconds of all ``suggest_k`` calls. Writes JSON (default
``benchmarks/results/study_k_max.json``).
"""
import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--json", default=str(HERE / "results" / "study_k_max.json"))
    a = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    import fastanneal
    from bench_choose_k import make_sets
    fastanneal.suggest_k(np.random.default_rng(0).normal(size=(200, 4)), k_max=4,
                         random_state=0)                  # compile outside the timings
    out = {}
    for setting in ("2K", "K"):
        ok = tot = 0
        secs = 0.0
        misses = []
        for seed in range(a.seeds):
            for name, (X, K, _) in make_sets(seed).items():
                k_max = max(8, 2 * K) if setting == "2K" else K
                t = time.perf_counter()
                s = fastanneal.suggest_k(X, k_max=k_max, random_state=seed)
                secs += time.perf_counter() - t
                tot += 1
                ok += int(s.best == K)
                if s.best != K:
                    misses.append(dict(seed=seed, set=name, k=int(K), suggested=int(s.best),
                                       supported=bool(s.supported)))
        out[setting] = dict(correct=ok, sets=tot, seconds=secs, misses=misses)
        print(f"k_max = {'max(8, 2K)' if setting == '2K' else 'K'}: {ok} of {tot} correct, "
              f"{secs:.1f} s; misses: "
              + ", ".join(f"{m['set']}/{m['seed']} {m['k']}->{m['suggested']}" for m in misses))
    out["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1))
    print("wrote", a.json)


if __name__ == "__main__":
    main()
