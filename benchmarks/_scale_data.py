"""A synthetic query log at any size, written row group by row group (bounded memory).

``make_log(path, n_rows, dim=384, n_topics=1000, seed=0)`` writes a Parquet file with the
columns ``id`` (int64), ``query`` (string), ``count`` (int64, a query frequency: Zipf-like),
``topic`` (int32, the true topic) and ``embedding`` (``fixed_size_list<float32>[dim]``, unit
vectors). Topics have unbalanced sizes (a Zipf law with exponent 0.7); a row's vector is its
topic's center plus isotropic noise, normalised (cosine similarity to the center about 0.8,
between centers about 0); its text is two or three of the topic's five words plus a common
word, so that c-TF-IDF labels have something to find. Deterministic in ``seed``.
"""
import numpy as np

COMMON = ("how", "what", "best", "near me", "cheap", "free", "online", "2026", "for kids",
          "review", "vs", "price", "open now", "how to", "meaning")


def _vocabulary(n, rng):
    cons = list("bcdfghjklmnprstvwz")
    vow = list("aeiou")
    words = set()
    while len(words) < n:
        k = int(rng.integers(2, 4))
        words.add("".join(rng.choice(cons) + rng.choice(vow) for _ in range(k)))
    return sorted(words)


def make_log(path, n_rows, dim=384, n_topics=1000, seed=0, row_group_rows=65_536,
             noise=0.75, compression="snappy"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((n_topics, dim)).astype(np.float32)
    centers /= np.linalg.norm(centers, axis=1, keepdims=True)
    p = 1.0 / np.arange(1, n_topics + 1) ** 0.7
    p = rng.permutation(p / p.sum())
    vocab = np.array(_vocabulary(5 * n_topics, rng), dtype=object).reshape(n_topics, 5)
    sigma = noise / np.sqrt(dim)
    typ = pa.list_(pa.float32(), dim)
    schema = pa.schema([("id", pa.int64()), ("query", pa.string()), ("count", pa.int64()),
                        ("topic", pa.int32()), ("embedding", typ)])
    # float vectors do not compress: the embedding column is stored uncompressed (it reads
    # about twice as fast as with snappy), the other columns with ``compression``
    comp = {"id": compression, "query": compression, "count": compression,
            "topic": compression, "embedding": "none"}
    with pq.ParquetWriter(str(path), schema, compression=comp,
                          use_dictionary=["query", "topic"]) as wr:
        for a in range(0, n_rows, row_group_rows):
            b = min(n_rows, a + row_group_rows)
            m = b - a
            r = np.random.default_rng([seed, a])
            topic = r.choice(n_topics, size=m, p=p).astype(np.int32)
            X = r.standard_normal((m, dim), dtype=np.float32)
            X *= np.float32(sigma)
            X += centers[topic]
            X /= np.linalg.norm(X, axis=1, keepdims=True)
            pick = r.integers(0, 5, size=(m, 3))
            n_words = r.integers(2, 4, size=m)
            common = r.integers(0, len(COMMON), size=m)
            words = vocab[topic[:, None], pick]
            texts = [" ".join(words[i, :n_words[i]]) + " " + COMMON[common[i]]
                     for i in range(m)]
            count = np.floor(r.pareto(1.2, size=m) + 1).astype(np.int64)
            emb = pa.FixedSizeListArray.from_arrays(pa.array(X.reshape(-1)), dim)
            wr.write_table(pa.table({"id": np.arange(a, b, dtype=np.int64), "query": texts,
                                     "count": count, "topic": topic, "embedding": emb},
                                    schema=schema), row_group_size=row_group_rows)
    return centers
