"""A laptop-scale query log, end to end: out of core from Python and from ``fastanneal cluster``.

    python benchmarks/bench_scale.py                      # 10,000,000 rows, K = 1,000
    python benchmarks/bench_scale.py --rows 1000000 --k 100 --in-memory
    python benchmarks/bench_scale.py --quick              # 300,000 rows, K = 100

1. Generates (once; kept in ``--dir``) a clustered synthetic query log
   (``benchmarks/_scale_data.py``): ``--rows`` rows of 384-d float32 unit vectors (the
   embedding column uncompressed, 65,536 rows per row group), a text, an id, a count and
   the true topic (``--topics`` of them, Zipf-sized).
2. **Library**: ``MiniBatchAnnealedKMeans(K, metric="cosine").fit(open_parquet(log,
   weight="count", id="id"), labels_path=...)`` in a fresh process.
3. **Command**: ``fastanneal cluster log --embedding-column embedding --text-column query
   --id-column id --weight-column count --k K --drop-columns embedding --memory-limit M``,
   with M below the embeddings (the out-of-core route; a 10-million-row log is 15 GB of
   embeddings, above the default limit on this machine anyway).
4. ``--in-memory``: the same command with the default limit (the in-memory route, when the
   embeddings fit), for the peak-memory ratio of the issue (peak RSS / embedding bytes).

Each run: wall time, the per-stage lines of the command (rows/s), peak resident memory of
the process tree (psutil, sampled every 50 ms), ARI against the true topics. Peers in the
same run: the rate at which this machine decodes the embedding column alone (pyarrow), and
the GEMM-limited rate ``X @ C.T`` for K centers (one float32 GEMM per row block), so the
rows/s read as fractions of what the hardware allows. Prints a table; writes JSON.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def tree_rss(pid):
    """Resident bytes of the process ``pid`` and its children (0 once it is gone)."""
    import psutil
    try:
        p = psutil.Process(pid)
        return sum(q.memory_info().rss for q in [p] + p.children(recursive=True))
    except psutil.Error:
        return 0


def run_sampled(cmd, env=None, watch=None):
    """Run ``cmd``; return (rc, wall s, peak RSS bytes of its process tree, stdout, stderr).
    ``watch`` (name -> pid): other process trees whose peak RSS over the run is recorded
    into ``watch_peaks`` (a dict filled in place)."""
    import psutil
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    ps = psutil.Process(proc.pid)
    peak = 0
    watch = watch or {}
    for name in watch:
        watch_peaks[name] = 0
    import threading
    out = {}
    stage_marks.clear()
    stage_peaks.clear()
    since = [0]                     # the peak since the last stage line

    def drain(name, f):
        lines = []
        for ln in f:
            lines.append(ln)
            stage = ln[12:].split(":", 1)[0] if ln.startswith("fastanneal: ") else None
            if name == "err" and stage in STAGES:
                # a stage line is printed when its stage ends: the peak since the last one
                stage_marks.append((time.perf_counter() - t0, stage))
                stage_peaks[stage] = max(stage_peaks.get(stage, 0), since[0])
                since[0] = 0
        out[name] = "".join(lines)
    ts = [threading.Thread(target=drain, args=(n, f)) for n, f in
          (("out", proc.stdout), ("err", proc.stderr))]
    for t in ts:
        t.start()
    while proc.poll() is None:
        total = 0
        try:
            for p in [ps] + ps.children(recursive=True):
                total += p.memory_info().rss
        except psutil.Error:
            pass
        peak = max(peak, total)
        since[0] = max(since[0], total)
        for name, pid in watch.items():
            watch_peaks[name] = max(watch_peaks[name], tree_rss(pid))
        time.sleep(0.05)
    for t in ts:
        t.join()
    return proc.returncode, time.perf_counter() - t0, peak, out.get("out", ""), out.get("err", "")


#: peak RSS of the processes ``run_sampled`` was asked to watch (the Dask scheduler, ...)
watch_peaks = {}
#: the command's peak RSS (its own process tree) per stage of its stderr lines (a stage's
#: line ends it: "annealing" is the peak between the line before and the annealing line)
stage_peaks = {}
stage_marks = []
STAGES = ("reading", "embedding", "kernels", "annealing", "labelling", "writing")


def start_dask_cluster(workdir, n_workers=2):
    """``dask scheduler`` and ``dask worker`` (``n_workers`` processes of one thread), as a
    user starts them from the command line; returns ``(address, {name: Popen})``."""
    sched_file = os.path.join(workdir, "scheduler.json")
    if os.path.exists(sched_file):
        os.remove(sched_file)
    dask = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
    procs = {"scheduler": subprocess.Popen(
        dask + ["--scheduler-file", sched_file, "--no-dashboard", "--host", "127.0.0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)}
    for _ in range(600):
        if os.path.exists(sched_file):
            break
        time.sleep(0.1)
    procs["workers"] = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file", sched_file,
         "--nworkers", str(n_workers), "--nthreads", "1", "--no-dashboard"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(sched_file) as f:
        address = json.load(f)["address"]
    from distributed import Client
    with Client(address, timeout=60) as c:
        c.wait_for_workers(n_workers, timeout=120)
    return address, procs


def stop_dask_cluster(procs):
    for p in procs.values():
        p.terminate()
    for p in procs.values():
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


LIBRARY = r"""
import json, sys, time, numpy as np
import fastanneal as fa
from fastanneal.estimator import warm_up
path, K, labels = sys.argv[1], int(sys.argv[2]), sys.argv[3]
t0 = time.perf_counter(); warm_up(np.float32, "cosine"); t_warm = time.perf_counter() - t0
t0 = time.perf_counter()
est = fa.MiniBatchAnnealedKMeans(K, metric="cosine", random_state=0).fit(
    fa.open_parquet(path, weight="count", id="id", metric="cosine"), labels_path=labels,
    overwrite=True)
dt = time.perf_counter() - t0
print(json.dumps({"fit_s": dt, "warm_s": t_warm, "n_batches": est.n_batches_,
                  "seeding_s": float(est.trace_.as_dict()["wall_time"][0]),
                  "n_passes": est.n_passes_, "rows_seen": est.rows_seen_,
                  "rows": est.n_rows_, "inertia_per_row": est.inertia_ / est.n_rows_}))
"""


def peers(path, K, dim):
    """Decode rate of the embedding column alone, and the GEMM-limited rate for K centers."""
    import pyarrow.parquet as pq
    pf = pq.ParquetFile(path)
    n_groups = min(pf.metadata.num_row_groups, 8)
    t0 = time.perf_counter()
    rows = 0
    for rg in range(n_groups):
        t = pf.read_row_group(rg, columns=["embedding"], use_threads=False)
        X = t.column(0).combine_chunks().flatten().to_numpy().reshape(-1, dim)
        rows += X.shape[0]
    decode = rows / (time.perf_counter() - t0)
    C = np.random.default_rng(0).standard_normal((K, dim)).astype(np.float32)
    X = np.ascontiguousarray(X[:16384])
    X @ C.T
    reps = []
    for _ in range(5):
        t0 = time.perf_counter()
        X @ C.T
        reps.append(time.perf_counter() - t0)
    gemm = X.shape[0] / float(np.median(reps))
    return {"decode_rows_per_s": decode, "gemm_rows_per_s": gemm}


def ari_from_labels(path, labels_dir):
    import pyarrow.parquet as pq

    from fastanneal._cli_results import adjusted_rand_index
    truth = pq.read_table(path, columns=["topic"]).column(0).to_numpy()
    lab = pq.read_table(labels_dir, columns=["row", "label"]).sort_by("row")
    return adjusted_rand_index(truth, lab.column("label").to_numpy())


def ari_from_output(path, out):
    import pyarrow.parquet as pq

    from fastanneal._cli_results import adjusted_rand_index
    truth = pq.read_table(path, columns=["topic"]).column(0).to_numpy()
    got = pq.read_table(out, columns=["cluster"]).column(0).to_numpy()
    return adjusted_rand_index(truth, got)


def stage_lines(err):
    return [ln for ln in err.splitlines() if ln.startswith("fastanneal: ") and " in " in ln]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--k", type=int, default=1000)
    ap.add_argument("--topics", type=int, default=None, help="true topics (default: --k)")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "fastanneal_scale"))
    ap.add_argument("--quick", action="store_true", help="300,000 rows, K = 100")
    ap.add_argument("--in-memory", action="store_true",
                    help="also run the command's in-memory route (default --memory-limit)")
    ap.add_argument("--skip-library", action="store_true")
    ap.add_argument("--skip-command", action="store_true")
    ap.add_argument("--dask-cluster", action="store_true",
                    help="also run the command with --backend dask against a scheduler and two "
                    "one-thread workers started with the dask command line (out of core: "
                    "the workers read the row groups); records the client's and the "
                    "scheduler's peak RSS")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.quick:
        a.rows, a.k = 300_000, 100
    topics = a.topics or a.k
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, f"log_{a.rows}_{a.dim}_{topics}.parquet")
    res = {"rows": a.rows, "k": a.k, "dim": a.dim, "topics": topics, "path": path,
           "embedding_bytes": a.rows * a.dim * 4, "cpus": os.cpu_count()}
    if not os.path.exists(path):
        from _scale_data import make_log
        t0 = time.perf_counter()
        make_log(path + ".tmp", a.rows, dim=a.dim, n_topics=topics)
        os.replace(path + ".tmp", path)
        res["generate_s"] = time.perf_counter() - t0
    res["file_bytes"] = os.path.getsize(path)
    res["peers"] = peers(path, a.k, a.dim)
    rows = []
    if not a.skip_library:
        labels = os.path.join(a.dir, "labels_lib")
        rc, wall, peak, out, err = run_sampled([sys.executable, "-c", LIBRARY, path,
                                                str(a.k), labels])
        if rc != 0:
            raise SystemExit(f"library run failed:\n{err[-3000:]}")
        info = json.loads(out.strip().splitlines()[-1])
        info.update(wall_s=wall, peak_rss=peak, ari=ari_from_labels(path, labels))
        # rows read per second of fit over all its passes (the epochs' batches + the polish
        # and final passes): the out-of-core throughput of issue 16
        info["pass_rows_per_s"] = (info["rows_seen"] + info["n_passes"] * info["rows"]) \
            / info["fit_s"]
        # ... and over the passes alone: after the seeding (a sample of at least eight row
        # groups read, and annealed in memory: a fixed cost, not a pass; the first trace
        # record's time, which also holds the first mini-batch step)
        info["pass_rows_per_s_after_seeding"] = (
            (info["rows_seen"] + info["n_passes"] * info["rows"])
            / max(info["fit_s"] - info["seeding_s"], 1e-9))
        res["library"] = info
        rows.append(("library, out of core", wall, info["fit_s"], peak, info["ari"]))
    routes = []
    if not a.skip_command:
        routes.append(("command, out of core", ["--memory-limit", "256M"]))
    if a.in_memory:
        routes.append(("command, in memory", []))
    if a.dask_cluster:
        routes.append(("command, Dask cluster", ["--memory-limit", "256M", "--backend", "dask"]))
    for name, extra in routes:
        outp = os.path.join(a.dir, "out.parquet")
        for f in (outp, os.path.join(a.dir, "out.clusters.csv")):
            if os.path.exists(f):
                os.remove(f)
        cmd = [sys.executable, "-m", "fastanneal", "cluster", path, "--embedding-column",
               "embedding", "--text-column", "query", "--id-column", "id", "--weight-column",
               "count", "--k", str(a.k), "--drop-columns", "embedding", "-o", outp, *extra]
        procs = {}
        if "dask" in extra:
            address, procs = start_dask_cluster(a.dir)
            cmd += ["--scheduler", address]
        try:
            rc, wall, peak, out, err = run_sampled(
                cmd, watch={n: p.pid for n, p in procs.items()})
        finally:
            stop_dask_cluster(procs)
        if rc != 0:
            raise SystemExit(f"{name} failed:\n{err[-3000:]}")
        key = ("command_in_memory" if not extra else "command_dask_cluster" if procs
               else "command_out_of_core")
        res[key] = {"wall_s": wall, "peak_rss": peak, "stages": stage_lines(err),
                    "ari": ari_from_output(path, outp),
                    "peak_over_embeddings": peak / res["embedding_bytes"]}
        res[key]["peak_rss_by_stage"] = dict(stage_peaks)
        print(f"{name}: peak RSS by stage: " + ", ".join(
            f"{k} {v / 2**30:.2f} GiB" for k, v in stage_peaks.items()))
        if procs:
            res[key].update({f"peak_rss_{n}": v for n, v in watch_peaks.items()})
            print(f"{name}: client {peak / 2**30:.2f} GiB, scheduler "
                  f"{watch_peaks['scheduler'] / 2**30:.2f} GiB, workers (all) "
                  f"{watch_peaks['workers'] / 2**30:.2f} GiB peak RSS")
        rows.append((name, wall, None, peak, res[key]["ari"]))
    pe = res["peers"]
    print(f"\n{a.rows:,} rows x {a.dim} (float32, {res['embedding_bytes'] / 2**30:.1f} GiB of "
          f"embeddings; file {res['file_bytes'] / 2**30:.1f} GiB), K = {a.k}, "
          f"{os.cpu_count()} CPUs")
    print(f"peers: decoding the embedding column alone {pe['decode_rows_per_s']:,.0f} rows/s; "
          f"one GEMM X @ C.T (K = {a.k}) {pe['gemm_rows_per_s']:,.0f} rows/s")
    print(f"{'run':24s} {'wall':>9s} {'fit':>9s} {'rows/s':>10s} {'peak RSS':>10s} "
          f"{'/ emb':>6s} {'ARI':>6s}")
    for name, wall, fit, peak, ari in rows:
        print(f"{name:24s} {wall:8.1f}s {'' if fit is None else f'{fit:8.1f}s':>9s} "
              f"{a.rows / wall:10,.0f} {peak / 2**30:8.2f}GiB "
              f"{peak / res['embedding_bytes']:6.2f} {ari:6.3f}")
    if "library" in res:
        print(f"library fit: {res['library']['pass_rows_per_s']:,.0f} rows/s over its passes "
              f"({res['library']['pass_rows_per_s_after_seeding']:,.0f} after its seeding, "
              f"{res['library']['seeding_s']:.1f} s) "
              f"({res['library']['n_passes']} full passes after "
              f"{res['library']['n_batches']} mini-batches)")
    for key in ("command_out_of_core", "command_in_memory", "command_dask_cluster"):
        if key in res:
            print(f"\n{key}:")
            for ln in res[key]["stages"]:
                print("   ", ln)
    out = a.json or str(HERE / "results" / f"bench_scale_{a.rows}.json")
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, out)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
