"""Kernel benchmark: seconds per full moments pass, as a ratio to one GEMM ``X @ C.T``.

    python benchmarks/bench_kernels.py            # N=200,000, D=384, K in {64, 256, 1024}
    python benchmarks/bench_kernels.py --quick    # N=20,000, K in {64, 256}
    python benchmarks/bench_kernels.py --compile-only   # cold / warm compile and first fit

Prints a table and writes JSON (default ``benchmarks/results/bench_kernels.json``).
Rows: fastanneal softmax at high T (dense), softmax at low T (sparse), entmax15 at low T,
a hard (Lloyd) pass -- each through ``fastanneal.moments``, which checks its input on every
call --, the two softmax passes as a fit runs them (on rows validated once: "fit's pass"),
the softmax and hard passes pruned by per-row bounds (``_config.PRUNE``: the
bounds of the previous pass, centers moved a little since), the GEMM alone, a
straightforward NumPy soft iteration, and
scikit-learn's Lloyd iteration (``KMeans(init=C, n_init=1, algorithm="lloyd")``, time per
iteration as the difference of max_iter=6 and max_iter=1 fits, divided by 5). Also the
first-call compile time (cold Numba cache), import + first call with a warm cache, and the
peak extra memory of one pass at N=1,000,000, K=1024 (``--memory``), each in a subprocess.
Timing rules of ``docs/benchmarking.md``: BLAS warmed up first, interleaved repeats,
medians, ratios to the GEMM timed in the same run.
"""
import _peer_threads  # noqa: F401,I001 -- first: before scikit-learn loads OpenMP
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def mixture(n, d, k, rng, dtype=np.float32):
    means = rng.standard_normal((k, d)) * 2.0
    lab = rng.integers(0, k, n)
    X = means[lab] + rng.standard_normal((n, d))
    return np.ascontiguousarray(X, dtype=dtype), means


def numpy_soft_iteration(X, C, T):
    G = X @ C.T
    d = (X * X).sum(1)[:, None] - 2 * G + (C * C).sum(1)[None, :]
    z = -d / T
    z -= z.max(1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(1, keepdims=True)
    N = z.sum(0)
    S = z.T @ X
    return S / N[:, None]


def sklearn_lloyd_per_iter(X, C):
    """Seconds per Lloyd iteration: (t(max_iter=6) - t(max_iter=1)) / (extra iterations
    run), which removes the fit's fixed costs (validation, copies). ``C`` should be a poor
    start (random rows) so that Lloyd does not converge within 6 iterations."""
    from sklearn.cluster import KMeans
    import warnings
    times, iters = {}, {}
    for it in (1, 6):
        km = KMeans(n_clusters=C.shape[0], init=C, n_init=1, max_iter=it, tol=0.0,
                    algorithm="lloyd")
        time.sleep(REST_S)              # (as before every timed call: see REST_S)
        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            km.fit(X)
        times[it] = time.perf_counter() - t
        iters[it] = km.n_iter_
    extra = iters[6] - iters[1]
    if extra > 0:
        return (times[6] - times[1]) / extra
    return times[6] / max(iters[6], 1)


#: Seconds of rest before each timed call: OpenBLAS's threads spin for ~0.1 s after a
#: threaded product (the reference GEMM's), taking a core from whatever runs next -- the
#: dense pass, timed right after the GEMM, measured ~50 ms (0.7 of a GEMM at K = 64) slower
#: until the twenty-eighth session.
REST_S = 0.3


def timed(fn, repeats):
    out = []
    for _ in range(repeats):
        time.sleep(REST_S)
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


#: warm runs per measurement (the run with the median total is reported)
WARM_RUNS = 5


def _env(cache, pyc, extra_path=None):
    """A fresh process's environment: its own Numba cache; with ``pyc`` Python's bytecode
    cache on (in a private folder, as a pip install has it: this machine sets
    ``PYTHONDONTWRITEBYTECODE=1``, which recompiles fastanneal's sources at every start,
    ~20 ms), else off."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(Path(cache, "numba")))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if pyc:
        env["PYTHONPYCACHEPREFIX"] = str(Path(cache, "pyc"))
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    if extra_path:
        env["PYTHONPATH"] = extra_path + os.pathsep + os.environ.get("PYTHONPATH", "")
    return env


def _runs(code, env, n):
    return [[float(v) for v in subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True,
        check=True).stdout.split()] for _ in range(n)]


def _median_run(runs):
    return sorted(runs, key=sum)[len(runs) // 2]


def _cold_then_warm(code, extra_path=None):
    """Run ``code`` (which prints two numbers) in fresh processes sharing a new Numba cache:
    the first compiles (cold), then :data:`WARM_RUNS` load the cache (warm; the median
    run), with Python's bytecode cache on; and as many warm runs without it (``"no_pyc"``,
    as this machine's environment has it)."""
    with tempfile.TemporaryDirectory() as cache:
        env = _env(cache, True, extra_path)
        cold = _runs(code, env, 1)[0]
        warm = _median_run(_runs(code, env, WARM_RUNS))
        nopyc = _median_run(_runs(code, _env(cache, False, extra_path), WARM_RUNS))
    return cold, warm, nopyc


def subprocess_compile_times():
    """Cold-cache compile of all kernels for one dtype, and warm import + first call."""
    cold, warm, nopyc = _cold_then_warm(
        "import time; t=time.perf_counter(); import numpy as np; import fastanneal as fa; "
        "ti=time.perf_counter()-t; X=np.random.rand(300,8).astype(np.float32); "
        "C=X[:5].copy(); t=time.perf_counter(); "
        "[fa.moments(X,C,0.5,responsibilities=r) for r in ('softmax','entmax15','hard')]; "
        "fa.assign(X,C); fa.responsibilities(X,C,0.5); fa.pairwise_distances(X,C); "
        "print(ti, time.perf_counter()-t)")
    return {"cold_import_s": cold[0], "cold_first_calls_s": cold[1],
            "warm_import_s": warm[0], "warm_first_calls_s": warm[1],
            "warm_import_plus_first_call_s": warm[0] + warm[1],
            "warm_import_plus_first_call_no_pyc_s": nopyc[0] + nopyc[1]}


_FLOOR_MODULE = """
import numpy as np
from numba import njit


@njit(cache=True)
def total(x):
    return x.sum()
"""


def subprocess_numba_floor():
    """Numba's own floor of a warm start, beside fastanneal's: ``import numba`` and the first
    call of one trivial cached ``@njit`` function, in a fresh process whose cache already
    holds it (Numba's start-up: its target's registries and the BLAS it binds, which imports
    SciPy's linear algebra)."""
    with tempfile.TemporaryDirectory() as d:
        Path(d, "_floor_mod.py").write_text(_FLOOR_MODULE)
        code = ("import time; t=time.perf_counter(); import numpy as np; import numba; "
                "import _floor_mod; ti=time.perf_counter()-t; t=time.perf_counter(); "
                "_floor_mod.total(np.ones(3)); print(ti, time.perf_counter()-t)")
        _, warm, nopyc = _cold_then_warm(code, extra_path=d)
    return {"numba_floor_import_s": warm[0], "numba_floor_first_call_s": warm[1],
            "numba_floor_import_plus_first_call_s": warm[0] + warm[1],
            "numba_floor_import_plus_first_call_no_pyc_s": nopyc[0] + nopyc[1]}


def subprocess_fit_compile_times():
    """Cold-cache and warm-cache first default fit (``AnnealedKMeans(5).fit`` on 500 x 8
    float32): what a new user's first fit waits for, import of the estimator included."""
    cold, warm, _ = _cold_then_warm(
        "import time; t=time.perf_counter(); import numpy as np; "
        "from fastanneal import AnnealedKMeans; ti=time.perf_counter()-t; "
        "X=np.random.default_rng(0).standard_normal((500,8)).astype(np.float32); "
        "t=time.perf_counter(); AnnealedKMeans(5, random_state=0).fit(X); "
        "print(ti, time.perf_counter()-t)")
    return {"fit_cold_import_s": cold[0], "fit_cold_first_fit_s": cold[1],
            "fit_warm_import_s": warm[0], "fit_warm_first_fit_s": warm[1]}


def subprocess_memory(n, k, d=384):
    """Peak RSS growth of one moments pass beyond X itself (MB), in a fresh process."""
    code = f"""
import threading, time, numpy as np, psutil, fastanneal as fa
proc = psutil.Process()
rng = np.random.default_rng(0)
X = np.empty(({n}, {d}), dtype=np.float32)
for b in range(0, {n}, 50_000):            # chunkwise: no float64 temporary of X's size
    X[b:b + 50_000] = rng.standard_normal((min(50_000, {n} - b), {d}), dtype=np.float32)
C = X[:{k}].copy()
fa.moments(X[:2000], C, 1.0)          # compile / warm
import gc; gc.collect()
base = proc.memory_info().rss
peak = [base]
stop = threading.Event()
def sample():                          # current RSS every 5 ms while the pass runs
    while not stop.is_set():
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.005)
th = threading.Thread(target=sample); th.start()
m = fa.moments(X, C, 10.0)
stop.set(); th.join()
print(base / 2**20, peak[0] / 2**20, X.nbytes / 2**20)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    base, peak, xmb = map(float, out)
    return {"n": n, "k": k, "x_mb": xmb, "rss_before_mb": base, "rss_peak_mb": peak,
            "extra_mb": peak - base, "extra_fraction_of_X": (peak - base) / xmb}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--ks", type=str, default=None, help="comma-separated K values")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory", action="store_true", help="also measure N=1e6, K=1024 memory")
    ap.add_argument("--no-sklearn", action="store_true")
    ap.add_argument("--compile-only", action="store_true",
                    help="only the compile / first-call times (JSON: results/bench_compile.json)")
    ap.add_argument("--json", default=str(HERE / "results" / "bench_kernels.json"))
    args = ap.parse_args(argv)
    n = args.n or (20_000 if args.quick else 200_000)
    ks = [int(k) for k in args.ks.split(",")] if args.ks else ([64, 256] if args.quick
                                                               else [64, 256, 1024])
    d = 384
    compile_info = subprocess_compile_times()
    compile_info.update(subprocess_fit_compile_times())
    compile_info.update(subprocess_numba_floor())
    if args.compile_only:
        print("compile / import (s):", json.dumps(compile_info))
        path = Path(args.json if args.json != ap.get_default("json")
                    else HERE / "results" / "bench_compile.json")
        out = {"compile": compile_info, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "cpus": os.cpu_count(), "numba": __import__("numba").__version__}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        os.replace(tmp, path)
        print(f"wrote {path}")
        return out
    import fastanneal as fa
    from threadpoolctl import threadpool_info
    rng = np.random.default_rng(0)
    # BLAS warm-up: one GEMM with >= 384 output columns
    W = rng.standard_normal((4096, 384), dtype=np.float32)
    _ = W @ W.T
    rows = []
    for k in ks:
        X, means = mixture(n, d, k, rng)
        C = np.ascontiguousarray(means + 0.1 * rng.standard_normal(means.shape), np.float32)
        C_lloyd = np.ascontiguousarray(X[rng.choice(n, k, replace=False)])
        dist = fa.pairwise_distances(X[:2000], C)
        scale = float(np.median(dist))
        srt = np.sort(dist, axis=1)
        margin = float(np.median(srt[:, 1] - srt[:, 0]))
        T_high = scale            # every responsibility non-zero
        T_low = 0.02 * margin     # nearly one-hot
        fa.moments(X[:1000], C, T_high)          # compile / warm
        from fastanneal._moments import _prepare, compute_moments
        Xv, Cv = _prepare(X, C, "euclidean")[:2]     # (no shift for this data: X itself)
        ones = np.ones(n)
        fa.moments(X[:1000], C, T_low, responsibilities="entmax15")
        fa.moments(X[:1000], C, T_low, responsibilities="hard")
        cases = {
            "gemm X@C.T": lambda: X @ C.T,
            "fastanneal softmax high T (dense)": lambda: fa.moments(X, C, T_high,
                                                                    hard_sums=False),
            "fastanneal softmax low T (sparse)": lambda: fa.moments(X, C, T_low,
                                                                   hard_sums=False),
            "fastanneal entmax15 low T": lambda: fa.moments(X, C, T_low,
                                                           responsibilities="entmax15",
                                                           hard_sums=False),
            "fastanneal hard (Lloyd pass)": lambda: fa.moments(X, C, T_low,
                                                              responsibilities="hard"),
            # the same passes as a fit runs them: on rows it validated once (fa.moments
            # checks its input on every call: finite, range, distance from the origin --
            # 0.1-0.8 of a GEMM here, more at small K)
            "fit's pass: softmax high T (dense)": lambda: compute_moments(
                Xv, ones, Cv, T_high, 0, 0, None, hard_sums=False),
            "fit's pass: softmax low T (sparse)": lambda: compute_moments(
                Xv, ones, Cv, T_low, 0, 0, None, hard_sums=False),
            "numpy soft iteration": lambda: numpy_soft_iteration(X, C, T_high),
        }
        # Pruned passes as a fit sees them: per-row bounds from the previous pass, centers
        # that moved a little since (alternating between C and C + a small step).
        from fastanneal._sources import InMemorySource
        src = InMemorySource(X, np.ones(n), 0)
        step = 0.01 * float(np.sqrt(margin)) / np.sqrt(d)
        C2 = np.ascontiguousarray(C + step * rng.standard_normal(C.shape), np.float32)
        flip = {"i": 0}

        def pruned(T, resp):
            flip["i"] ^= 1
            src.moments(C2 if flip["i"] else C, T, resp)
        pruned(T_low, 0)
        pruned(T_low, 0)
        cases["fastanneal softmax low T, pruned"] = lambda: pruned(T_low, 0)
        cases["fastanneal hard, pruned"] = lambda: pruned(0.0, 2)
        res = {name: [] for name in cases}
        res["sklearn Lloyd iteration"] = []
        nnz = {"high": fa.moments(X[:5000], C, T_high).nnz / (5000 * k),
               "low": fa.moments(X[:5000], C, T_low).nnz / (5000 * k)}
        for _ in range(args.repeats):          # interleaved repeats
            for name, fn in cases.items():
                res[name] += timed(fn, 1)
            if not args.no_sklearn:
                res["sklearn Lloyd iteration"].append(sklearn_lloyd_per_iter(X, C_lloyd))
        pruned_share = src._bounds.pruned / n
        gemm = float(np.median(res["gemm X@C.T"]))
        for name, ts in res.items():
            if not ts:
                continue
            med = float(np.median(ts))
            rows.append({"K": k, "case": name, "seconds": med, "ratio_to_gemm": med / gemm,
                         "all_seconds": ts})
        rows.append({"K": k, "case": "density (nnz / (N K)) high/low T",
                     "seconds": float("nan"), "ratio_to_gemm": float("nan"),
                     "density_high": nnz["high"], "density_low": nnz["low"],
                     "pruned_share": pruned_share})
        del X
    memory = subprocess_memory(1_000_000, 1024) if args.memory else None
    print(f"\nfastanneal kernel benchmark: N={n}, D={d}, float32, "
          f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}")
    print(f"{'K':>5}  {'case':<40} {'seconds':>9} {'x GEMM':>8}")
    for r in rows:
        if r["case"].startswith("density"):
            print(f"{r['K']:>5}  {'  density high T / low T':<40} "
                  f"{r['density_high']:>9.3f} {r['density_low']:>8.4f}")
            print(f"{r['K']:>5}  {'  rows pruned (last pruned pass)':<40} "
                  f"{r['pruned_share']:>9.3f}")
        else:
            print(f"{r['K']:>5}  {r['case']:<40} {r['seconds']:>9.4f} {r['ratio_to_gemm']:>8.2f}")
    print("\ncompile / import (s):", json.dumps(compile_info))
    if memory:
        print("memory N=1e6 K=1024:", json.dumps(memory))
    out = {"n": n, "d": d, "ks": ks, "rows": rows, "compile": compile_info, "memory": memory,
           "machine": {"cpus": os.cpu_count(), "processor": platform.processor(),
                       "python": sys.version.split()[0], "numpy": np.__version__,
                       "numba": __import__("numba").__version__,
                       "blas": [(i.get("internal_api"), i.get("version"),
                                 i.get("architecture")) for i in threadpool_info()]},
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    os.replace(tmp, path)
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
