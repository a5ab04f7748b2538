"""scikit-learn's ten-restart KMeans with and without ``OMP_WAIT_POLICY=PASSIVE``.

    python benchmarks/peer_omp.py [--sets dim128,dim1024,a20,grid100] [--repeats 8]

Each setting in its own fresh process (OpenMP reads the variable when it loads), the two
alternating; prints the median seconds of ``KMeans(K, n_init=10)`` over seeds and writes
``benchmarks/results/peer_omp.json``. Why the benchmarks set the variable: ``_peer_threads.py``.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = """
import sys, time
sys.path.insert(0, {here!r})
import numpy as np, _known_answers as ka
from sklearn.cluster import KMeans
X, C, _ = ka.load({name!r}, 0)
K = len(C)
KMeans(K, n_init=10, random_state=0).fit(X)
ts = []
for r in range({repeats}):
    t = time.perf_counter(); KMeans(K, n_init=10, random_state=r).fit(X)
    ts.append(time.perf_counter() - t)
print(float(np.median(ts)))
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", default="dim128,dim1024,a20,grid100")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=str(HERE / "results" / "peer_omp.json"))
    args = ap.parse_args(argv)
    rows = []
    print(f"{'set':<10} {'passive s':>10} {'default s':>10} {'default/passive':>16}")
    for name in args.sets.split(","):
        got = {"passive": [], "default": []}
        for _ in range(args.rounds):
            for mode in ("passive", "default"):
                env = dict(os.environ)
                env.pop("OMP_WAIT_POLICY", None)
                if mode == "passive":
                    env["OMP_WAIT_POLICY"] = "PASSIVE"
                code = CHILD.format(here=str(HERE), name=name, repeats=args.repeats)
                out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                     capture_output=True, text=True).stdout.split()
                got[mode].append(float(out[-1]))
        p, d = min(got["passive"]), min(got["default"])
        rows.append({"set": name, "passive_s": p, "default_s": d, "ratio": d / p,
                     "all": got})
        print(f"{name:<10} {p:>10.4f} {d:>10.4f} {d / p:>16.2f}")
    out = {"rows": rows, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count()}
    path = Path(args.json)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    os.replace(tmp, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
