"""Dask benchmark: distributed full-batch iterations and out-of-core mini-batch annealing.

    python benchmarks/bench_dask.py            # (a) N=1,000,000  (b) N=2,000,000 and 4,000,000
    python benchmarks/bench_dask.py --quick    # (a) N=60,000     (b) N=100,000 and 200,000

(a) Seconds per full-batch moments pass (softmax, the pass the annealing engine runs every
    iteration), float32, D=384, K=256: in memory (``InMemorySource``), on a LocalCluster of
    2 worker processes x 1 thread (chunks generated and persisted on the workers), and on
    the embedded threaded LocalCluster that ``AnnealedKMeans(backend="dask")`` starts. Each
    as a ratio to the in-memory pass and to one GEMM ``X @ C.T`` timed in the same run
    (``docs/benchmarking.md``: BLAS warmed, interleaved repeats, medians). dask-ml's
    ``KMeans`` per iteration as a peer only if it is importable (it is not installed here).
(b) Mini-batch annealing (:class:`fastanneal.MiniBatchAnnealedKMeans`, embedded cluster,
    labels written as Parquet in the final pass) out of core on a Parquet dataset of N and
    2N rows (labelled Gaussian mixture, float32, D=384, generated chunk by chunk into a
    temporary folder; one row group = one chunk): wall time, rows read per second (all
    passes), peak resident memory of the whole process tree (psutil, sampled every 20 ms in
    a thread; each fit in a fresh subprocess so that the baseline is only the imports) as a
    fraction of the dataset size, J per row (and J of the true means) and ARI against the
    true labels. Quality gap against full batch: mini-batch vs ``AnnealedKMeans`` on an
    in-memory subset of ``--fb-n`` rows, mean over ``--seeds`` seeds (seeding luck dominates
    single runs): J ratio, ARI between the two partitions and against the truth.

(c) Cluster scale (``--chunk-scaling``): seconds per moments pass against the number of
    chunks (10 -> 2,000) and of worker processes (1 -> 8, one thread each), the data
    persisted on the workers between passes (``DaskSource``). Two datasets per point: the
    real one (``--cs-n`` rows, ``--cs-d`` / ``--cs-k``) cut into that many chunks, and an *empty*
    one of as many one-row chunks, whose pass is all scheduling (task submission, the
    scheduler's bookkeeping, the tree merge of the records, the result's round trip). The
    per-chunk scheduling cost is the slope of the empty pass time against the chunks; the
    compute is what the real pass adds. From these, a model of a 100-worker job (printed).
    On this 2-core machine more than two worker processes share the cores: the compute
    column then measures contention, not scaling; the scheduling slope is what transfers.

Prints a table and writes JSON (default ``benchmarks/results/bench_dask.json``;
``--chunk-scaling`` alone: ``benchmarks/results/bench_dask_chunks.json``).
"""
import _peer_threads  # noqa: F401,I001 -- first: before scikit-learn loads OpenMP
import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))


# ----------------------------------------------------------------------------- data
def mixture_means(k, d, seed, scale=0.5):
    return np.random.default_rng(seed).standard_normal((k, d)) * scale


def mixture_block(means, n, seed, dtype=np.float32):
    """``n`` rows of the mixture (unit noise); deterministic in ``seed``."""
    g = np.random.default_rng(seed)
    y = g.integers(0, means.shape[0], n)
    X = means[y] + g.standard_normal((n, means.shape[1]))
    return np.ascontiguousarray(X, dtype=dtype), y


def dask_mixture(means, n, chunk, seed, dtype=np.float32):
    """A Dask array of the mixture whose chunks are generated where they are computed."""
    import dask
    import dask.array as da
    sizes = [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
    blocks = [da.from_delayed(dask.delayed(_gen)(means, i, s, seed, dtype),
                              shape=(s, means.shape[1]), dtype=dtype)
              for i, s in enumerate(sizes)]
    return da.concatenate(blocks), sizes


def _gen(means, i, s, seed, dtype):
    return mixture_block(means, s, seed + i, dtype)[0]


def write_parquet_dataset(folder, means, n, rows_per_file, row_group, seed):
    """Write ``n`` labelled rows, one file per ``rows_per_file``, chunk by chunk."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    os.makedirs(folder, exist_ok=True)
    files = []
    D = means.shape[1]
    for j, r0 in enumerate(range(0, n, rows_per_file)):
        m = min(rows_per_file, n - r0)
        X, y = mixture_block(means, m, seed + j)
        emb = pa.FixedSizeListArray.from_arrays(pa.array(X.reshape(-1)), D)
        t = pa.table({"embedding": emb, "label": pa.array(y.astype(np.int32)),
                      "row_id": pa.array(np.arange(r0, r0 + m, dtype=np.int64))})
        path = os.path.join(folder, f"part-{j:05d}.parquet")
        pq.write_table(t, path, row_group_size=row_group, compression="none")
        files.append(path)
        del X, y, emb, t
    return files


def read_labels(files):
    import pyarrow.parquet as pq
    return np.concatenate([pq.read_table(f, columns=["label"]).column(0).to_numpy()
                           for f in files])


# ----------------------------------------------------------------------------- memory
class TreeMemorySampler:
    """Peak RSS of this process and all its descendants, sampled in a thread."""

    def __init__(self, interval=0.02):
        import psutil
        self.proc = psutil.Process()
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._t = None

    def current(self):
        total = 0
        procs = [self.proc]
        try:
            procs += self.proc.children(recursive=True)
        except Exception:
            pass
        for p in procs:
            try:
                total += p.memory_info().rss
            except Exception:
                pass
        return total

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.current())
            self._stop.wait(self.interval)

    def __enter__(self):
        self.baseline = self.current()
        self.peak = self.baseline
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.current())


def warm_kernels():
    """Compile (or load from the Numba cache) every kernel a fit uses, outside the timings:
    a kernel source edited since the last run recompiles for seconds."""
    from fastanneal._moments import assign, compute_moments
    from fastanneal._kernels import cluster_cov_matvec_kernel
    for dt in (np.float32, np.float64):
        X = np.random.default_rng(0).standard_normal((64, 8)).astype(dt)
        w = np.ones(64)
        for resp in (0, 1, 2):
            compute_moments(X, w, X[:3], 1.0, 0, resp, None, True)
        compute_moments(X, w, X[:3], 1.0, 0, 0, np.zeros(3), False)
        assign(X, X[:3], 0, _prepared=True)
        cluster_cov_matvec_kernel(X, w, np.zeros(64, dtype=np.int64), np.zeros((1, 8)),
                                  np.ones((1, 8)), 1)


# ----------------------------------------------------------------------------- (a)
def median_time(fn, repeats):
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out), out


def bench_full_batch(args):
    import dask.array as da
    from distributed import Client, LocalCluster

    from fastanneal._moments import blas_single_thread
    from fastanneal._sources import InMemorySource
    from fastanneal.dask import DaskSource, resolve_client
    from fastanneal.dask._cluster import ClientHandle

    N, D, K = args.n, args.d, args.k
    warm_kernels()
    means = mixture_means(K, D, 1)
    chunk = args.chunk
    # BLAS warm-up (a GEMM with >= 384 output columns)
    w = np.random.default_rng(0).standard_normal((2000, 512)).astype(np.float32)
    with blas_single_thread():
        w @ w.T
    res = {"n": N, "d": D, "k": K, "chunk_rows": chunk, "repeats": args.repeats}
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                           dashboard_address=None, scheduler_kwargs={"dashboard_address": ":0"})
    client = Client(cluster, set_as_default=False)
    try:
        Xd, sizes = dask_mixture(means, N, chunk, seed=100)
        t = time.perf_counter()
        src_p = DaskSource(Xd, None, 0, ClientHandle(client))
        res["persist_s_processes"] = time.perf_counter() - t
        X = np.concatenate([_gen(means, i, s, 100, np.float32) for i, s in enumerate(sizes)])
        mem = InMemorySource(X, np.ones(N), 0)
        C = X[np.random.default_rng(2).choice(N, K, replace=False)].astype(np.float64)
        mh = mem.moments(C, 1.0, 2, None, hard_sums=False)
        T = 0.05 * mh.hard_distortion / N            # a temperature of the annealing range
        res["temperature"] = T
        Ct = np.ascontiguousarray(C, dtype=np.float32)

        def gemm():
            with blas_single_thread():
                X @ Ct.T
        # embedded (threaded) cluster, as AnnealedKMeans(backend="dask") starts it
        h = resolve_client(None) if args.embedded else None
        src_e = None
        if h is not None:
            Xe, _ = dask_mixture(means, N, chunk, seed=100)
            src_e = DaskSource(Xe, None, 0, h)
        runs = {"in_memory": lambda: mem.moments(C, T, 0, None, False),
                "dask_processes": lambda: src_p.moments(C, T, 0, None, False),
                "gemm": gemm}
        if src_e is not None:
            runs["dask_embedded"] = lambda: src_e.moments(C, T, 0, None, False)
        for f in runs.values():        # warm-up (compiles, caches)
            f()
        a = mem.moments(C, T, 0, None, False)
        b = src_p.moments(C, T, 0, None, False)
        res["rel_diff_S"] = float(np.linalg.norm(a.S - b.S) / np.linalg.norm(a.S))
        times = {k: [] for k in runs}
        for _ in range(args.repeats):          # interleaved
            for k, f in runs.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        res["seconds"] = med
        res["all_seconds"] = times
        res["ratio_to_in_memory"] = {k: med[k] / med["in_memory"] for k in med}
        res["ratio_to_gemm"] = {k: med[k] / med["gemm"] for k in med}
        best = {k: min(v) for k, v in times.items()}
        res["best_seconds"] = best
        res["best_ratio_to_in_memory"] = {k: best[k] / best["in_memory"] for k in best}
        try:
            import dask_ml.cluster  # noqa: F401
            res["dask_ml"] = dask_ml_per_iteration(Xd, K, client)
        except ImportError:
            res["dask_ml"] = "not installed (not benchmarked)"
        if src_e is not None:
            src_e.close()
        src_p.close()
    finally:
        client.close()
        cluster.close()
    return res


def bench_chunk_scaling(args):
    """(c): pass time against chunks and workers, real data and one-row (empty) chunks."""
    from distributed import Client, LocalCluster

    from fastanneal._moments import blas_single_thread
    from fastanneal._sources import InMemorySource
    from fastanneal.dask import DaskSource
    from fastanneal.dask._cluster import ClientHandle
    import numba

    N, D, K = args.cs_n, args.cs_d, args.cs_k
    if args.no_fuse:
        import fastanneal.dask._source as dsrc
        dsrc.FUSE_GROUPS_PER_THREAD = 10 ** 12
    warm_kernels()
    means = mixture_means(K, D, 3)
    C = means.astype(np.float64)
    X = mixture_block(means, N, 7)[0]
    mem = InMemorySource(X, np.ones(N), 0)
    T = 0.05 * mem.moments(C, 1.0, 2, None, hard_sums=False).hard_distortion / N
    nth = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        with blas_single_thread():
            mem.moments(C, T, 0, None, False)
            t1, _ = median_time(lambda: mem.moments(C, T, 0, None, False), args.repeats)
    finally:
        numba.set_num_threads(nth)
    res = {"n": N, "d": D, "k": K, "temperature": T, "repeats": args.repeats,
           "one_thread_pass_s": t1, "one_thread_s_per_row": t1 / N, "points": []}
    print(f"one in-process pass on one thread: {t1:.3f} s ({1e9 * t1 / N:.0f} ns per row)",
          flush=True)
    print(f"{'workers':>8}{'chunks':>8}{'rows/chunk':>11}{'pass s':>9}{'empty s':>9}"
          f"{'compute s':>10}", flush=True)
    for W in args.cs_workers:
        cluster = LocalCluster(n_workers=W, threads_per_worker=1, processes=True,
                               dashboard_address=None,
                               scheduler_kwargs={"dashboard_address": ":0"})
        client = Client(cluster, set_as_default=False)
        try:
            for c in args.cs_chunks:
                chunk = -(-N // c)
                Xd, sizes = dask_mixture(means, N, chunk, seed=7)
                real = DaskSource(Xd, None, 0, ClientHandle(client))
                fused = real._fused is not None
                Xe, _ = dask_mixture(means, len(sizes), 1, seed=9)
                empty = DaskSource(Xe, None, 0, ClientHandle(client))
                try:
                    for src in (real, empty):          # warm-up: compiles, caches
                        src.moments(C, T, 0, None, False)
                    tr, er = [], []
                    for _ in range(args.repeats):      # interleaved
                        t = time.perf_counter()
                        real.moments(C, T, 0, None, False)
                        tr.append(time.perf_counter() - t)
                        t = time.perf_counter()
                        empty.moments(C, T, 0, None, False)
                        er.append(time.perf_counter() - t)
                finally:
                    real.close()
                    empty.close()
                pt = {"workers": W, "chunks": len(sizes), "rows_per_chunk": chunk,
                      "fused": fused, "no_fuse": args.no_fuse,
                      "pass_s": statistics.median(tr), "empty_pass_s": statistics.median(er),
                      "all_pass_s": tr, "all_empty_s": er}
                pt["compute_s"] = pt["pass_s"] - pt["empty_pass_s"]
                res["points"].append(pt)
                print(f"{W:>8}{len(sizes):>8}{chunk:>11,}{pt['pass_s']:>9.3f}"
                      f"{pt['empty_pass_s']:>9.3f}{pt['compute_s']:>10.3f}", flush=True)
        finally:
            client.close()
            cluster.close()
    # the scheduling cost per chunk: least-squares slope of the empty pass against chunks
    fits = {}
    for W in args.cs_workers:
        pts = [p for p in res["points"] if p["workers"] == W]
        if len(pts) >= 2:
            x = np.array([p["chunks"] for p in pts], dtype=float)
            y = np.array([p["empty_pass_s"] for p in pts])
            b, a = np.polyfit(x, y, 1)
            fits[W] = {"per_chunk_ms": 1e3 * b, "fixed_ms": 1e3 * a}
    res["scheduling_fit"] = fits
    per_chunk = max(f["per_chunk_ms"] for f in fits.values()) if fits else float("nan")
    fixed = max(f["fixed_ms"] for f in fits.values()) if fits else float("nan")
    res["model"] = model = chunk_model(per_chunk, fixed, t1 / N)
    for W, f in fits.items():
        print(f"{W} worker(s): {f['per_chunk_ms']:.2f} ms per chunk per pass + "
              f"{f['fixed_ms']:.0f} ms per pass (empty chunks)")
    print("model of a 100-worker job (one thread each, compute per row as measured here, the "
          f"worst scheduling slope {per_chunk:.2f} ms per chunk):")
    for m in model:
        print(f"  {m['rows']:>14,} rows in {m['chunks']:>7,} chunks: compute "
              f"{m['compute_s']:8.1f} s + scheduling {m['scheduling_s']:6.1f} s per pass "
              f"({100 * m['scheduling_share']:.0f} % scheduling"
              f"{'' if m['fuses'] else '; this job would not fuse'})")
    return res


def chunk_model(per_chunk_ms, fixed_ms, s_per_row, workers=100):
    """Seconds per pass of a ``workers``-worker job: every worker computes its share of the
    rows (``s_per_row`` on one thread, perfectly balanced); the one scheduler handles every
    chunk in turn (``per_chunk_ms``, serial: it does not shrink with more workers).
    ``fuses``: whether a pass of that job would fuse its first tree level (``DaskSource``:
    at least ``FUSE_GROUPS_PER_THREAD`` groups of ``SPLIT_EVERY`` chunks per thread) -- a
    slope measured with fusing applies only to those rows."""
    from fastanneal.dask._source import FUSE_GROUPS_PER_THREAD, SPLIT_EVERY
    out = []
    for rows, chunk_rows in ((10 ** 8, 10 ** 5), (10 ** 9, 10 ** 5), (10 ** 9, 10 ** 6),
                             (10 ** 10, 10 ** 6)):
        chunks = rows // chunk_rows
        compute = rows * s_per_row / workers
        sched = chunks * per_chunk_ms / 1e3 + fixed_ms / 1e3
        out.append({"rows": rows, "chunk_rows": chunk_rows, "chunks": chunks,
                    "workers": workers, "compute_s": compute, "scheduling_s": sched,
                    "fuses": -(-chunks // SPLIT_EVERY) >= FUSE_GROUPS_PER_THREAD * workers,
                    "scheduling_share": sched / (compute + sched)})
    return out


def dask_ml_per_iteration(Xd, K, client):  # pragma: no cover - dask-ml not installed here
    from dask_ml.cluster import KMeans
    out = {}
    with client.as_current():
        for it in (1, 4):
            km = KMeans(n_clusters=K, init="random", max_iter=it, tol=0.0, random_state=0)
            t = time.perf_counter()
            km.fit(Xd)
            out[it] = time.perf_counter() - t
    return (out[4] - out[1]) / 3.0


# ----------------------------------------------------------------------------- (b)
def minibatch_child(spec_file):
    """Run one out-of-core mini-batch fit in this (fresh) process and write its figures:
    the memory sampler then sees only the fit (imports included in the baseline)."""
    with open(spec_file) as f:
        spec = json.load(f)
    from fastanneal import MiniBatchAnnealedKMeans as MiniBatchAnnealer
    from fastanneal.dask import read_parquet_embeddings
    warm_kernels()
    data = read_parquet_embeddings(spec["files"], id="row_id")
    with TreeMemorySampler() as mem:
        t = time.perf_counter()
        mb = MiniBatchAnnealer(spec["k"], random_state=spec["seed"], n_steps=spec["steps"],
                               polish_passes=1).fit(data, labels_path=spec["labels"])
        wall = time.perf_counter() - t
    out = {"wall_s": wall, "peak_rss_bytes": mem.peak, "baseline_rss_bytes": mem.baseline,
           "inertia": mb.inertia_, "rows_seen": mb.rows_seen_, "passes": mb.n_passes_,
           "n_batches": mb.n_batches_, "batch_chunks": mb.batch_chunks_,
           "temperature_start": mb.temperature_start_}
    with open(spec["out"], "w") as f:
        json.dump(out, f)


def bench_minibatch(args, tmp):
    import subprocess

    import pyarrow.parquet as pq
    from sklearn.metrics import adjusted_rand_score as ari

    import fastanneal as fa
    from fastanneal import MiniBatchAnnealedKMeans as MiniBatchAnnealer

    N, D, K = args.mb_n, args.d, args.k
    warm_kernels()
    means = mixture_means(K, D, 7)
    rows_per_file = args.rows_per_file
    t = time.perf_counter()
    files = write_parquet_dataset(os.path.join(tmp, "data"), means, 2 * N, rows_per_file,
                                  args.row_group, seed=1000)
    gen_s = time.perf_counter() - t
    n_files_N = -(-N // rows_per_file)
    out = {"n": N, "d": D, "k": K, "row_group": args.row_group, "generate_s": gen_s,
           "steps": args.mb_steps, "sizes": []}
    bytes_per_row = D * 4
    for n_files in (n_files_N, len(files)):
        fl = files[:n_files]
        y = read_labels(fl)
        n = y.shape[0]
        labels_dir = os.path.join(tmp, f"labels-{n}")
        spec = {"files": fl, "k": K, "seed": 0, "steps": args.mb_steps, "labels": labels_dir,
                "out": os.path.join(tmp, f"mb-{n}.json")}
        with open(os.path.join(tmp, "spec.json"), "w") as f:
            json.dump(spec, f)
        subprocess.run([sys.executable, __file__, "--child-minibatch",
                        os.path.join(tmp, "spec.json")], check=True)
        with open(spec["out"]) as f:
            r = json.load(f)
        lab = pq.read_table(labels_dir, columns=["row", "label"])
        n_written = lab.num_rows
        lab = lab.sort_by("row").column("label").to_numpy()
        rows_read = r["rows_seen"] + r["passes"] * n
        j_true = _inertia_stream(fl, means)
        rec = {"rows": n, "dataset_bytes": n * bytes_per_row, "wall_s": r["wall_s"],
               "rows_read": int(rows_read), "rows_per_s": rows_read / r["wall_s"],
               "n_batches": r["n_batches"], "batch_chunks": r["batch_chunks"],
               "passes": r["passes"], "labels_written": int(n_written),
               "peak_rss_bytes": r["peak_rss_bytes"],
               "baseline_rss_bytes": r["baseline_rss_bytes"],
               "peak_fraction_of_dataset": r["peak_rss_bytes"] / (n * bytes_per_row),
               "peak_increase_fraction_of_dataset": (r["peak_rss_bytes"]
                                                     - r["baseline_rss_bytes"]) / (
                   n * bytes_per_row),
               "J_per_row": r["inertia"] / n, "J_true_means_per_row": j_true / n,
               "ari_vs_truth": float(ari(y, lab))}
        out["sizes"].append(rec)
        shutil.rmtree(labels_dir, ignore_errors=True)
        print(f"  mini-batch N={n:,}: {rec['wall_s']:.1f} s, {rec['rows_per_s']:.3g} rows/s, "
              f"peak RSS {rec['peak_rss_bytes'] / 2**20:.0f} MiB "
              f"({100 * rec['peak_fraction_of_dataset']:.1f}% of data), "
              f"ARI {rec['ari_vs_truth']:.4f}", flush=True)
    # quality gap against full batch on an in-memory subset, over several seeds
    import dask.array as da
    nf = min(args.fb_n, N)
    Xf, yf = mixture_block(means, nf, seed=5000)
    runs = []
    for seed in range(args.seeds):
        t = time.perf_counter()
        full = fa.AnnealedKMeans(K, random_state=seed).fit(Xf)
        fb_s = time.perf_counter() - t
        t = time.perf_counter()
        mb = MiniBatchAnnealer(K, random_state=seed, n_steps=args.mb_steps,
                               polish_passes=1).fit(
            da.from_array(Xf, chunks=(args.row_group, -1)))
        mbs = time.perf_counter() - t
        lm = mb.predict(Xf)
        runs.append({"seed": seed, "full_batch_s": fb_s, "minibatch_s": mbs,
                     "J_full": full.inertia_, "J_minibatch": mb.inertia_,
                     "J_ratio": mb.inertia_ / full.inertia_,
                     "ari_minibatch_vs_full": float(ari(full.labels_, lm)),
                     "ari_full_vs_truth": float(ari(yf, full.labels_)),
                     "ari_minibatch_vs_truth": float(ari(yf, lm))})
        print(f"  seed {seed}: J mini/full {runs[-1]['J_ratio']:.4f}, ARI vs truth full "
              f"{runs[-1]['ari_full_vs_truth']:.4f} mini {runs[-1]['ari_minibatch_vs_truth']:.4f}"
              f" ({fb_s:.1f} s / {mbs:.1f} s)", flush=True)
    summ = {k: float(np.mean([r[k] for r in runs]))
            for k in ("J_ratio", "ari_minibatch_vs_full", "ari_full_vs_truth",
                      "ari_minibatch_vs_truth", "full_batch_s", "minibatch_s")}
    out["quality_vs_full_batch"] = {"rows": nf, "seeds": args.seeds, "mean": summ,
                                    "runs": runs}
    return out


def _inertia_stream(files, means):
    import pyarrow.parquet as pq

    from fastanneal._moments import assign
    J = 0.0
    C = means.astype(np.float32)
    for f in files:
        pf = pq.ParquetFile(f)
        for rg in range(pf.num_row_groups):
            t = pf.read_row_group(rg, columns=["embedding"])
            col = t.column(0).combine_chunks()
            X = col.flatten().to_numpy().reshape(len(col), -1)
            J += float(assign(np.ascontiguousarray(X), C)[1].sum())
    return J


# ----------------------------------------------------------------------------- main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    p.add_argument("--n", type=int, help="rows of (a); default 1,000,000 (quick 60,000)")
    p.add_argument("--d", type=int, default=384)
    p.add_argument("--k", type=int, help="clusters; default 256 (quick 32)")
    p.add_argument("--chunk", type=int, help="rows per chunk in (a); default 62,500")
    p.add_argument("--repeats", type=int, help="timed passes per backend in (a); default 7")
    p.add_argument("--mb-n", type=int, help="N of (b) (datasets N and 2N); default 2,000,000")
    p.add_argument("--row-group", type=int, help="Parquet row group (= chunk) rows in (b)")
    p.add_argument("--rows-per-file", type=int, help="rows per Parquet file in (b)")
    p.add_argument("--mb-steps", type=int, default=20, help="temperatures in (b)")
    p.add_argument("--fb-n", type=int, help="rows of the full-batch comparison in (b)")
    p.add_argument("--skip-a", action="store_true")
    p.add_argument("--skip-b", action="store_true")
    p.add_argument("--no-embedded", dest="embedded", action="store_false")
    p.add_argument("--tmp", help="folder for the generated Parquet data (default: a temp dir)")
    p.add_argument("--seeds", type=int, help="seeds of the full-batch comparison; default 3")
    p.add_argument("--chunk-scaling", action="store_true",
                   help="run (c) only: pass time against chunks and workers")
    p.add_argument("--cs-n", type=int, default=200_000, help="rows of (c)")
    p.add_argument("--cs-d", type=int, default=128, help="dimensions of (c)")
    p.add_argument("--cs-k", type=int, default=64, help="clusters of (c)")
    p.add_argument("--cs-chunks", default="10,50,200,500,1000,2000",
                   help="chunk counts of (c), comma-separated")
    p.add_argument("--no-fuse", action="store_true",
                   help="(c): one task per chunk and pass, as before the twenty-seventh "
                        "session (DaskSource fuses each group of SPLIT_EVERY chunks and its "
                        "merge into one task when there are enough groups per thread)")
    p.add_argument("--cs-workers", default="1,2,4,8",
                   help="worker processes of (c), comma-separated")
    p.add_argument("--out", default=None)
    p.add_argument("--child-minibatch", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_minibatch:
        return minibatch_child(args.child_minibatch)
    args.cs_chunks = [int(c) for c in str(args.cs_chunks).split(",")]
    args.cs_workers = [int(c) for c in str(args.cs_workers).split(",")]
    if args.out is None:
        args.out = str(HERE / "results" / ("bench_dask_chunks.json" if args.chunk_scaling
                                           else "bench_dask.json"))
    q = args.quick
    args.n = args.n or (60_000 if q else 1_000_000)
    args.k = args.k or (32 if q else 256)
    args.chunk = args.chunk or (10_000 if q else 62_500)
    args.repeats = args.repeats or (3 if q else 7)
    args.mb_n = args.mb_n or (100_000 if q else 2_000_000)
    args.row_group = args.row_group or (10_000 if q else 32_768)
    args.rows_per_file = args.rows_per_file or (50_000 if q else 262_144)
    args.fb_n = args.fb_n or (50_000 if q else 250_000)
    args.seeds = args.seeds or (2 if q else 3)
    warnings.simplefilter("ignore", category=UserWarning)

    import dask
    import distributed
    import numba
    import psutil
    result = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                          "memory_gib": psutil.virtual_memory().total / 2 ** 30,
                          "load_average_start": os.getloadavg(),
                          "numba": numba.__version__, "dask": dask.__version__,
                          "distributed": distributed.__version__},
              "quick": q, "command": " ".join(["python", "benchmarks/bench_dask.py"]
                                               + (argv if argv is not None else sys.argv[1:]))}
    if args.chunk_scaling:
        print(f"(c) cluster scale: N={args.cs_n:,} D={args.cs_d} K={args.cs_k}; chunks "
              f"{args.cs_chunks}, worker processes {args.cs_workers}", flush=True)
        result["chunk_scaling"] = bench_chunk_scaling(args)
        args.skip_a = args.skip_b = True
    if not args.skip_a:
        print(f"(a) full batch: N={args.n:,} D={args.d} K={args.k} chunks of {args.chunk:,}",
              flush=True)
        result["full_batch"] = fb = bench_full_batch(args)
        print(f"{'backend':<18}{'s/pass':>10}{'x in-mem':>10}{'x GEMM':>10}{'best s':>10}"
              f"{'best x':>8}   (medians and bests of {args.repeats} interleaved passes)")
        for k in fb["seconds"]:
            print(f"{k:<18}{fb['seconds'][k]:>10.3f}{fb['ratio_to_in_memory'][k]:>10.2f}"
                  f"{fb['ratio_to_gemm'][k]:>10.2f}{fb['best_seconds'][k]:>10.3f}"
                  f"{fb['best_ratio_to_in_memory'][k]:>8.2f}")
        print(f"dask-ml KMeans: {fb['dask_ml']}; |S_dask - S_mem| / |S_mem| = "
              f"{fb['rel_diff_S']:.2e}", flush=True)
    if not args.skip_b:
        tmp = args.tmp or tempfile.mkdtemp(prefix="bench_dask_")
        try:
            print(f"(b) mini-batch out of core: N={args.mb_n:,} and {2 * args.mb_n:,}, "
                  f"D={args.d}, K={args.k}, row groups of {args.row_group:,}", flush=True)
            result["minibatch"] = mbr = bench_minibatch(args, tmp)
        finally:
            if not args.tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        print(f"{'rows':>10}{'wall s':>9}{'rows/s':>11}{'peak MiB':>10}{'% data':>8}"
              f"{'J/row':>10}{'J*/row':>10}{'ARI':>8}")
        for r in mbr["sizes"]:
            print(f"{r['rows']:>10,}{r['wall_s']:>9.1f}{r['rows_per_s']:>11.3g}"
                  f"{r['peak_rss_bytes'] / 2**20:>10.0f}"
                  f"{100 * r['peak_fraction_of_dataset']:>8.1f}{r['J_per_row']:>10.2f}"
                  f"{r['J_true_means_per_row']:>10.2f}{r['ari_vs_truth']:>8.4f}")
        qv = mbr["quality_vs_full_batch"]
        m = qv["mean"]
        print(f"vs full batch on {qv['rows']:,} rows (mean of {qv['seeds']} seeds): J mini/full "
              f"= {m['J_ratio']:.4f}, ARI(mini, full) = {m['ari_minibatch_vs_full']:.4f}, "
              f"ARI vs truth: full {m['ari_full_vs_truth']:.4f}, mini "
              f"{m['ari_minibatch_vs_truth']:.4f} (full {m['full_batch_s']:.1f} s, mini "
              f"{m['minibatch_s']:.1f} s)")
    result["machine"]["load_average_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2, default=float)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
