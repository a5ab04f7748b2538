"""Known-answer clustering sets and their metrics (``benchmarks/bench_known_answers.py``).

Look-alikes of the clustering benchmark sets of Fränti & Sieranoja, "K-means properties on six
clustering benchmark datasets" (Applied Intelligence 48, 2018), generated here because the
originals are not available offline. Every set is drawn from isotropic Gaussians around KNOWN
generating centers, so a clustering can be scored by whether it found every cluster:

* ``grid100``: 10 x 10 grid of 100 clusters in 2-D, 100-200 points each (like Birch1);
* ``a20``, ``a35``, ``a50``: 20 / 35 / 50 clusters of 150 points placed at random in a square
  with a minimum separation, moderate overlap (like the A-sets A1, A2, A3);
* ``dim32``, ``dim128``, ``dim1024``: 16 well-separated clusters of 64 points in 32 / 128 /
  1024 dimensions (like the DIM-sets);
* ``unbalanced``: 3 dense clusters of 2000 points next to 5 sparse ones of 100 points in 2-D
  (like 'unbalance').

``load(name, seed)`` -> ``(X, true_centers, labels)``: X float64 (n, D) in random row order,
true_centers (K, D) the generating means, labels (n,) the generating component of each row.

Metrics:

* ``centroid_index(found, true)``: the centroid index CI (Fränti, Rezaei & Zhao, Pattern
  Recognition 2014): each center of A is mapped to its nearest center of B; ``CI_1(A -> B)`` is
  the number of centers of B that nothing maps to (orphans); ``CI = max(CI_1(found -> true),
  CI_1(true -> found))``. CI = 0: every cluster was found (one center each).
* ``relative_sse(X, centers, true_centers)``: SSE of X to its nearest found center over the SSE
  to its nearest generating center (slightly below 1 is possible: the generating centers are not
  the k-means optimum of a finite sample).

Reference method: ``random_swap_kmeans``, Fränti's random swap (Journal of Big Data 2018), the
method the paper reports as reaching CI = 0 on these sets.
"""
import numpy as np
import scipy.sparse as sp


# ---------------------------------------------------------------- generators
def _draw(rng, centers, sizes, sds):
    """Rows around ``centers`` (K, D): ``sizes[k]`` points with standard deviation ``sds[k]``
    per coordinate; returned in random row order with their component labels."""
    centers = np.asarray(centers, dtype=np.float64)
    K, D = centers.shape
    labels = np.repeat(np.arange(K), sizes)
    sds = np.broadcast_to(np.asarray(sds, dtype=np.float64), (K,))
    X = centers[labels] + sds[labels, None] * rng.standard_normal((len(labels), D))
    perm = rng.permutation(len(labels))
    return np.ascontiguousarray(X[perm]), centers, labels[perm]


def grid100(seed=0):
    """Birch1 look-alike: 100 clusters on a 10 x 10 grid of spacing 10, sd 2 (neighbours are
    5 sd apart: they touch but overlap little), 100-200 points each (about 15k rows)."""
    rng = np.random.default_rng(seed)
    g = 10.0 * np.arange(10)
    centers = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2)
    sizes = rng.integers(100, 201, size=100)
    return _draw(rng, centers, sizes, 2.0)


def _separated_uniform(rng, K, D, side, min_sep, max_tries=100_000):
    """K points uniform in [0, side]^D, each at least ``min_sep`` from all earlier ones
    (sequential rejection; the sets below use about a third of the jamming density)."""
    out = []
    for _ in range(max_tries):
        c = rng.uniform(0.0, side, D)
        if all(np.sum((c - o) ** 2) >= min_sep ** 2 for o in out):
            out.append(c)
            if len(out) == K:
                return np.array(out)
    raise RuntimeError(f"could not place {K} centers {min_sep} apart in [0, {side}]^{D}")


def a_set(K, seed=0):
    """A-set look-alike: K clusters of 150 points, sd uniform in [0.8, 1.2], centers uniform in
    a square of side ``7 sqrt(K)`` (constant density over K, as A1 -> A3) at least 4.5 apart
    (nearest neighbours about 2-3 sd from their midpoint: moderate overlap)."""
    rng = np.random.default_rng(seed)
    centers = _separated_uniform(rng, K, 2, 7.0 * np.sqrt(K), 4.5)
    return _draw(rng, centers, np.full(K, 150), rng.uniform(0.8, 1.2, K))


def dim_set(D, seed=0):
    """DIM-set look-alike: 16 clusters of 64 points (1024 rows) in D dimensions, centers
    uniform in [0, 100]^D, sd 5 per coordinate (centers about 41 / 5 = 8 cluster radii apart
    at every D: well separated)."""
    rng = np.random.default_rng(seed)
    centers = rng.uniform(0.0, 100.0, (16, D))
    return _draw(rng, centers, np.full(16, 64), 5.0)


def unbalanced(seed=0):
    """'unbalance' look-alike: 3 dense clusters (2000 points, sd 1) in a column on the left,
    5 sparse ones (100 points, sd 2) on the right (6500 rows). The true partition is the
    k-means optimum, but density-driven seeding puts extra centers into the dense clusters."""
    rng = np.random.default_rng(seed)
    centers = np.array([[0.0, 0.0], [0.0, 12.0], [0.0, 24.0],                   # dense
                        [30.0, -6.0], [30.0, 12.0], [30.0, 30.0], [48.0, 3.0], [48.0, 21.0]])
    sizes = np.array([2000] * 3 + [100] * 5)
    return _draw(rng, centers, sizes, np.array([1.0] * 3 + [2.0] * 5))


SETS = {
    "grid100": grid100,
    "a20": lambda seed=0: a_set(20, seed),
    "a35": lambda seed=0: a_set(35, seed),
    "a50": lambda seed=0: a_set(50, seed),
    "dim32": lambda seed=0: dim_set(32, seed),
    "dim128": lambda seed=0: dim_set(128, seed),
    "dim1024": lambda seed=0: dim_set(1024, seed),
    "unbalanced": unbalanced,
}
#: one line per set, for the tables and the JSON
DESCRIPTIONS = {
    "grid100": "Birch1 look-alike: 10x10 grid of 100 clusters, 100-200 points each, 2-D",
    "a20": "A1 look-alike: 20 clusters x 150 points, 2-D, moderate overlap",
    "a35": "A2 look-alike: 35 clusters x 150 points, 2-D, moderate overlap",
    "a50": "A3 look-alike: 50 clusters x 150 points, 2-D, moderate overlap",
    "dim32": "DIM032 look-alike: 16 well-separated clusters x 64 points, 32-D",
    "dim128": "DIM128 look-alike: 16 well-separated clusters x 64 points, 128-D",
    "dim1024": "DIM1024 look-alike: 16 well-separated clusters x 64 points, 1024-D",
    "unbalanced": "unbalance look-alike: 3 dense clusters x 2000 + 5 sparse x 100 points, 2-D",
}
#: number of generating clusters of each set
N_CLUSTERS = {"grid100": 100, "a20": 20, "a35": 35, "a50": 50, "dim32": 16, "dim128": 16,
              "dim1024": 16, "unbalanced": 8}


def load(name, seed=0):
    """``(X, true_centers, labels)`` of the set ``name`` (see ``SETS``), drawn from ``seed``."""
    try:
        gen = SETS[name]
    except KeyError:
        raise KeyError(f"unknown set {name!r}; known: {', '.join(SETS)}") from None
    return gen(seed)


# ---------------------------------------------------------------- metrics
def _sq_dist(X, C):
    """Squared Euclidean distances (n, K) in float64, GEMM form clipped at 0."""
    d = (X * X).sum(1)[:, None] - 2.0 * X @ C.T + (C * C).sum(1)[None, :]
    return np.maximum(d, 0.0)


def _orphans(A, B):
    """CI_1(A -> B): centers of B that no center of A has as its nearest."""
    nearest = _sq_dist(np.asarray(A, np.float64), np.asarray(B, np.float64)).argmin(1)
    return len(B) - len(np.unique(nearest))


def centroid_index(found, true):
    """Centroid index CI = max(CI_1(found -> true), CI_1(true -> found)); 0 = all found."""
    return int(max(_orphans(found, true), _orphans(true, found)))


def sse(X, centers, block=8192):
    """Sum of squared distances of the rows of X to their nearest center (float64)."""
    X = np.asarray(X, dtype=np.float64)
    C = np.asarray(centers, dtype=np.float64)
    return float(sum(_sq_dist(X[b:b + block], C).min(1).sum()
                     for b in range(0, len(X), block)))


def relative_sse(X, centers, true_centers):
    """SSE to the nearest found center / SSE to the nearest generating center."""
    return sse(X, centers) / sse(X, true_centers)


# ---------------------------------------------------------------- random swap
def _nearest(X, C):
    """Index of the nearest center of each row, in row blocks (a (block, K) distance tile of
    about 32k entries stays in cache: 2-4x faster than one (n, K) product on the 2-core
    machines)."""
    cnorm = (C * C).sum(1)
    block = max(256, 32768 // len(C))
    labels = np.empty(len(X), dtype=np.intp)
    for b in range(0, len(X), block):
        G = X[b:b + block] @ C.T
        G *= -2.0
        G += cnorm                               # ||x||^2 is common to a row: left out
        labels[b:b + block] = G.argmin(1)
    return labels


def _lloyd(X, xx, C, iters):
    """``iters`` (>= 1) Lloyd iterations from C on centered float64 X (``xx = sum ||x||^2``):
    (centers, labels, SSE), the SSE of the last partition around its own means (an empty
    cluster keeps its center)."""
    n, K = len(X), len(C)
    for _ in range(iters):
        labels = _nearest(X, C)
        onehot = sp.csr_matrix((np.ones(n), (labels, np.arange(n))), shape=(K, n))
        S = np.asarray(onehot @ X)               # per-cluster sums
        cnt = np.bincount(labels, minlength=K).astype(np.float64)
        C = np.where(cnt[:, None] > 0, S / np.maximum(cnt, 1.0)[:, None], C)
    # SSE of the partition around its means: sum ||x||^2 - sum_k ||S_k||^2 / n_k
    nz = cnt > 0
    err = float(xx - ((S[nz] ** 2).sum(1) / cnt[nz]).sum())
    return C, labels, err


def random_swap_kmeans(X, K, rng, n_swaps=2000, lloyd_iters=2):
    """Random swap clustering (Fränti, "Efficiency of random swap clustering", J. Big Data
    2018): start from K random rows; each trial replaces a random center by a random row,
    runs ``lloyd_iters`` Lloyd iterations and keeps the result only if the SSE decreased.

    Returns ``(centers (K, D), labels (n,), sse, n_accepted)``.
    """
    X = np.asarray(X, dtype=np.float64)
    mu = X.mean(0)
    Xc = X - mu                                   # centered: less cancellation in the SSE
    n, xx = len(Xc), float(np.einsum("ij,ij->", Xc, Xc))
    rng = np.random.default_rng(rng)
    C, labels, err = _lloyd(Xc, xx, Xc[rng.choice(n, K, replace=False)], lloyd_iters)
    accepted = 0
    for _ in range(int(n_swaps)):
        trial = C.copy()
        trial[rng.integers(K)] = Xc[rng.integers(n)]
        trial, t_labels, t_err = _lloyd(Xc, xx, trial, lloyd_iters)
        if t_err < err:
            C, labels, err, accepted = trial, t_labels, t_err, accepted + 1
    return C + mu, labels, err, accepted
