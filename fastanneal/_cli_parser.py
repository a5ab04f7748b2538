"""The argument parser of the ``fastanneal`` command."""
import argparse

class _Parser(argparse.ArgumentParser):
    """Usage errors in one line on stderr (``fastanneal: error: ...``), exit code 2."""

    def error(self, message):
        msg = " ".join(str(message).split())
        self.exit(2, f"fastanneal: error: {msg} (see: {self.prog} --help)\n")


def _k_value(text):
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer or 'auto': {text!r}") from None


def _seed(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= v < 2 ** 63:
        raise argparse.ArgumentTypeError(f"must be in 0 .. 2**63-1; got {v}")
    return v


def _columns(text):
    cols = [c.strip() for c in str(text).split(",") if c.strip()]
    if not cols:
        raise argparse.ArgumentTypeError("give one or more column names, separated by commas")
    return cols


def _size(text):
    from ._cli_stream import parse_size
    try:
        v = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive; got {text!r}")
    return v


def _add_cluster_options(p, demo=False):
    req = p if demo else p.add_argument_group(
        "required (unless --demo)", "what to cluster, where to write it, how many clusters")
    if not demo:
        # list the required group first in --help (argparse lists groups in creation order)
        p._action_groups.insert(0, p._action_groups.pop())
    if not demo:
        req.add_argument("input", nargs="?", metavar="INPUT",
                         help="queries: .csv / .tsv (optionally .gz / .bz2 / .zst), .parquet "
                              "(file or dataset folder) or .jsonl")
    req.add_argument("-o", "--output", metavar="OUTPUT",
                   help=("folder for the demo outputs (default ./fastanneal-demo/) or a .csv / "
                         ".tsv / .parquet / .jsonl file" if demo else
                         "the input rows with cluster, probability, margin and runner_up "
                         "added; the format "
                         "follows the extension (.csv, .tsv, .parquet, .jsonl). The cluster table "
                         "goes to OUTPUT's name + .clusters.csv"))
    req.add_argument("--k", "-k", type=_k_value, default=None, metavar="K",
                   help="number of clusters, or 'auto': chosen from the phase transitions "
                        "(the finest natural level up to --k-max)"
                        + (" (default 30, the number of intents)" if demo else " (required)"))
    p.add_argument("--k-max", type=int, default=None, metavar="N",
                   help="with --k auto: the most clusters considered (default 50)")
    if not demo:
        p.add_argument("--text-column", default=None, metavar="COL",
                       help="column with the query text (default: query; with "
                            "--embedding-column the clusters are labelled from it, and "
                            "a log without it gets unlabelled clusters, with a note)")
        p.add_argument("--embedding-column", metavar="COL",
                       help="column with precomputed vectors (a list of floats per row); "
                            "without it the queries are embedded with fastanneal[embed]")
        p.add_argument("--embed-precision", choices=["float32", "bfloat16"], default=None,
                       help="without --embedding-column: the precision of the embedding "
                            "model's matrix products (default float32, the exact vectors; "
                            "bfloat16: about 1.9x faster on CPUs with native bfloat16, "
                            "AVX512-BF16 or AMX; mean 1 - cos about 1.5e-5)")
        p.add_argument("--id-column", metavar="COL",
                       help="column of unique row ids (checked; carried to the outputs)")
        p.add_argument("--weight-column", metavar="COL",
                       help="query frequency / impressions: sample weights (>= 0)")
        p.add_argument("--truth-column", metavar="COL",
                       help="known labels: report the adjusted Rand index against them")
    p.add_argument("--metric", choices=["cosine", "euclidean"], default="cosine",
                   help="distance (default: cosine)")
    p.add_argument("--schedule", choices=["geometric", "linear", "critical", "constant"],
                   default="geometric", help="temperature schedule (default: geometric)")
    p.add_argument("--steps", type=int, default=20, metavar="N",
                   help="temperatures of the geometric / linear / constant schedules (default 20)")
    p.add_argument("--every-step", action="store_true",
                   help="run every temperature (default: the schedule ends once every row is "
                        "one-hot at a fixed point, where colder steps change nothing, or once "
                        "a step changed the distortion by < 3e-5 with the rows nearly decided)")
    p.add_argument("--responsibilities", choices=["softmax", "entmax15"], default="softmax",
                   help="soft assignment rule (default: softmax)")
    p.add_argument("--seed", type=_seed, default=0, help="random seed (default 0)")
    p.add_argument("--backend", choices=["cpu", "cuda", "dask"], default="cpu",
                   help="where the fit runs (default: cpu; cuda: an NVIDIA GPU, pip install "
                        "'fastanneal[cuda]'; out of core, the GPU reduces the batches)")
    p.add_argument("--memory-limit", type=_size, metavar="SIZE",
                   help="Parquet input with --embedding-column: when clustering in memory "
                        "would need more than SIZE (1.5 x the embedding bytes + 48 B a row; "
                        "e.g. 8G; default: half of this machine's memory), cluster out of "
                        "core, row group by row group (this picks the route; it does not cap "
                        "the process: out of core it peaked at 1.2 GiB on 10 million 384-d rows)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="dask: start a local cluster with N worker processes")
    p.add_argument("--scheduler", metavar="ADDRESS",
                   help="dask: address of a running scheduler (tcp://host:8786)")
    p.add_argument("--report", metavar="PATH",
                   help="write a self-contained HTML report (clusters first; no extra needed)"
                        + ("; the demo writes OUTPUT/report.html by default" if demo else ""))
    if demo:
        p.add_argument("--no-report", action="store_true", help="do not write the HTML report")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="save the annealing state (and embedding progress) in DIR; rerunning "
                        "the same command resumes from it, or reuses a finished fit")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars, no summary")
    p.add_argument("--debug", action="store_true",
                   help="on an unexpected error, print the full traceback")
    p.add_argument("--progress", action="store_true",
                   help="progress bars even when stderr is not a terminal")


def build_parser():
    from . import __version__
    parser = _Parser(
        prog="fastanneal",
        description="Annealed soft k-means for query logs: raw queries in, labelled clusters "
                    "out. Start with `fastanneal demo`.")
    parser.add_argument("--version", action="version", version=f"fastanneal {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    pc = sub.add_parser(
        "cluster", help="cluster the queries of a file",
        description="Cluster the rows of INPUT. Writes OUTPUT (all input columns plus cluster, "
                    "probability, margin, runner_up) and OUTPUT's name + .clusters.csv (size, weight, "
                    "label, most central query, cohesion per cluster).",
        epilog="example: fastanneal cluster queries.csv -o clustered.parquet --k 100 "
               "--weight-column count --report report.html")
    _add_cluster_options(pc)
    pc.add_argument("--demo", action="store_true",
                    help="run on the bundled CLINC150 sample instead of INPUT")
    pc.add_argument("--drop-columns", metavar="COL[,COL...]", type=_columns, default=[],
                    help="input columns left out of OUTPUT (e.g. the embedding column of a "
                         "large log)")
    pd = sub.add_parser(
        "demo", help="cluster a bundled sample of 4,500 real queries (CLINC150)",
        description="Cluster the bundled sample of CLINC150 (30 intents x 150 real queries, "
                    "precomputed all-MiniLM-L6-v2 embeddings), print the agreement with the "
                    "intents (ARI) and write the rows, the cluster table and an HTML report.")
    _add_cluster_options(pd, demo=True)
    pd.set_defaults(input=None, text_column="query", embedding_column="embedding",
                    id_column=None, weight_column=None, truth_column="label", demo=True,
                    drop_columns=["embedding"])
    ps = sub.add_parser(
        "suggest-k", help="rank the numbers of clusters by their phase-transition plateau",
        description="Follow the annealing path of INPUT's embeddings up to --k-max effective "
                    "clusters and rank every K by the width of its plateau in log T (the "
                    "rule of fastanneal.suggest_k). Prints the ranking; writes nothing "
                    "unless --plot is given.",
        epilog="example: fastanneal suggest-k queries.parquet --embedding-column embedding "
               "--k-max 60")
    ps.add_argument("input", metavar="INPUT",
                    help=".csv / .tsv, .parquet (file or dataset folder) or .jsonl")
    ps.add_argument("--embedding-column", required=True, metavar="COL",
                    help="column with the vectors (a list of floats per row)")
    ps.add_argument("--weight-column", metavar="COL", help="sample weights (>= 0)")
    ps.add_argument("--k-max", type=int, default=None, metavar="N",
                    help="the most clusters considered (default 50, or the rows with weight "
                         "> 0 if fewer)")
    ps.add_argument("--k-min", type=int, default=2, metavar="N", help="default 2")
    ps.add_argument("--metric", choices=["cosine", "euclidean"], default="cosine")
    ps.add_argument("--seed", type=_seed, default=0, help="random seed (default 0)")
    ps.add_argument("--top", type=int, default=10, metavar="N",
                    help="rows of the ranking to print (default 10)")
    ps.add_argument("--plot", metavar="FILE",
                    help="save the evidence figure: .svg (no extra needed) or .png (matplotlib)")
    ps.add_argument("--quiet", "-q", action="store_true", help="only the suggested K")
    ps.add_argument("--debug", action="store_true",
                    help="on an unexpected error, print the full traceback")
    ps.set_defaults(progress=False)
    return parser


