"""Hostile and broken input (issue 14): outputs never touch inputs, user errors are one line
with exit 2, nothing is left behind, finite data never overflows in a kernel, files the program
wrote earlier are validated, spreadsheet formulas are neutralised, Parquet checksums checked.

Every case asserts the behaviour that the feature adds: without the path check the input is
overwritten, without the range check a kernel crashes, and so on."""
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

import fastanneal
from fastanneal import cli
from fastanneal._io import InputError, clean_stale_temps, read_table, temp_prefix

from test_cli import FakeEmbedder, assert_one_line_error, make_table, read_any, run, write_any

REPO = Path(__file__).resolve().parents[1]


def digest(path):
    """sha256 of a file, or of every file under a folder (with names)."""
    path = Path(path)
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def listing(*folders):
    return {str(f): sorted(os.listdir(f)) for f in folders}


@pytest.fixture
def inp(tmp_path):
    """An input table (with embeddings) in its own folder; the test's outputs go elsewhere."""
    d = tmp_path / "in"
    d.mkdir()
    table, _, _ = make_table(n=60)
    return table, d


# =========================================================================== 1. outputs vs inputs
def _path_cases(tmp_path, table, d):
    """(name, argv, the input to protect): every way an output can resolve to an input."""
    csv_in = write_any(table, d / "q.csv")
    pq_in = write_any(table, d / "q.parquet")
    side_in = write_any(table, d / "o.clusters.csv")          # = the side table of -o o.parquet
    jsonl_in = write_any(table, d / "r.embeddings.jsonl")
    key_in = d / "r.embeddings.json"                            # the embedding cache's key file
    key_in.write_bytes(jsonl_in.read_bytes())
    ds = d / "dataset"
    ds.mkdir()
    write_any(table, ds / "part-0.parquet")
    link = tmp_path / "link.csv"
    link.symlink_to(csv_in)
    hard = tmp_path / "hard.csv"
    os.link(csv_in, hard)
    emb = ["--embedding-column", "emb", "--k", 2]
    rel = os.path.relpath(csv_in, os.getcwd())
    dotted = d / ".." / d.name / "q.csv"
    return [
        ("same path", [csv_in, "-o", csv_in, *emb], csv_in),
        ("relative and ..", [csv_in, "-o", dotted, *emb], csv_in),
        ("relative to cwd", [rel, "-o", csv_in, *emb], csv_in),
        ("symlink", [csv_in, "-o", link, *emb], csv_in),
        ("hard link", [hard, "-o", csv_in, *emb], csv_in),
        ("side table", [side_in, "-o", d / "o.parquet", *emb], side_in),
        ("embedding cache key", [key_in, "-o", d / "r.csv", "--k", 2], key_in),
        ("inside a dataset folder", [ds, "-o", ds / "out.parquet", *emb], ds),
        ("checkpoint holds the input", [csv_in, "-o", tmp_path / "r.csv", "--checkpoint", d,
                                        *emb], csv_in),
        ("checkpoint inside a dataset", [ds, "-o", tmp_path / "r.csv", "--checkpoint",
                                         ds / "ck", *emb], ds),
    ]


def test_outputs_never_touch_inputs(capsys, tmp_path, inp):
    table, d = inp
    cases = _path_cases(tmp_path, table, d)
    for name, argv, protected in cases:
        before_hash = digest(protected)
        before = listing(d, tmp_path)
        rc, _, err = run(capsys, "cluster", *argv)
        assert_one_line_error(rc, err, "refusing to overwrite the input"
                              if "checkpoint" not in name else "overlap")
        assert digest(protected) == before_hash, name
        assert listing(d, tmp_path) == before, name            # nothing read, nothing written


def test_outputs_must_differ_from_each_other(capsys, tmp_path, inp):
    table, d = inp
    src = write_any(table, d / "q.parquet")
    o = tmp_path / "out"
    o.mkdir()
    # formats keep the command's own outputs apart; the check is there for any future output
    with pytest.raises(cli.CLIError, match="same file"):
        cli.check_paths([("INPUT", src)], [("-o/--output", o / "r.csv"),
                                           ("--report", o / ".." / "out" / "r.csv")])
    rc, _, err = run(capsys, "cluster", src, "-o", o / "r.csv", "--report", src,
                     "--embedding-column", "emb", "--k", 2)
    assert_one_line_error(rc, err, "html")                  # refused, input untouched
    # the demo refuses to write over its own bundled data
    before = digest(cli.DEMO_DATA)
    rc, _, err = run(capsys, "demo", "-o", cli.DEMO_DATA, "--no-report")
    assert_one_line_error(rc, err, "refusing to overwrite the input")
    assert digest(cli.DEMO_DATA) == before
    assert os.listdir(o) == []


def test_path_check_is_what_protects_the_input(capsys, tmp_path, inp, monkeypatch):
    """Without the check, -o = INPUT replaces the input: the test above guards a real risk."""
    table, d = inp
    src = write_any(table, d / "q.csv")
    before = digest(src)
    monkeypatch.setattr(cli, "check_paths", lambda *a, **k: None)
    rc, _, err = run(capsys, "cluster", src, "-o", src, "--embedding-column", "emb", "--k", 2,
                     "-q")
    assert rc == 0, err
    assert digest(src) != before


# =========================================================================== 2. one-line errors
def test_usage_errors_are_one_line(capsys, tmp_path, inp):
    table, d = inp
    src = write_any(table, d / "q.parquet")
    out = tmp_path / "r.csv"
    base = ["cluster", src, "-o", out, "--embedding-column", "emb", "--k", 2]
    for extra, word in [(["--seed", "-1"], "--seed"), (["--seed", "x"], "--seed"),
                        (["--k", "two"], "--k"), (["--bogus"], "unrecognized"),
                        (["--metric", "manhattan"], "--metric"),
                        (["--workers", "0", "--backend", "dask"], "--workers"),
                        (["--workers", "-3", "--backend", "dask"], "--workers"),
                        (["--workers", "0"], "--backend dask"),
                        (["--scheduler", "tcp://127.0.0.1:1"], "--backend dask")]:
        rc, _, err = run(capsys, *base, *extra)
        assert_one_line_error(rc, err, word)
    assert not out.exists()


def test_duplicate_column_names(capsys, tmp_path):
    f = tmp_path / "dup.csv"
    f.write_text("query,emb,query\nhello,[1 2],x\nworld,[3 4],y\n")
    rc, _, err = run(capsys, "cluster", f, "-o", tmp_path / "r.csv", "--k", 1,
                     "--embedding-column", "emb")
    assert_one_line_error(rc, err, "'query' appears more than once")
    with pytest.raises(InputError, match="more than once"):
        read_table(f)


def _closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _NotAScheduler:
    """A TCP server that answers every connection with garbage (not the Dask protocol)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                conn.sendall(b"\xff" * 64 + b"HTTP/1.0 400 nope\r\n\r\n")
                conn.close()
            except OSError:
                pass

    def close(self):
        self.stop = True
        self.sock.close()


def _run_cli_subprocess(args, timeout=120):
    env = dict(os.environ, FASTANNEAL_CONNECT_TIMEOUT="3")
    return subprocess.run([sys.executable, "-m", "fastanneal", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


@pytest.mark.parametrize("kind", ["refused", "malformed", "bad scheme", "bad port",
                                  "not a scheduler"])
def test_bad_scheduler_address_names_it_and_exits(tmp_path, inp, kind):
    """One line naming the address, exit 2, no traceback at interpreter exit (a half-built
    client is stopped at once), no output. In a subprocess: what happens at exit counts."""
    table, d = inp
    src = write_any(table, d / "q.parquet")
    server = None
    if kind == "refused":
        addr = f"tcp://127.0.0.1:{_closed_port()}"
    elif kind == "malformed":
        addr = "foo:::bar"
    elif kind == "bad scheme":
        addr = "http://127.0.0.1:8786"
    elif kind == "bad port":
        addr = "tcp://127.0.0.1:99999"
    else:
        server = _NotAScheduler()
        addr = f"tcp://127.0.0.1:{server.port}"
    try:
        p = _run_cli_subprocess(["cluster", src, "-o", tmp_path / "r.csv", "--k", 2,
                                 "--embedding-column", "emb", "--backend", "dask",
                                 "--scheduler", addr])
    finally:
        if server:
            server.close()
    assert_one_line_error(p.returncode, p.stderr, "--scheduler", addr)
    assert "Exception ignored" not in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "r.csv").exists()


def test_library_connect_errors():
    from fastanneal.dask._cluster import SchedulerConnectionError, check_address, connect
    with pytest.raises(ValueError, match="malformed"):
        check_address("tcp://127.0.0.1")
    with pytest.raises(ValueError, match="unknown scheme"):
        check_address("http://x:1")
    assert check_address("127.0.0.1:8786") == ("tcp", "127.0.0.1", 8786)
    port = _closed_port()
    with pytest.raises(SchedulerConnectionError, match=f"127.0.0.1:{port}"):
        connect(f"tcp://127.0.0.1:{port}", timeout=2)
    X = np.random.default_rng(0).normal(size=(50, 3))
    est = fastanneal.AnnealedKMeans(2, backend="dask", scheduler=f"tcp://127.0.0.1:{port}")
    with pytest.raises(ConnectionError, match="cannot reach the Dask scheduler"):
        est.fit(X)


def test_a_silent_server_is_not_a_scheduler_and_no_hang():
    """A port that accepts and never speaks (another service) hung distributed's handshake
    past its connect timeout; a Dask server speaks first, so silence is the error, at the
    timeout."""
    from fastanneal.dask._cluster import SchedulerConnectionError, connect
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])        # accepted, never answered
            except OSError:
                return
    threading.Thread(target=serve, daemon=True).start()
    try:
        t0 = time.perf_counter()
        with pytest.raises(SchedulerConnectionError, match=r"accepts connections there but is "
                                                           r"not a Dask scheduler \(nothing was "
                                                           r"sent within 1 s\)"):
            connect(f"tcp://127.0.0.1:{srv.getsockname()[1]}", timeout=1)
        assert time.perf_counter() - t0 < 10
    finally:
        stop.set()
        srv.close()
        for c in held:
            c.close()


def test_a_lost_cluster_is_a_one_line_error_not_unexpected(capsys, tmp_path, inp, monkeypatch):
    """Workers gone mid-run or the scheduler gone: a one-line error that says so (it read
    "unexpected FutureCancelledError ... rerun with --debug")."""
    pytest.importorskip("distributed")
    from distributed.client import (CancelledFuturesGroup, FutureCancelledError,
                                    FuturesCancelledError)
    from fastanneal.dask._cluster import ClusterLostError
    table, d = inp
    src = write_any(table, d / "q.parquet")
    for exc, words in ((ClusterLostError("the Dask cluster at X has had no workers for 1 s"),
                        ("has had no workers",)),
                       (FutureCancelledError("k", reason="scheduler-connection-lost"),
                        ("the Dask scheduler went away", "no output was written")),
                       # what distributed.wait raises (not a FutureCancelledError)
                       (FuturesCancelledError([CancelledFuturesGroup(
                           [FutureCancelledError("k", reason="lost")], reason="lost")]),
                        ("the Dask scheduler went away",))):
        def boom(*a, exc=exc, **k):
            raise exc
        monkeypatch.setattr(cli, "fit_model", boom)
        rc, _, err = run(capsys, "cluster", src, "-o", tmp_path / "r.csv", "--embedding-column",
                         "emb", "--k", 2, "-q")
        assert_one_line_error(rc, err, *words)
        assert "unexpected" not in err and not (tmp_path / "r.csv").exists()


def test_connect_tries_once_more_after_a_fast_failure(monkeypatch):
    """distributed's handshake once failed with a bare AssertionError in CI (the
    scheduler's first message was not the stream start, while it served another client of
    the process): one more try then; a timeout is not tried again (it would double the
    wait), and a second failure is the one-line error."""
    from fastanneal.dask import _cluster
    server = _NotAScheduler()                   # something answers the socket probe
    calls = []

    def flaky(fails):
        def make(address, timeout=None, set_as_default=False):
            calls.append(address)
            if len(calls) <= fails:
                raise fails_with
            return "client"
        return make

    try:
        addr = f"tcp://127.0.0.1:{server.port}"
        fails_with = AssertionError()
        monkeypatch.setattr(_cluster, "_client_class", lambda: flaky(1))
        assert _cluster.connect(addr, timeout=2) == "client" and len(calls) == 2
        calls.clear()
        monkeypatch.setattr(_cluster, "_client_class", lambda: flaky(2))
        with pytest.raises(_cluster.SchedulerConnectionError, match="something answers"):
            _cluster.connect(addr, timeout=2)
        assert len(calls) == 2
        calls.clear()
        fails_with = TimeoutError("too slow")
        monkeypatch.setattr(_cluster, "_client_class", lambda: flaky(1))
        with pytest.raises(_cluster.SchedulerConnectionError, match="too slow"):
            _cluster.connect(addr, timeout=2)
        assert len(calls) == 1
    finally:
        server.close()


def test_unexpected_error_is_one_line_and_debug_shows_it(capsys, tmp_path, inp, monkeypatch):
    table, d = inp
    src = write_any(table, d / "q.parquet")
    out = tmp_path / "new" / "deeper"

    def boom(*a, **k):
        raise RuntimeError("boom\nsecond line")
    monkeypatch.setattr(cli, "fit_model", boom)
    argv = ["cluster", src, "-o", tmp_path / "r.csv", "--embedding-column", "emb", "--k", 2,
            "--checkpoint", out]
    rc, _, err = run(capsys, *argv)
    assert rc == cli.EXIT_INTERNAL == 1
    lines = err.strip().splitlines()
    assert lines[-1].startswith("fastanneal: error: unexpected RuntimeError: boom second line")
    assert "--debug" in lines[-1] and "Traceback" not in err
    assert not (tmp_path / "new").exists()          # the checkpoint folders it made are gone
    with pytest.raises(RuntimeError, match="boom"):
        main_debug = cli.main([str(a) for a in argv] + ["--debug"])  # noqa: F841
    assert not (tmp_path / "r.csv").exists()


# =========================================================================== 3. distinct rows
def test_k_above_exact_distinct_rows_everywhere(capsys, tmp_path):
    """Rows equal in value but different in bits (-0.0 / 0.0) and rows that differ in the
    last bit: the count is exact, in memory, on Dask, in the mini-batch estimator, the CLI."""
    rng = np.random.default_rng(3)
    base = rng.normal(size=(3, 5)).astype(np.float32)
    base[0, 0] = 0.0
    X = np.repeat(base, 40, axis=0)
    X[1::3, 0] = np.where(X[1::3, 0] == 0.0, np.float32(-0.0), X[1::3, 0])
    for K, ok in [(3, True), (4, False)]:
        for make in (lambda: fastanneal.AnnealedKMeans(K, random_state=0),
                     lambda: fastanneal.MiniBatchAnnealedKMeans(K, random_state=0,
                                                                batch_size=32)):
            if ok:
                assert len(np.unique(make().fit(X).labels_)) == 3
            else:
                with pytest.raises(ValueError, match="distinct"):
                    make().fit(X)
    Y = X.copy()
    Y[5, 2] = np.nextafter(Y[5, 2], np.float32(np.inf))   # one more distinct row
    # four distinct rows, but one is a last-bit neighbour of another: a label tie in
    # float32 distances, so a fourth cluster may never hold a row -- a warning names it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        km = fastanneal.AnnealedKMeans(4, random_state=0).fit(Y)
    assert km.cluster_centers_.shape == (4, 5)
    if (km.cluster_weights_ == 0).any():
        assert any("differ only in their last bits" in str(w.message) for w in caught)
    da = pytest.importorskip("dask.array")
    with pytest.raises(ValueError, match="distinct"):
        fastanneal.AnnealedKMeans(4, backend="dask", random_state=0).fit(
            da.from_array(X, chunks=(25, 5)))
    table = pa.table({"query": [f"q{i}" for i in range(X.shape[0])],
                      "emb": pa.FixedSizeListArray.from_arrays(pa.array(X.ravel()), 5)})
    src = write_any(table, tmp_path / "x.parquet")
    rc, _, err = run(capsys, "cluster", src, "-o", tmp_path / "r.csv", "--k", 4,
                     "--embedding-column", "emb")
    assert_one_line_error(rc, err, "cannot cluster", "--k 4",
                          "distinct points with non-zero weight (3)")


# =========================================================================== 4. numeric range
def _blobs(dtype, scale, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(240, 4))
    X[:80] += 8
    X[80:160] -= 8
    return (X * (scale / np.abs(X).max())).astype(dtype), np.repeat(np.arange(3), 80)


# (dtype, a scale that works, a scale that must be refused, the word of the refusal)
RANGES = [(np.float32, 1e17, 1e19, "too large"), (np.float64, 1e69, 1e160, "too large"),
          (np.float32, 1e-14, 1e-25, "too small"), (np.float64, 1e-144, 1e-160, "too small")]


@pytest.mark.parametrize("dtype,good,bad,word", RANGES)
def test_finite_extremes_are_refused_or_exact(dtype, good, bad, word):
    Xg, lab = _blobs(dtype, good)
    km = fastanneal.AnnealedKMeans(3, random_state=0).fit(Xg)
    assert np.isfinite(km.cluster_centers_).all() and np.isfinite(km.inertia_)
    assert fastanneal.cli.adjusted_rand_index(km.labels_, lab) == 1.0
    C = Xg[[0, 100, 200]].astype(np.float64)
    scale = float(np.var(Xg.astype(np.float64), axis=0).sum())
    for T in (1e-4 * scale, 1e4 * scale):
        m = fastanneal.moments(Xg, C.astype(dtype), T)
        assert np.isfinite(m.S).all() and np.isfinite(m.free_energy)
        loss, gC = fastanneal.value_and_grad(Xg, C, T)[:2]
        assert np.isfinite(loss) and np.isfinite(gC).all()
    Xb, _ = _blobs(dtype, bad)
    Cb = Xb[[0, 100, 200]]
    for call in (lambda: fastanneal.AnnealedKMeans(3).fit(Xb),
                 lambda: fastanneal.moments(Xb, Cb, 1.0),
                 lambda: fastanneal.value_and_grad(Xb, Cb.astype(np.float64), 1.0),
                 lambda: km.predict(Xb),
                 lambda: fastanneal.MiniBatchAnnealedKMeans(3, batch_size=64).fit(Xb)):
        with pytest.raises(ValueError, match=word) as e:
            call()
        assert "rescale" in str(e.value)


def test_range_check_in_the_command(capsys, tmp_path):
    Xb, _ = _blobs(np.float32, 1e19)
    table = pa.table({"query": [f"q{i}" for i in range(Xb.shape[0])],
                      "emb": pa.FixedSizeListArray.from_arrays(pa.array(Xb.ravel()), 4)})
    src = write_any(table, tmp_path / "big.parquet")
    rc, _, err = run(capsys, "cluster", src, "-o", tmp_path / "r.csv", "--k", 3,
                     "--embedding-column", "emb", "--metric", "euclidean")
    assert_one_line_error(rc, err, "cannot cluster", "too large", "rescale")
    assert not (tmp_path / "r.csv").exists()


def test_range_check_on_dask_chunks_and_init():
    da = pytest.importorskip("dask.array")
    Xb, _ = _blobs(np.float32, 1e19)
    with pytest.raises(ValueError, match="chunk 1.*too large"):
        fastanneal.AnnealedKMeans(3, backend="dask").fit(
            da.from_array(np.vstack([Xb[:100] / 1e6, Xb[100:]]), chunks=(100, 4)))
    Xg, _ = _blobs(np.float64, 1.0)
    with pytest.raises(ValueError, match="init array.*too large"):
        fastanneal.AnnealedKMeans(3, init=np.full((3, 4), 1e100)).fit(Xg)


def test_cosine_accepts_huge_rows():
    """Cosine normalizes each row: magnitudes that overflow a squared norm are fine."""
    Xg, lab = _blobs(np.float64, 1.0)
    km = fastanneal.AnnealedKMeans(3, metric="cosine", random_state=0).fit(Xg)
    Xh = Xg * 1e200
    assert np.isinf(np.einsum("ij,ij->i", Xh, Xh)).all()
    kh = fastanneal.AnnealedKMeans(3, metric="cosine", random_state=0).fit(Xh)
    np.testing.assert_allclose(kh.cluster_centers_, km.cluster_centers_, rtol=1e-9, atol=1e-12)


def test_sparse_input_is_named():
    sp = pytest.importorskip("scipy.sparse")
    X = sp.random(40, 6, density=0.5, format="csr", random_state=0)
    C = np.ones((2, 6))
    for call in (lambda: fastanneal.moments(X, C, 1.0),
                 lambda: fastanneal.value_and_grad(X, C, 1.0),
                 lambda: fastanneal.moments(np.ones((4, 6)), sp.csr_matrix(C), 1.0)):
        with pytest.raises(TypeError, match="sparse.*toarray"):
            call()
    for est in (fastanneal.AnnealedKMeans(2), fastanneal.MiniBatchAnnealedKMeans(2)):
        with pytest.raises(TypeError, match="(?i)sparse.*toarray"):
            est.fit(X)


# =========================================================================== 5. files from disk
def _bad_caches(n):
    rng = np.random.default_rng(0)
    good = rng.normal(size=(n, 16)).astype(np.float32)
    nan = good.copy()
    nan[3, 2] = np.nan
    zero = good.copy()
    zero[4] = 0
    return {"nan": nan, "zero row": zero, "wrong rows": good[:-1], "wrong dtype":
            good.astype(np.float64), "1-D": good[:, 0].copy(), "object": np.array(
                [{"a": 1}] * n, dtype=object), "garbage": b"\x93NUMPY garbage"}


@pytest.mark.parametrize("case", list(_bad_caches(8)))
def test_bad_embedding_cache_is_named_and_recomputed(capsys, tmp_path, monkeypatch, case):
    table, _, _ = make_table(n=80)
    src = tmp_path / "q.csv"
    pacsv.write_csv(pa.table({"query": table.column("query")}), src)
    out = tmp_path / "o" / "r.parquet"
    out.parent.mkdir()
    monkeypatch.setattr(cli, "_load_embedder", FakeEmbedder())
    argv = ["cluster", src, "-o", out, "--k", 3, "--steps", 4]
    rc, _, err = run(capsys, *argv)
    assert rc == 0, err
    first = pq.read_table(out)
    cache = out.with_name("r.embeddings.npy")
    bad = _bad_caches(80)[case]
    if isinstance(bad, bytes):
        cache.write_bytes(bad)
    else:
        np.save(cache, bad, allow_pickle=True)
    fake = FakeEmbedder()
    monkeypatch.setattr(cli, "_load_embedder", fake)
    rc, _, err = run(capsys, *argv)
    assert rc == 0, err
    assert f"ignoring the embedding cache {cache}" in err and "Traceback" not in err
    assert fake.calls > 0                                       # recomputed
    assert pq.read_table(out).equals(first)
    E = np.load(cache, allow_pickle=False)                      # and replaced by a good one
    assert E.dtype == np.float32 and E.shape == (80, 16) and np.isfinite(E).all()


def test_bad_embedding_cache_key_and_part_files(capsys, tmp_path, monkeypatch):
    table, _, _ = make_table(n=90)
    src = tmp_path / "q.csv"
    pacsv.write_csv(pa.table({"query": table.column("query")}), src)
    out = tmp_path / "r.parquet"
    ck = tmp_path / "ck"
    monkeypatch.setattr(cli, "EMBED_CHUNK", 40)
    monkeypatch.setattr(cli, "_load_embedder", FakeEmbedder(fail_after=2))
    argv = ["cluster", src, "-o", out, "--k", 3, "--steps", 4, "--checkpoint", ck]
    rc, _, _ = run(capsys, *argv)
    assert rc == 130
    parts = sorted(ck.glob("embed-*/*.npy"))
    assert len(parts) == 2
    np.save(parts[1], np.full((40, 16), np.nan, np.float32))   # a corrupted part file
    out.with_name("r.embeddings.json").write_text("{not json")
    fake = FakeEmbedder()
    monkeypatch.setattr(cli, "_load_embedder", fake)
    rc, _, err = run(capsys, *argv)
    assert rc == 0, err
    assert f"ignoring the embedding checkpoint {parts[1]}" in err
    assert "ignoring the embedding cache key" in err
    assert fake.rows == 90 - 40                                 # part 0 reused, part 1 redone


def test_checkpoint_with_nan_centers_is_named(tmp_path):
    from fastanneal._checkpoint import CheckpointWarning
    X, _ = _blobs(np.float64, 10.0)
    ck = tmp_path / "ck"
    a = fastanneal.AnnealedKMeans(3, random_state=0, checkpoint=ck, n_steps=5).fit(X)
    f = ck / "anneal.npz"
    with np.load(f, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["centers"] = np.full_like(arrays["centers"], np.nan)
    from fastanneal._checkpoint import _digest     # a file whose checksum holds: the field check
    arrays["checksum"] = np.array(_digest(str(arrays["meta"]), arrays))
    with open(f, "wb") as fh:
        np.savez(fh, **arrays)
    with pytest.warns(CheckpointWarning, match=str(f).replace("\\", "\\\\") + ".*(NaN|finite)"):
        b = fastanneal.AnnealedKMeans(3, random_state=0, checkpoint=ck, n_steps=5).fit(X)
    np.testing.assert_allclose(b.cluster_centers_, a.cluster_centers_)


# =========================================================================== 7. temporaries
def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temporaries_are_removed_live_ones_kept(capsys, tmp_path, inp):
    table, d = inp
    src = write_any(table, d / "q.parquet")
    out = tmp_path / "o" / "r.csv"
    out.parent.mkdir()
    pre = temp_prefix(out)                       # this host, this pid
    host_pid = pre[len(f".{out.name}."):-1]
    host = host_pid.rsplit("-", 1)[0]
    stale = out.parent / f".{out.name}.{host}-{_dead_pid()}.abcd1234.tmp"
    stale.write_text("half a file")
    stale_dir = out.parent / f".{out.name}.{host}-{_dead_pid()}.ef.tmpdir"
    stale_dir.mkdir()
    (stale_dir / "part").write_text("x")
    live = out.parent / f".{out.name}.{host}-{os.getppid()}.live.tmp"      # a running process
    live.write_text("in use")
    other = out.parent / f".{out.name}.otherhost-{_dead_pid()}.x.tmp"     # another machine's
    other.write_text("not ours")
    rc, _, err = run(capsys, "cluster", src, "-o", out, "--embedding-column", "emb", "--k", 2,
                     "-q")
    assert rc == 0, err
    left = sorted(os.listdir(out.parent))
    assert left == sorted(["r.csv", "r.clusters.csv", live.name, other.name])
    assert clean_stale_temps(out) == []


def test_labels_folder_writer_cleans_stale_temporaries(tmp_path):
    """The mini-batch labels writer (an output folder) uses the same temporary naming: a
    dead run's ``.tmpdir`` is removed when the next run starts writing the same folder."""
    pytest.importorskip("dask")
    from fastanneal.dask._minibatch import _AtomicFolder
    target = tmp_path / "labels"
    host = temp_prefix(target)[len(".labels."):-1].rsplit("-", 1)[0]
    stale = tmp_path / f".labels.{host}-{_dead_pid()}.abc.tmpdir"
    stale.mkdir()
    (stale / "part-000000.parquet").write_bytes(b"half")
    folder = _AtomicFolder(target)
    assert not stale.exists() and Path(folder.tmp).is_dir()
    (Path(folder.tmp) / "part-000000.parquet").write_bytes(b"done")
    folder.commit()
    assert sorted(os.listdir(tmp_path)) == ["labels"]
    assert os.listdir(target) == ["part-000000.parquet"]


def test_output_moved_aside_by_a_dead_run_is_put_back(tmp_path):
    """A run that died between the two renames of ``_AtomicFolder.commit`` (the previous
    labels moved to ``...-old.tmpdir``, its own not yet in place) left no output: the next
    writer puts the previous one back instead of deleting it as a stale temporary (it did:
    a later failing run then lost the labels); with the output present, the old copy is
    garbage and removed."""
    pytest.importorskip("dask")
    from fastanneal.dask._minibatch import _AtomicFolder
    target = tmp_path / "labels"
    host = temp_prefix(target)[len(".labels."):-1].rsplit("-", 1)[0]
    pid = _dead_pid()
    aside = tmp_path / f".labels.{host}-{pid}.abc-old.tmpdir"
    aside.mkdir()
    (aside / "part-000000.parquet").write_bytes(b"previous labels")
    half = tmp_path / f".labels.{host}-{pid}.abc.tmpdir"        # its unfinished new output
    half.mkdir()
    folder = _AtomicFolder(target, overwrite=True)            # the next run starts writing
    assert (target / "part-000000.parquet").read_bytes() == b"previous labels"
    assert not aside.exists() and not half.exists()
    folder.abort()                                            # ... and fails: nothing lost
    assert (target / "part-000000.parquet").read_bytes() == b"previous labels"
    # without overwrite: the put-back output is the existing output it refuses to replace
    shutil.move(target, aside)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        _AtomicFolder(target)
    assert (target / "part-000000.parquet").read_bytes() == b"previous labels"
    # the output in place: a moved-aside copy is stale and goes
    aside.mkdir()
    (aside / "x").write_text("old")
    assert clean_stale_temps(target) == [aside]
    assert sorted(os.listdir(tmp_path)) == ["labels"]


@pytest.mark.parametrize("data, chunk, where", [
    (b"query,emb\n\"a\",\"[1,2]\"\n\xc2", 1 << 20,
     "byte 0xc2 at offset 22, line 3; the file ends inside a character"),
    (b"\xc2", 1 << 20, "byte 0xc2 at offset 0, line 1; the file ends inside a character"),
    (b"ab\nxxxxx\xc3(\n", 6, "byte 0xc3 at offset 8, line 2)"),
    (b"abcde\xc3(\n", 6, "byte 0xc3 at offset 5, line 1)"),       # held across two reads
])
def test_invalid_utf8_is_located_also_at_the_end_and_across_reads(tmp_path, data, chunk,
                                                                  where):
    """A file ending inside a character (the decoder holds its first byte until the end)
    crashed the message with an IndexError; a character cut by a read boundary is located
    where it starts."""
    from fastanneal._io import _check_utf8
    p = tmp_path / "in.csv"
    p.write_bytes(data)
    with pytest.raises(InputError, match=re.escape(where)):
        _check_utf8(p, chunk=chunk)
    p.write_bytes("é".encode() * 10)
    assert _check_utf8(p, chunk=3) is None


def _signalled_during_the_write(tmp_path, inp, sig):
    """``fastanneal cluster`` in a subprocess that sends itself ``sig`` right after the
    first output file is written; returns ``(process, src, out)``."""
    table, d = inp
    src = write_any(table, d / "q.parquet")
    out = tmp_path / "o" / "r.parquet"
    out.parent.mkdir()
    code = f"""
import os, signal, sys
from fastanneal import cli
real = cli.write_table
def dying(table, path, fmt=None, verbatim=()):
    real(table, path, fmt, verbatim)
    os.kill(os.getpid(), {int(sig)})
cli.write_table = dying
sys.exit(cli.main({[ 'cluster', str(src), '-o', str(out), '--embedding-column', 'emb',
                    '--k', '2', '-q']!r}))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return p, src, out


def test_sigkill_during_the_final_write_is_cleaned_by_the_rerun(tmp_path, inp):
    p, src, out = _signalled_during_the_write(tmp_path, inp, signal.SIGKILL)
    assert p.returncode == -signal.SIGKILL, p.stderr
    hidden = [f for f in os.listdir(out.parent) if f.startswith(".")]
    assert hidden and not out.exists()           # the kill left a partial temporary
    p = _run_cli_subprocess(["cluster", src, "-o", out, "--embedding-column", "emb", "--k", 2,
                             "-q"])
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(out.parent)) == ["r.clusters.csv", "r.parquet"]


# =========================================================================== 7. CSV formulas
HOSTILE = ["=HYPERLINK(\"http://x\",\"click\")", "+cmd|' /C calc'!A0", "-2+3", "@SUM(A1:A2)",
           "\t=1+1", "\r=1+1", "-1.5", "+3e-4", "plain query", "a=b", "-"]


@pytest.mark.parametrize("ext", [".csv", ".tsv", ".parquet"])
def test_spreadsheet_formulas_are_neutralised(capsys, tmp_path, ext):
    # (a TSV cannot hold a tab or a line break: those cells are refused there, see
    # test_tsv_output_is_linear_and_refuses_what_tsv_cannot_hold)
    hostile = [h for h in HOSTILE if ext != ".tsv" or not any(c in h for c in "\t\r\n")]
    n = len(hostile) * 6
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, 3)).astype(np.float32)
    queries = [hostile[i % len(hostile)] for i in range(n)]
    table = pa.table({"query": queries, "note": queries,
                      "emb": pa.FixedSizeListArray.from_arrays(pa.array(X.ravel()), 3)})
    src = tmp_path / "q.parquet"
    pq.write_table(table, src)
    out = tmp_path / f"r{ext}"
    rc, _, err = run(capsys, "cluster", src, "-o", out, "--embedding-column", "emb", "--k", n,
                     "-q")
    assert rc == 0, err
    dangerous = {q for q in hostile if q[0] in "=+-@\t\r" and q not in ("-1.5", "+3e-4")}
    if ext == ".parquet":
        got = pq.read_table(out).column("note").to_pylist()
        assert got == queries                    # a typed format keeps the text verbatim
    else:
        got = pacsv.read_csv(out, parse_options=pacsv.ParseOptions(
            delimiter="\t" if ext == ".tsv" else ",", newlines_in_values=True),
            convert_options=pacsv.ConvertOptions(column_types={"note": pa.string(),
                                                               "query": pa.string()}))
        for q, cell in zip(queries, got.column("note").to_pylist()):
            assert cell == ("'" + q if q in dangerous else q), (q, cell)
    ctab = pacsv.read_csv(out.with_name(out.stem + ".clusters.csv"),
                          parse_options=pacsv.ParseOptions(newlines_in_values=True),
                          convert_options=pacsv.ConvertOptions(
                              column_types={"central_query": pa.string()}))
    for cell in ctab.column("central_query").to_pylist():
        assert not (cell[0] in "=+-@\t\r" and cell not in ("-1.5", "+3e-4", "-")) \
            or cell.startswith("'"), cell
    assert any(c.startswith("'") for c in ctab.column("central_query").to_pylist())


# =========================================================================== 7. Parquet checksums
def _corrupt_parquet(path, n=4000):
    X = np.arange(n, dtype=np.float64) + 0.123
    emb = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(X, 2)), 2)
    pq.write_table(pa.table({"query": [f"q{i}" for i in range(n)], "emb": emb}), path,
                   compression="none", write_page_checksum=True, use_dictionary=False)
    b = bytearray(path.read_bytes())
    i = b.find(np.float64(X[n // 2]).tobytes())
    assert i > 0
    b[i + 3] ^= 0xFF                                  # one flipped byte inside a data page
    path.write_bytes(bytes(b))
    return path


def test_parquet_page_checksums_are_verified(capsys, tmp_path):
    src = _corrupt_parquet(tmp_path / "bad.parquet")
    assert pq.read_table(src).num_rows == 4000       # unchecked, the damage goes unnoticed
    rc, _, err = run(capsys, "cluster", src, "-o", tmp_path / "r.csv", "--k", 2,
                     "--embedding-column", "emb")
    assert_one_line_error(rc, err, "bad.parquet", "checksum")
    ds = tmp_path / "ds"
    ds.mkdir()
    os.replace(src, ds / "part-0.parquet")
    rc, _, err = run(capsys, "cluster", ds, "-o", tmp_path / "r.csv", "--k", 2,
                     "--embedding-column", "emb")
    assert_one_line_error(rc, err, "checksum")
    pytest.importorskip("dask")
    from fastanneal.dask import read_parquet_embeddings
    X, _, _ = read_parquet_embeddings(ds, column="emb")
    with pytest.raises(OSError, match="part-0.parquet.*checksum"):
        X.compute(scheduler="sync")
    assert not (tmp_path / "r.csv").exists()


# =========================================================================== 9. random bad input
def _hypothesis():
    return pytest.importorskip("hypothesis")


def test_random_bad_files_exit_2_and_leave_the_input(tmp_path_factory):
    hyp = _hypothesis()
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    header = st.sampled_from(["query,emb\n", "query\temb\n", "emb\n", "query,emb,emb\n", "",
                              "\ufeffquery,emb\n", "query,weight,emb\n"])
    cell = st.one_of(st.text(max_size=12), st.sampled_from(
        ["[1, 2]", "[1, nan]", "[inf, 0]", "[1e400, 1]", "[]", "[1, 2, 3]", "\"[1,\n2]\"",
         "=cmd()", "-1", "NaN", "\x00", "1e39", "[3.0e38, 3.0e38]"]))
    row = st.lists(cell, min_size=0, max_size=4).map(lambda cs: ",".join(cs) + "\n")
    body = st.lists(row, max_size=6).map("".join)
    raw = st.binary(max_size=64)
    ext = st.sampled_from([".csv", ".tsv", ".jsonl", ".parquet", ".csv.gz"])

    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(header=header, body=body, raw=raw, ext=ext, use_raw=st.booleans(),
           k=st.integers(min_value=-1, max_value=5))
    def check(header, body, raw, ext, use_raw, k):
        d = tmp_path_factory.mktemp("bad")
        src = d / f"in{ext}"
        data = raw if use_raw else (header + body).encode("utf-8", "surrogatepass")
        src.write_bytes(data)
        before = digest(src)
        out = d / "out" / "r.csv"
        out.parent.mkdir()
        try:
            rc = cli.main(["cluster", str(src), "-o", str(out), "--embedding-column", "emb",
                           "--k", str(k), "-q"])
        except BaseException as e:              # noqa: BLE001 - must never escape
            pytest.fail(f"{type(e).__name__} escaped main(): {e!r} for {data!r}")
        assert digest(src) == before
        if rc == 0:                              # a valid file by chance: outputs complete
            assert sorted(os.listdir(out.parent)) == ["r.clusters.csv", "r.csv"]
        else:
            assert rc == 2, (rc, data)
            assert os.listdir(out.parent) == [], data
        # the readers alone: InputError (a ValueError) or a table
        try:
            t = read_table(src)
            from fastanneal._io import embedding_matrix
            embedding_matrix(t, "emb", src)
        except InputError:
            pass
    check()


# =========================================================================== 8. odd column types
def _with(table, name, col):
    return table.append_column(name, col) if name not in table.column_names else \
        table.set_column(table.column_names.index(name), name, col)


@pytest.mark.parametrize("ext", [".csv", ".tsv"])
def test_struct_and_map_columns_are_written_to_text_outputs(capsys, inp, tmp_path, ext):
    table, d = inp
    n = table.num_rows
    t = _with(table, "meta", pa.array([{"a": i, "b": str(i)} for i in range(n)]))
    t = _with(t, "tags", pa.array([[("k", i)] for i in range(n)],
                                  type=pa.map_(pa.string(), pa.int64())))
    src = write_any(t, d / "q.parquet")
    out = tmp_path / f"r{ext}"
    rc, _, err = run(capsys, "cluster", src, "-o", out, "--embedding-column", "emb", "--k", 4,
                     "-q")
    assert rc == 0, err
    back = read_any(out)
    assert back.num_rows == n
    import json
    metas = [json.loads(v) for v in back.column("meta").to_pylist()]
    assert metas[7] == {"a": 7, "b": "7"}
    assert "k" in str(back.column("tags")[7])


@pytest.mark.parametrize("memory_limit", [None, "1K"])
def test_categorical_ids_work_and_nested_ids_are_refused(capsys, inp, tmp_path, memory_limit):
    table, d = inp
    n = table.num_rows
    extra = [] if memory_limit is None else ["--memory-limit", memory_limit]
    cat = pa.array([f"id{i}" for i in range(n)]).dictionary_encode()
    src = write_any(_with(table, "cid", cat), d / "cat.parquet")
    out = tmp_path / "r.parquet"
    rc, _, err = run(capsys, "cluster", src, "-o", out, "--embedding-column", "emb", "--k", 4,
                     "--id-column", "cid", "-q", *extra)
    assert rc == 0, err
    assert pq.read_table(out).num_rows == n
    for name, col in (("lid", pa.array([[i] for i in range(n)])),
                      ("sid", pa.array([{"a": i} for i in range(n)]))):
        src = write_any(_with(table, name, col), d / f"{name}.parquet")
        rc, _, err = run(capsys, "cluster", src, "-o", tmp_path / f"{name}.parquet",
                         "--embedding-column", "emb", "--k", 4, "--id-column", name, "-q",
                         *extra)
        assert_one_line_error(rc, err, "id column", "single values")


@pytest.mark.parametrize("memory_limit", [None, "1K"])
def test_weights_read_alike_in_memory_and_out_of_core(capsys, inp, tmp_path, memory_limit):
    """Numeric strings and decimals are weights on both routes; integers beyond 2^53 are
    weights too; a total beyond float64 is refused with its reason."""
    import decimal
    table, d = inp
    n = table.num_rows
    extra = [] if memory_limit is None else ["--memory-limit", memory_limit]
    counts = [1 + i % 7 for i in range(n)]
    labels = {}
    for name, col in (("int", pa.array(counts, pa.int64())),
                      ("str", pa.array([str(c) for c in counts])),
                      ("dec", pa.array([decimal.Decimal(c) for c in counts],
                                       pa.decimal128(10, 2))),
                      ("u64", pa.array([c * 2 ** 60 for c in counts], pa.uint64()))):
        src = write_any(_with(table, "w", col), d / f"{name}.parquet")
        out = tmp_path / f"{name}.parquet"
        rc, _, err = run(capsys, "cluster", src, "-o", out, "--embedding-column", "emb",
                         "--k", 4, "--weight-column", "w", "-q", *extra)
        assert rc == 0, (name, err)
        labels[name] = pq.read_table(out).column("cluster").to_numpy()
    # scaled weights (u64: every count times 2^60) give the same partition
    for name in ("str", "dec", "u64"):
        assert adjusted_rand(labels["int"], labels[name]) == 1.0, name
    src = write_any(_with(table, "w", pa.array([1e308] * n)), d / "huge.parquet")
    rc, _, err = run(capsys, "cluster", src, "-o", tmp_path / "h.parquet",
                     "--embedding-column", "emb", "--k", 4, "--weight-column", "w", "-q",
                     *extra)
    assert_one_line_error(rc, err, "weight column", "rescale")


def adjusted_rand(a, b):
    from sklearn.metrics import adjusted_rand_score
    return adjusted_rand_score(a, b)


def test_cosine_rows_near_the_top_of_float32_are_not_zero(capsys, inp, tmp_path):
    table, d = inp
    X = np.asarray(table.column("emb").to_pylist(), dtype=np.float32)
    X[3] = np.float32(3e38)                    # finite; its norm is beyond float32
    t = _with(table, "emb", pa.FixedSizeListArray.from_arrays(pa.array(X.ravel()),
                                                               X.shape[1]))
    src = write_any(t, d / "big.parquet")
    rc, _, err = run(capsys, "cluster", src, "-o", tmp_path / "r.parquet", "--embedding-column",
                     "emb", "--k", 4, "-q")
    assert rc == 0 and "Warning" not in err, err
    U = fastanneal._validation.normalize_rows(X)
    assert np.isfinite(U).all() and np.allclose(np.linalg.norm(U[3]), 1.0, atol=1e-6)


def test_sigterm_leaves_no_temporary_output(tmp_path, inp):
    """SIGTERM while the outputs are written: the command cleans up like Ctrl-C (exit 143),
    no partial hidden file, no output."""
    p, _, out = _signalled_during_the_write(tmp_path, inp, signal.SIGTERM)
    assert p.returncode == 143, p.stderr
    assert "terminated" in p.stderr
    assert os.listdir(out.parent) == []


def test_a_scheduler_without_workers_is_one_line_before_reading(tmp_path, inp):
    """``--scheduler`` pointing at a scheduler that has no workers: one line naming it (and
    the variable that waits longer), exit 2, no output, before the log is read."""
    distributed = pytest.importorskip("distributed")
    table, d = inp
    src = write_any(table, d / "q.parquet")
    cluster = distributed.LocalCluster(n_workers=0, processes=False, protocol="tcp",
                                       host="127.0.0.1", dashboard_address=None)
    try:
        env = dict(os.environ, FASTANNEAL_CONNECT_TIMEOUT="5", FASTANNEAL_WORKER_TIMEOUT="1")
        p = subprocess.run([sys.executable, "-m", "fastanneal", "cluster", str(src), "-o",
                            str(tmp_path / "r.csv"), "--k", "2", "--embedding-column", "emb",
                            "--backend", "dask", "--scheduler", cluster.scheduler_address],
                           capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    finally:
        cluster.close()
    assert_one_line_error(p.returncode, p.stderr, "--scheduler", "has no workers",
                          "FASTANNEAL_WORKER_TIMEOUT")
    assert "reading" not in p.stderr
    assert not (tmp_path / "r.csv").exists()


def test_tsv_is_linear_quotes_are_text_and_no_row_is_merged(capsys, tmp_path):
    """A TSV query log with phrase searches: a query that starts with a double quote must
    not open a quoted cell (it swallowed the lines up to the next quote: 3 rows lost and
    one row clustered with another's embedding, exit 0), and quotes come back as written."""
    rng = np.random.default_rng(0)
    n = 60
    X = rng.normal(size=(n, 4)) + np.repeat(np.eye(4)[:2] * 6, n // 2, axis=0)
    queries = [f"query {i}" for i in range(n)]
    queries[31], queries[34], queries[40] = '"iphone 15 case', 'tv 55"', '"best laptops" 2024'
    lines = ["id\tquery\temb"] + [
        f"r{i}\t{q}\t[{', '.join(repr(float(v)) for v in X[i])}]" for i, q in enumerate(queries)]
    src = tmp_path / "log.tsv"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.tsv"
    rc, _, err = run(capsys, "cluster", src, "-o", out, "--embedding-column", "emb",
                     "--id-column", "id", "--k", 2, "-q")
    assert rc == 0, err
    body = out.read_text(encoding="utf-8").splitlines()
    head = body[0].split("\t")
    rows = [ln.split("\t") for ln in body[1:]]
    assert len(rows) == n
    ids = [r[head.index("id")] for r in rows]
    got = [r[head.index("query")] for r in rows]
    assert ids == [f"r{i}" for i in range(n)]
    assert got == queries                                   # quotes are text, verbatim
    lab = np.array([int(r[head.index("cluster")]) for r in rows])
    assert len(set(lab[:30])) == 1 and len(set(lab[30:])) == 1 and lab[0] != lab[59]


def test_tsv_output_is_linear_and_refuses_what_tsv_cannot_hold(tmp_path):
    """TSV outputs: text as it is (quotes included), one line a row, every column type (a
    large_string column -- polars' default -- crashed the join); a cell holding a tab or a
    line break is refused with its column and row (a quoted cell made a file that the
    linear reader, ours included, cannot read back). Quoted TSVs (every header cell in
    double quotes: Arrow's CSV writer with a tab delimiter) are still read as quoted."""
    from fastanneal._io import read_table, write_table
    t = pa.table({"q": pa.array(['a "b"', '"open', None, "plain"], pa.large_string()),
                  "x": [1.5, 2.0, None, -0.25],
                  "c": pa.array(["u", "v", "u", "v"]).dictionary_encode(),
                  "n": pa.chunked_array([[1, 2], [3, 4]])})
    p = tmp_path / "o.tsv"
    write_table(t, p)
    assert p.read_bytes() == (b'q\tx\tc\tn\na "b"\t1.5\tu\t1\n"open\t2\tv\t2\n'
                              b'\t\tu\t3\nplain\t-0.25\tv\t4\n')
    back = read_table(p)
    assert back.column("q").to_pylist() == ['a "b"', '"open', "", "plain"]
    assert back.column("n").to_pylist() == ["1", "2", "3", "4"]
    for cell in ("tab\there", "line\nbreak", "cr\rhere"):
        bad = pa.table({"id": ["a", "b", "c"], "q": ["ok", "ok", cell]})
        with pytest.raises(InputError, match="column 'q', row 3: a tab or line break"):
            write_table(bad, tmp_path / "bad.tsv")
    quoted = tmp_path / "quoted.tsv"             # every cell quoted, as Arrow writes TSV
    pacsv.write_csv(pa.table({"q": ['say "hi"', "two\tparts"], "x": ["1", "2"]}), quoted,
                    write_options=pacsv.WriteOptions(delimiter="\t"))
    assert read_table(quoted).column("q").to_pylist() == ['say "hi"', "two\tparts"]


@pytest.mark.parametrize("ext", [".csv", ".tsv"])
@pytest.mark.parametrize("memory_limit", [None, "1K"])
def test_ids_are_written_verbatim_so_outputs_join_back(capsys, tmp_path, ext, memory_limit):
    """The formula guard leaves the id column (and central_id) alone: '-a0' came back as
    "'-a0", so a join of the output to its input by id silently lost those rows."""
    rng = np.random.default_rng(0)
    n = 40
    X = (rng.normal(size=(n, 4)) + np.repeat(np.eye(4)[:2] * 6, n // 2, axis=0)
         ).astype(np.float32)
    ids = [("-a", "+33 ", "@u", "=x")[i % 4] + str(i) for i in range(n)]
    table = pa.table({"id": ids, "query": ids,
                      "emb": pa.FixedSizeListArray.from_arrays(pa.array(X.ravel()), 4)})
    src = tmp_path / "q.parquet"
    pq.write_table(table, src)
    out = tmp_path / f"r{ext}"
    extra = [] if memory_limit is None else ["--memory-limit", memory_limit]
    rc, _, err = run(capsys, "cluster", src, "-o", out, "--embedding-column", "emb",
                     "--id-column", "id", "--text-column", "query", "--k", 2, "-q", *extra)
    assert rc == 0, err
    back = read_any(out)
    assert [str(v) for v in back.column("id").to_pylist()] == ids
    assert all(q.startswith("'") for q in back.column("query").to_pylist())   # still guarded
    ctab = pacsv.read_csv(out.with_name(out.stem + ".clusters.csv"),
                          convert_options=pacsv.ConvertOptions(
                              column_types={"central_id": pa.string()}))
    assert set(ctab.column("central_id").to_pylist()) <= set(ids)


def test_nan_and_none_ids_are_missing_values(tmp_path):
    """NaN != NaN let two NaN ids through the duplicate check; QueryClusters took None."""
    from fastanneal._io import check_ids
    t = pa.table({"id": [1.0, float("nan"), 3.0, float("nan")]})
    with pytest.raises(InputError, match="missing value at row 2"):
        check_ids(t, "id", "f.parquet")
    X = np.random.default_rng(0).normal(size=(6, 3))
    pd = pytest.importorskip("pandas")
    for bad in ([1, 2, None, 4, 5, 6], [1.0, 2.0, float("nan"), 4.0, 5.0, 6.0],
                list(np.array([1, 2, np.nan, 4, 5, 6], np.float32)), [1, 2, pd.NA, 4, 5, 6],
                [1, 2, np.datetime64("NaT"), 4, 5, 6]):
        with pytest.raises(ValueError, match="ids have a missing value .* at row 2"):
            fastanneal.QueryClusters(2).fit(embeddings=X, ids=bad)


def test_weight_cells_with_spaces_are_numbers_and_bad_ones_are_named():
    from fastanneal._io import weight_vector
    t = pa.table({"w": [" 5", "2 ", "1.5"]})
    np.testing.assert_array_equal(weight_vector(t, "w", "f.csv"), [5.0, 2.0, 1.5])
    with pytest.raises(InputError, match=r"not numeric \(row 2: '1_000'\)"):
        weight_vector(pa.table({"w": ["1", "1_000", "2"]}), "w", "f.csv")


def test_csv_blank_lines_unclosed_quotes_and_json_ids_lose_nothing(tmp_path, capsys):
    """Rows in = rows out, ids exact (all found by a review): an unpaired quote in a
    one-column CSV took every line after it into one cell; JSONL ids of 2^53 or more were
    read as float64 and rounded (written off by one, or two ids made one); uint64 ids from
    2^63 up crashed the clusters table ("Python int too large") and QueryClusters (a bare
    StopIteration). Blank lines hold no row (skipped, as Arrow and pandas do; README), also
    before the header and at the end; a gzipped CSV ending in a quoted multi-line cell, or
    one with a space after its closing quote, is no unclosed quote."""
    import gzip
    for name, text in (("blank.csv", "query\nhello there\n\nbye now\nfoo bar\n\n\n"),
                       ("lead.csv", "\nquery\nhello there\nbye now\nfoo bar\n"),
                       ("blank.tsv", "query\nhello there\n\nbye now\nfoo bar\n")):
        (tmp_path / name).write_text(text)
        assert read_table(tmp_path / name).column("query").to_pylist() == [
            "hello there", "bye now", "foo bar"]
    two = tmp_path / "two.csv"
    two.write_text("\nquery,n\na,1\n\nb,2\n\n")
    assert read_table(two).num_rows == 2
    gz = tmp_path / "multi.csv.gz"
    gz.write_bytes(gzip.compress(b'id,query\n1,a\n2,"multi\nline"\n'))
    assert read_table(gz).column("query").to_pylist() == ["a", "multi\nline"]
    sp = tmp_path / "space.csv"
    sp.write_text('id,query\n1,a\n2,"multi\nline" \n')
    assert read_table(sp).num_rows == 2
    stray = tmp_path / "stray.csv"
    stray.write_text("query\n" + "".join(f"query {i}\n" if i != 9 else '"best laptops 2024\n'
                                         for i in range(40)))
    with pytest.raises(InputError, match=r"a quoted cell opened on line 11 is never closed"):
        read_table(stray)
    ok = tmp_path / "multi.csv"                    # a quoted cell over two lines is fine
    ok.write_text('query,n\n"multi\nline",1\nb,2\n')
    assert read_table(ok).column("query").to_pylist() == ["multi\nline", "b"]
    rng = np.random.default_rng(0)
    E = rng.normal(size=(20, 4))
    js = tmp_path / "ids.jsonl"
    js.write_text("".join(f'{{"id": {2 ** 53 + 1 + 1000 * i}, "e": {E[i].tolist()}}}\n'
                          for i in range(19)) + f'{{"id": 1.5, "e": {E[19].tolist()}}}\n')
    rc = cli.main(["cluster", str(js), "-o", str(tmp_path / "o.csv"), "--k", "2",
                   "--id-column", "id", "--embedding-column", "e", "--metric", "euclidean"])
    err = capsys.readouterr().err
    assert rc == 2 and "read as floating-point numbers" in err and "row 1" in err
    assert not (tmp_path / "o.csv").exists()
    big = np.arange(2 ** 64 - 20, 2 ** 64, dtype=np.uint64)
    pq.write_table(pa.table({"id": pa.array(big), "e": pa.FixedSizeListArray.from_arrays(
        pa.array(E.astype(np.float32).ravel()), 4)}), tmp_path / "u64.parquet")
    rc = cli.main(["cluster", str(tmp_path / "u64.parquet"), "-o", str(tmp_path / "u.parquet"),
                   "--k", "2", "--id-column", "id", "--embedding-column", "e", "--metric",
                   "euclidean", "-q"])
    assert rc == 0, capsys.readouterr().err
    out = pq.read_table(tmp_path / "u.parquet")
    assert out.column("id").type == pa.uint64()
    assert sorted(out.column("id").to_pylist()) == [int(v) for v in big]
    cen = pacsv.read_csv(tmp_path / "u.clusters.csv", convert_options=pacsv.ConvertOptions(
        column_types={"central_id": pa.string()})).column("central_id").to_pylist()
    assert all(int(v) in set(int(b) for b in big) for v in cen)
    qc = fastanneal.QueryClusters(n_clusters=2, metric="euclidean", random_state=0).fit(
        embeddings=E, ids=[2 ** 63 + i for i in range(20)])
    assert qc.labels_.shape == (20,)
    with pytest.raises(ValueError, match="mix negative ids with ids of 2\\^63 or more"):
        fastanneal.QueryClusters(n_clusters=2, metric="euclidean").fit(
            embeddings=E, ids=[-1] + [2 ** 63 + i for i in range(19)])
