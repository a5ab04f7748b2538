"""Input checks shared by every entry point: each failure names the problem."""
import math
import numbers

import numpy as np

METRICS = {"euclidean": 0, "sqeuclidean": 0, "cosine": 1}
RESPONSIBILITIES = {"softmax": 0, "entmax15": 1, "hard": 2}


def metric_code(metric):
    try:
        return METRICS[metric]
    except (KeyError, TypeError):
        raise ValueError(f"metric must be one of 'euclidean', 'cosine'; got {metric!r}") from None


def resp_code(responsibilities):
    try:
        return RESPONSIBILITIES[responsibilities]
    except (KeyError, TypeError):
        raise ValueError("responsibilities must be one of 'softmax', 'entmax15', 'hard'; "
                         f"got {responsibilities!r}") from None


def is_sparse(X):
    """A SciPy sparse matrix / array (or a pydata ``sparse`` array), without importing SciPy."""
    mod = type(X).__module__ or ""
    return mod.startswith(("scipy.sparse", "sparse")) and hasattr(X, "nnz")


def check_not_sparse(X, name="X"):
    if is_sparse(X):
        raise TypeError(f"{name} is a sparse matrix ({type(X).__name__}); fastanneal clusters "
                        "dense embeddings: convert with X.toarray() (or reduce the dimension "
                        "first, e.g. TruncatedSVD)")


def float_dtype_of(dt):
    """The working dtype of an input dtype: float32 stays float32 (big-endian ``>f4`` too,
    in native byte order), everything else becomes float64."""
    dt = np.dtype(dt)
    return np.dtype(np.float32) if dt.kind == "f" and dt.itemsize == 4 \
        else np.dtype(np.float64)


def as_float_matrix(X, name="X", dtype=None, allow_empty=True, finite=True):
    """Return X as a C-contiguous float32/float64 2-D array (float32 stays float32; other
    dtypes become float64), after checking shape and (``finite``) finiteness."""
    if hasattr(X, "dask") and hasattr(X, "compute"):
        raise TypeError(f"{name} is a lazy Dask collection; use the Dask backend "
                        "(AnnealedKMeans.fit accepts a dask array) or call .compute()")
    check_not_sparse(X, name)
    X = np.asarray(_numeric_frame(X))
    if X.dtype == object:
        raise ValueError(f"{name} has dtype object; expected a numeric 2-D array")
    if X.dtype.kind not in "biuf":
        raise ValueError(f"{name} has dtype {X.dtype}; expected real numbers (float, int or "
                         "bool)")
    if X.ndim != 2:
        raise ValueError(f"{name} must be 2-D (n_samples, n_features); got shape {X.shape}")
    if dtype is None:
        dtype = float_dtype_of(X.dtype)
    X = np.ascontiguousarray(X, dtype=dtype)
    if X.shape[1] == 0:
        raise ValueError(f"{name} has 0 features; at least 1 is required")
    if not allow_empty and X.shape[0] == 0:
        raise ValueError(f"{name} has 0 samples; at least 1 is required")
    if finite:
        check_finite(X, name)
    return X


def _numeric_frame(X):
    """A pandas DataFrame whose columns are all numeric, nullable extension dtypes included
    (``Float32``, ``Float64``, ``Int64``, ``boolean``): its values as a float array (float32
    when every column is float32; missing values become NaN, which the finiteness check
    names). Anything else is returned as it is."""
    if not (type(X).__module__.startswith("pandas") and hasattr(X, "dtypes")
            and getattr(X, "ndim", 0) == 2):
        return X
    kinds = []
    for dt in X.dtypes:
        nd = getattr(dt, "numpy_dtype", dt)
        if not isinstance(nd, np.dtype) or nd.kind not in "biuf":
            return X                      # a non-numeric column: np.asarray names it
        kinds.append(nd)
    if all(isinstance(dt, np.dtype) for dt in X.dtypes):
        return X                          # plain NumPy columns: np.asarray keeps the dtype
    target = np.float32 if kinds and all(k == np.float32 for k in kinds) else np.float64
    return X.to_numpy(dtype=target, na_value=np.nan)


def row_sqnorms(X):
    """Squared row norms of a C-contiguous float32/float64 ``X`` in float64, one Numba pass
    (the fused input check of :func:`check_rows`)."""
    import numba
    from ._kernels import row_sqnorms_kernel
    out = np.empty(X.shape[0])
    row_sqnorms_kernel(X, out, numba.get_num_threads())
    return out


def check_rows(X, name="X", check_scale=True):
    """:func:`check_finite` and (``check_scale``) :func:`check_range` of a C-contiguous
    float32/float64 ``X`` from its squared row norms: one pass instead of three. A
    non-finite norm or a largest one outside the safe range sends ``X`` to the element-wise
    checks, which name the problem (or pass: a float64 square may
    overflow on values that are still in range). Returns the squared norms."""
    sq = row_sqnorms(X)
    if X.size == 0:
        return sq
    if not np.isfinite(sq).all():
        check_finite(X, name)
    if check_scale and X.dtype in _SQ_MAX:
        mx = float(sq.max())
        if not (_SQ_MIN[X.dtype] <= mx <= _SQ_MAX[X.dtype]):
            check_range(X, name)
    return sq


def check_finite(X, name="X", offset=0, block_rows=16384):
    """Raise a ValueError naming the first NaN/inf. Checked in row blocks: a whole-array
    ``np.isfinite`` would allocate an N x D bool array (25 % of a float32 X)."""
    for b in range(0, X.shape[0], block_rows):
        blk = X[b:b + block_rows]
        # a finite sum means every entry is finite (NaN and inf propagate, inf - inf is NaN);
        # only a non-finite sum (or an overflow of huge values) needs the element-wise check
        with np.errstate(invalid="ignore", over="ignore"):
            if np.isfinite(blk.sum(dtype=np.float64)):
                continue
        fin = np.isfinite(blk)
        if fin.all():          # the sum overflowed on huge finite values
            continue
        bad = np.argwhere(~fin)[0]
        kind = "NaN" if np.isnan(blk[tuple(bad)]) else "infinity"
        raise ValueError(f"{name} contains {kind} (first at row {int(bad[0]) + b + offset}, "
                         f"column {int(bad[1])})")


#: Squared row norms above this overflow somewhere. float64: the gradient and the
#: certificate use squares of squared distances (d^2 <= 16 ||x||^4) summed over the rows,
#: so ||x|| <= 1e70 keeps every intermediate below about 1e290. float32: distances are formed
#: in float32 (||x||^2 + ||c||^2 - 2 x.c, each term up to 4 ||x||^2): 64x headroom.
_SQ_MAX = {np.dtype(np.float64): 1e140,
           np.dtype(np.float32): float(np.finfo(np.float32).max) / 64.0}
#: Squared row norms below this underflow: distances lose all precision (denormals) or
#: become 0, and every row looks identical.
_SQ_MIN = {dt: float(np.finfo(dt).tiny) * 2.0 ** (np.finfo(dt).nmant + 1)
           for dt in (np.dtype(np.float64), np.dtype(np.float32))}


def scaled_row_norms(B):
    """Row norms of ``B`` in float64, each row scaled by its largest entry first: no overflow
    or underflow of the squares, whatever the magnitude."""
    B = np.asarray(B, dtype=np.float64)
    m = np.max(np.abs(B), axis=1, keepdims=True)
    m[m == 0] = 1.0
    z = B / m
    return np.sqrt(np.einsum("ij,ij->i", z, z)) * m[:, 0]


def max_row_norm(X, block_rows=16384):
    """The largest row norm of ``X`` (:func:`scaled_row_norms`, in row blocks)."""
    out = 0.0
    for b in range(0, X.shape[0], block_rows):
        out = max(out, float(scaled_row_norms(X[b:b + block_rows]).max(initial=0.0)))
    return out


def check_range(X, name="X", where="", too_small=True):
    """``ValueError`` when finite values of ``X`` are so large that squared distances overflow
    its float type (or the float64 sums over the rows), or so small (but not all zero) that
    they underflow (``too_small=False``: the upper limit only -- centers measured against
    rows that passed both: a tiny center's squared norm is added to the rows' own). Cheap:
    one max/min pass; row norms only near the limits."""
    if X.size == 0 or X.dtype not in _SQ_MAX:
        return
    hi, lo = np.sqrt(_SQ_MAX[X.dtype]), np.sqrt(_SQ_MIN[X.dtype])     # on the norms
    maxabs = float(max(X.max(), -X.min()))
    if maxabs == 0.0:
        return
    if maxabs * np.sqrt(X.shape[1]) <= hi and maxabs >= lo:
        return                                 # maxabs <= largest norm <= sqrt(D) maxabs
    norm = max_row_norm(X)
    at = f" {where}" if where else ""
    if norm > hi:
        alt = ("; or convert it to float64" if X.dtype == np.float32
               and norm <= np.sqrt(_SQ_MAX[np.dtype(np.float64)]) else "")
        raise ValueError(
            f"{name}{at} holds values too large for {X.dtype} arithmetic: the largest row norm "
            f"is {norm:.3g} (at most {hi:.3g} is safe), so squared distances would overflow; "
            f"rescale the data (divide it by about {norm:.0e}){alt}")
    if 0.0 < norm < lo and too_small:
        raise ValueError(
            f"{name}{at} holds values too small for {X.dtype} arithmetic: the largest row norm "
            f"is {norm:.3g} (at least {lo:.3g} is needed), so squared distances would underflow;"
            f" rescale the data (multiply it by about 1e{-math.floor(math.log10(norm))})")


def as_weights(sample_weight, n, name="sample_weight"):
    if sample_weight is None:
        return np.ones(n, dtype=np.float64)
    if np.iscomplexobj(sample_weight):
        raise ValueError(f"{name} holds complex numbers; expected real numbers")
    w = np.asarray(sample_weight, dtype=np.float64)
    if w.ndim == 0:
        w = np.full(n, float(w))
    if w.ndim != 1 or w.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},); got {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError(f"{name} contains NaN or infinity (first at row "
                         f"{int(np.argwhere(~np.isfinite(w))[0, 0])})")
    if (w < 0).any():
        raise ValueError(f"{name} contains negative weights (first at row "
                         f"{int(np.argwhere(w < 0)[0, 0])})")
    return np.ascontiguousarray(w)


def check_temperature(T, allow_zero=False):
    if isinstance(T, np.ndarray) and T.ndim == 0 and T.dtype.kind in "fiu":
        T = T.item()                     # a 0-d array holds one number, as np.float64 does
    if not isinstance(T, numbers.Real) or isinstance(T, bool):
        raise TypeError(f"temperature T must be a real number; got {type(T).__name__}")
    T = float(T)
    if not np.isfinite(T) or T < 0 or (T == 0 and not allow_zero):
        raise ValueError(f"temperature T must be finite and > 0; got {T}")
    if 0 < T < np.finfo(np.float64).tiny:
        raise ValueError(f"temperature T={T!r} is below the smallest normal float64 "
                         f"({np.finfo(np.float64).tiny:.3g}): -d/T overflows")
    return T


def check_temperature_for(T, X, C, metric=0, ties_only=True, x_norm=None):
    """``ValueError`` when ``T > 0`` is so small against the squared distances of the rows
    ``X`` to the centers ``C`` that a row's logits turn into ``-inf - (-inf)``: its nearest
    distance ``d_1 / T`` overflows float64 and (``ties_only``, the moments kernels) its
    runner-up is within ``8 eps d_2 + 64 T`` (``eps`` of the rows' dtype: a clear margin
    takes the one-hot shortcut first, and those rows were always right). Cheap where it is
    clearly fine: a bound ``d <= (max|x| sqrt(D) + max|c| sqrt(D))^2`` from the largest
    entries (no temporary); only below it are the distances computed (one labelling
    pass). ``X`` and ``C`` prepared (the rows' float
    dtype; cosine: unit rows), ``metric`` its code; ``x_norm``: a bound of the rows' norms
    when the caller has one (no pass over ``X`` then)."""
    if not T > 0 or X.size == 0 or C.size == 0:
        return
    big = np.finfo(np.float64).max
    with np.errstate(over="ignore"):
        ax = (float(x_norm) if x_norm is not None
              else float(max(X.max(), -X.min())) * math.sqrt(X.shape[1]))
        ac = float(max(C.max(), -C.min())) * math.sqrt(C.shape[1])
        if (ax + ac) ** 2 < T * big:
            return
    # the distances as the kernels see them: the labelling pass (GEMM form, rows' dtype)
    from ._moments import assign
    _, d1, margin = assign(X, C, metric, _prepared=True)
    bad = d1 >= T * big
    if ties_only:
        # the kernels' shortcut needs a margin above the rounding of d2 in the rows'
        # dtype plus the drop threshold times T
        eps = float(np.finfo(X.dtype).eps)
        bad &= margin <= 8.0 * eps * (d1 + margin) + 64.0 * T
    worst = float(d1[bad].max()) if bad.any() else 0.0
    if worst == 0.0:
        return
    raise ValueError(f"temperature T={T!r} is too small for this data: squared distances up "
                     f"to about {worst:.3g} make d/T overflow float64"
                     f"{' where rows are tied between centers' if ties_only else ''}; use T "
                     f"of at least {worst / big:.3g} (or rescale the data)")


#: Rows whose norms are all within this many machine epsilons of 1 count as unit already.
UNIT_TOLERANCE = 4


def normalize_rows(X, name="X", sqnorms=None):
    """Unit-normalize rows for the cosine metric: a copy, unless every row's norm is already
    within ``UNIT_TOLERANCE`` epsilons of 1 (embedding models emit unit vectors; dividing
    them again would change a few last bits and double the memory). Zero rows are an
    error. Rows whose squared norm overflows float64 are scaled first (no row becomes 0 or
    NaN). ``sqnorms``: the float64 squared row norms, when already computed."""
    if sqnorms is None:
        # (the kernel every other path takes: rows normalised on the Dask workers, in
        # fastanneal.moments and here are the same bits)
        sqnorms = (row_sqnorms(np.ascontiguousarray(X)) if X.dtype in (np.float32, np.float64)
                   else np.einsum("ij,ij->i", X, X, dtype=np.float64))
    with np.errstate(over="ignore"):
        norms = np.sqrt(sqnorms)
    big = ~np.isfinite(norms)
    if big.any():
        norms[big] = scaled_row_norms(X[big])
    if X.shape[0] and (norms == 0).any():
        raise ValueError(f"{name} has all-zero rows (first at row "
                         f"{int(np.argwhere(norms == 0)[0, 0])}); the cosine metric needs "
                         "non-zero vectors")
    if (X.dtype in (np.float32, np.float64) and X.flags.c_contiguous
            and np.all(np.abs(norms - 1.0) <= UNIT_TOLERANCE * np.finfo(X.dtype).eps)):
        return X        # unit already (to a few ulps): no copy of the whole input
    # divided in float64, then rounded: a float32 row near the top of its range has a norm
    # that float32 cannot hold (the quotient it can)
    out = np.empty(X.shape, dtype=X.dtype)
    for b in range(0, X.shape[0], 16384):
        np.divide(X[b:b + 16384], norms[b:b + 16384, None], out=out[b:b + 16384],
                  casting="unsafe")
    return out


# ---------------------------------------------------------------------------- the origin
#: Euclidean rows are measured from their mean (a centered copy) when the GEMM form of the
#: squared distances, ``||x||^2 + ||c||^2 - 2 x.c``, would round away more than this
#: fraction of the rows' spread: ``eps(dtype) * ||mean||^2 > ORIGIN_TOL * spread`` (spread:
#: the mean squared distance to the mean). float32 rows are centered once their mean lies
#: farther from the origin than their spread (``||mean||^2 > spread``), float64 rows from
#: about ``2^29`` times it. ``docs/theory.md``, "Rows far from the origin".
ORIGIN_TOL = 2.0 ** -23


def far_from_origin(mean, mean_sq, dtype):
    """Whether rows with mean ``mean`` (float64) and mean squared norm ``mean_sq`` are far
    enough from the origin, for ``dtype``, to be measured from their mean instead."""
    m2 = float(mean @ mean)
    if not m2 > 0.0:
        return False
    spread = float(mean_sq) - m2        # rounds to <= 0 exactly when the offset dominates
    return float(np.finfo(dtype).eps) * m2 > ORIGIN_TOL * max(spread, 0.0)


def shifted_rows(X, origin, block_rows=16384, dtype=None):
    """``X - origin`` in ``X``'s dtype (each difference formed in float64, then rounded) or
    in ``dtype``: a new C-contiguous array, in row blocks (no float64 copy of ``X``)."""
    out = np.empty(X.shape, dtype=X.dtype if dtype is None else dtype)
    for b in range(0, X.shape[0], block_rows):
        np.subtract(X[b:b + block_rows], origin, out=out[b:b + block_rows], casting="unsafe")
    return out


def rows_mean(X, w=None, block_rows=4096):
    """The (weighted) mean of the rows of ``X`` in float64: a GEMV per block of rows in
    ``X``'s dtype, the blocks summed in float64 (no float64 copy of ``X``; as a point to
    measure rows from it need not be exact to the last bit)."""
    n, D = X.shape
    acc = np.zeros(D)
    for b in range(0, n, block_rows):
        wb = (np.ones(min(block_rows, n - b), X.dtype) if w is None
              else np.asarray(w[b:b + block_rows], dtype=X.dtype))
        acc += wb @ X[b:b + block_rows]
    W = float(n) if w is None else float(np.sum(w))
    return acc / W


def centered_rows(X, w=None, block_rows=16384, sqnorms=None):
    """``(rows, origin)``: Euclidean rows (C-contiguous float32/float64, weights ``w``) far
    from the origin relative to their spread (:func:`far_from_origin`) as a centered copy
    and their weighted mean (float64); else ``(X, None)`` -- no copy. Distances, and so
    every fit, are the same in either frame; only the rounding of the GEMM-form distances
    differs (``docs/theory.md``, "Rows far from the origin"). Costs one pass of squared
    norms (none when ``sqnorms``, the float64 squared row norms, are given) and one of GEMVs
    (about a fifth of one GEMM with 256 centers). ``w=None``: unweighted."""
    n, D = X.shape
    W = float(n) if w is None else float(np.sum(w))
    if n == 0 or not W > 0:
        return X, None
    mean = rows_mean(X, w)
    sq = row_sqnorms(X) if sqnorms is None else sqnorms
    msq = float(np.sum(sq) if w is None else np.asarray(w, dtype=np.float64) @ sq) / W
    if not far_from_origin(mean, msq, X.dtype):
        return X, None
    return shifted_rows(X, mean, block_rows), mean


#: The largest weight float32 rows can carry: the kernels keep the weighted
#: responsibilities (and a block's weighted sums) in the rows' dtype. (Weights far below
#: the largest one round towards 0 there, as they count for ~nothing beside it anyway.)
FLOAT32_WEIGHT_RANGE = (1e-25, 1e25)


def check_normal_weights(w, name="sample_weight", where="", row0=0):
    """ValueError for a positive weight below float64's smallest normal number: subnormal
    weights keep ~11 significant bits in ``w x`` (centers off by 2e-5 at weights 1e-320).
    ``where``/``row0``: the chunk and its first row's number, for the message."""
    tiny = (w > 0) & (w < np.finfo(np.float64).tiny)
    if tiny.any():
        i = int(np.argmax(tiny))
        raise ValueError(f"{name} holds {float(w[i]):.3g} at row {row0 + i}{where}, below "
                         "float64's smallest normal number (2.2e-308), where products lose "
                         "their precision: rescale the weights (only their ratios matter)")


def check_weight_range(w, dtype, name="sample_weight"):
    """ValueError when float32 rows come with a largest weight outside
    :data:`FLOAT32_WEIGHT_RANGE` (all weights 1e36 made a false "1 distinct point" error,
    1e39 a ZeroDivisionError in a kernel or centers at the mean, 1e-46 a fit on rounded-away
    weights); float64 rows carry any finite weight. ``w``: the weights, or their maximum."""
    if np.dtype(dtype) != np.float32:
        return
    w = np.asarray(w, dtype=np.float64)
    hi = float(w.max()) if w.size else 0.0
    a, b = FLOAT32_WEIGHT_RANGE
    if hi > 0 and not a <= hi <= b:
        raise ValueError(f"{name}'s largest value is {hi:.3g}: with float32 rows the weighted "
                         f"sums are kept in float32, which needs the largest weight in "
                         f"{a:g}..{b:g}; rescale the weights (only their ratios matter: e.g. "
                         "divide them by the largest), or use float64 rows")
