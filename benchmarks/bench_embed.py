"""Embedding throughput: ``model.encode`` vs the packed, length-bucketed encoder.

    python benchmarks/bench_embed.py                   # all distinct demo queries, 3 repeats
    python benchmarks/bench_embed.py --n 1000 --repeats 5 --no-quantized

Embeds the N distinct queries of the bundled CLINC150 demo (``fastanneal/data/
clinc150_demo.parquet``, 30 intents) with

* ``baseline``: what ``fastanneal cluster`` did before (``SentenceTransformer.encode``,
  ``batch_size=128``, ``normalize_embeddings=True``, torch's default threads);
* ``fast``: :func:`fastanneal._embed.load_embedder` (packed length buckets, one
  single-threaded worker per CPU);
* ``bfloat16``: the same with bfloat16 matrix products (``precision="bfloat16"``; what
  ``fastanneal cluster --embed-precision bfloat16`` runs), unless ``--no-bfloat16``;
* ``int8``: the same with dynamic int8 linear layers (``precision="int8"``, experimental,
  not offered by the command line), unless ``--no-quantized``.

Each encoder is warmed up once, then the repeats are interleaved (baseline, fast, bfloat16,
int8, baseline, ...), so a change in the machine's load hits all alike. Reports the median
queries/s (wall clock) and queries per CPU-second of this process (less sensitive to other
work on a shared machine), the ratio to the baseline, ``1 - cos`` per row against the
baseline's vectors (max and mean, in float64; and the largest coordinate
difference), the 1-minute load average around the timings, and the
effect on clustering: ARI of ``AnnealedKMeans(n_clusters=K, metric="cosine",
random_state=0)`` labels between the vector sets and against the intent labels. Prints a
table, writes JSON (default ``benchmarks/results/bench_embed.json``).
"""
import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DEMO = HERE.parent / "fastanneal" / "data" / "clinc150_demo.parquet"


def load_queries(path=DEMO, n=None):
    """Distinct query texts of the demo, first occurrence order, with their intent labels."""
    import pyarrow.parquet as pq
    t = pq.read_table(path, columns=["query", "label"])
    texts, labels, seen = [], [], set()
    for q, lab in zip(t.column("query").to_pylist(), t.column("label").to_pylist()):
        if q not in seen:
            seen.add(q)
            texts.append(q)
            labels.append(lab)
    if n is not None and n < len(texts):        # a seeded sample, all intents, file order
        keep = np.sort(np.random.default_rng(0).choice(len(texts), n, replace=False))
        texts, labels = [texts[i] for i in keep], [labels[i] for i in keep]
    _, y = np.unique(np.asarray(labels), return_inverse=True)
    return texts, y


def timed(fn, texts):
    """``(vectors, wall seconds, CPU seconds of this process, 1-min load average after)``."""
    c0, t0 = time.process_time(), time.perf_counter()
    E = fn(texts)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return np.asarray(E, dtype=np.float32), wall, cpu, os.getloadavg()[0]


def one_minus_cos(A, B):
    A = A.astype(np.float64)
    B = B.astype(np.float64)
    return 1.0 - (A * B).sum(1) / (np.linalg.norm(A, axis=1) * np.linalg.norm(B, axis=1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=None, help="at most this many distinct queries")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="workers of the fast encoders (default: the CPUs available)")
    ap.add_argument("--no-quantized", action="store_true", help="skip the int8 encoder")
    ap.add_argument("--no-bfloat16", action="store_true", help="skip the bfloat16 encoder")
    ap.add_argument("--no-cluster", action="store_true", help="skip the ARI measurements")
    ap.add_argument("--json", default=str(HERE / "results" / "bench_embed.json"))
    args = ap.parse_args(argv)

    from fastanneal import _embed
    import torch
    texts, y = load_queries(n=args.n)
    n = len(texts)
    t0 = time.perf_counter()
    fast = _embed.load_embedder(threads=args.threads)
    load_s = time.perf_counter() - t0
    model = fast.model

    def baseline(batch):
        return model.encode(list(batch), batch_size=128, normalize_embeddings=True,
                            show_progress_bar=False, convert_to_numpy=True)

    encoders = {"baseline": baseline, "fast": fast}
    if not args.no_bfloat16:
        encoders["bfloat16"] = _embed.load_embedder(threads=args.threads, precision="bfloat16")
    if not args.no_quantized:
        encoders["int8"] = _embed.load_embedder(threads=args.threads, precision="int8")
    ids = fast.tokenize(texts)
    lens = np.array([len(s) for s in ids])
    order = np.argsort([-len(t) for t in texts], kind="stable")     # encode's char sort
    padded_baseline = int(sum(lens[order[s:s + 128]].max() * len(order[s:s + 128])
                              for s in range(0, n, 128)))

    warm = texts[: min(n, 256)]
    for fn in encoders.values():                # warm-up: first calls allocate, load kernels
        fn(warm)
    runs = {name: [] for name in encoders}
    vectors = {}
    for _ in range(args.repeats):               # interleaved repeats
        for name, fn in encoders.items():
            E, wall, cpu, load = timed(fn, texts)
            vectors[name] = E
            runs[name].append({"wall_s": wall, "cpu_s": cpu, "load1": load})

    ref = vectors["baseline"]
    base_qps = n / float(np.median([r["wall_s"] for r in runs["baseline"]]))
    base_qpc = n / float(np.median([r["cpu_s"] for r in runs["baseline"]]))
    rows = []
    for name, rs in runs.items():
        wall = float(np.median([r["wall_s"] for r in rs]))
        cpu = float(np.median([r["cpu_s"] for r in rs]))
        d = one_minus_cos(vectors[name], ref)
        rows.append({"encoder": name, "queries_per_s": n / wall,
                     "queries_per_s_best": n / min(r["wall_s"] for r in rs),
                     "queries_per_cpu_s": n / cpu, "ratio": n / wall / base_qps,
                     "ratio_cpu": n / cpu / base_qpc,
                     "max_1_minus_cos": float(d.max()), "mean_1_minus_cos": float(d.mean()),
                     "max_abs_diff": float(np.abs(vectors[name] - ref).max()),
                     "runs": rs})

    clustering = None
    if not args.no_cluster:
        import fastanneal
        from fastanneal.cli import adjusted_rand_index
        K = int(y.max()) + 1
        labels = {}
        for name, E in vectors.items():
            km = fastanneal.AnnealedKMeans(n_clusters=K, metric="cosine", random_state=0)
            labels[name] = np.asarray(km.fit(E).labels_)
        clustering = {"K": K, "ari_vs_intents": {k: adjusted_rand_index(v, y)
                                                 for k, v in labels.items()},
                      "ari_vs_fast": {k: adjusted_rand_index(v, labels["fast"])
                                      for k, v in labels.items() if k != "fast"}}

    loads = [r["load1"] for rs in runs.values() for r in rs]
    print(f"\nembedding benchmark: {n} distinct CLINC150 demo queries "
          f"({int(lens.sum())} tokens; encode pads to {padded_baseline}), "
          f"{args.repeats} interleaved repeats, {os.cpu_count()} CPUs, "
          f"fast workers {args.threads or _embed.available_cpus()}, "
          f"1-min load average {min(loads):.1f}-{max(loads):.1f}")
    print(f"{'encoder':<10} {'q/s':>8} {'best q/s':>9} {'x base':>7} {'q/cpu-s':>8} "
          f"{'x base':>7} {'max 1-cos':>10} {'mean 1-cos':>11} {'max |diff|':>11}")
    for r in rows:
        print(f"{r['encoder']:<10} {r['queries_per_s']:>8.1f} {r['queries_per_s_best']:>9.1f} "
              f"{r['ratio']:>7.2f} {r['queries_per_cpu_s']:>8.1f} {r['ratio_cpu']:>7.2f} "
              f"{r['max_1_minus_cos']:>10.2e} {r['mean_1_minus_cos']:>11.2e} "
              f"{r['max_abs_diff']:>11.2e}")
    if clustering:
        print(f"\nAnnealedKMeans(K={clustering['K']}, cosine, random_state=0) ARI")
        for name, a in clustering["ari_vs_intents"].items():
            vs = clustering["ari_vs_fast"].get(name)
            print(f"  {name:<10} vs intents {a:.4f}" +
                  (f"   vs fast's labels {vs:.4f}" if vs is not None else ""))

    out = {"n": n, "tokens": int(lens.sum()), "tokens_padded_by_encode": padded_baseline,
           "repeats": args.repeats, "threads": args.threads or _embed.available_cpus(),
           "batch_tokens": _embed.DEFAULT_BATCH_TOKENS, "model_load_s": load_s,
           "rows": rows, "clustering": clustering,
           "machine": {"cpus": os.cpu_count(), "processor": platform.processor(),
                       "python": sys.version.split()[0], "numpy": np.__version__,
                       "torch": torch.__version__,
                       "torch_threads_default": torch.get_num_threads(),
                       "native_bfloat16": _embed.native_bfloat16(torch),
                       "sentence_transformers":
                           __import__("sentence_transformers").__version__},
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
