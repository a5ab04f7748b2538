"""Input checks shared by every entry point: each failure names the problem."""
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


def as_float_matrix(X, name="X", dtype=None, allow_empty=True):
    """Return X as a C-contiguous float32/float64 2-D array (float32 stays float32; other
    dtypes become float64), after checking shape and finiteness."""
    if hasattr(X, "dask") and hasattr(X, "compute"):
        raise TypeError(f"{name} is a lazy Dask collection; use the Dask backend "
                        "(AnnealedKMeans.fit accepts a dask array) or call .compute()")
    X = np.asarray(X)
    if X.dtype == object:
        raise ValueError(f"{name} has dtype object; expected a numeric 2-D array")
    if X.ndim != 2:
        raise ValueError(f"{name} must be 2-D (n_samples, n_features); got shape {X.shape}")
    if dtype is None:
        dtype = X.dtype if X.dtype in (np.float32, np.float64) else np.float64
    X = np.ascontiguousarray(X, dtype=dtype)
    if X.shape[1] == 0:
        raise ValueError(f"{name} has 0 features; at least 1 is required")
    if not allow_empty and X.shape[0] == 0:
        raise ValueError(f"{name} has 0 samples; at least 1 is required")
    check_finite(X, name)
    return X


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


def as_weights(sample_weight, n, name="sample_weight"):
    if sample_weight is None:
        return np.ones(n, dtype=np.float64)
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
    if not isinstance(T, numbers.Real) or isinstance(T, bool):
        raise TypeError(f"temperature T must be a real number; got {type(T).__name__}")
    T = float(T)
    if not np.isfinite(T) or T < 0 or (T == 0 and not allow_zero):
        raise ValueError(f"temperature T must be finite and > 0; got {T}")
    return T


def normalize_rows(X, name="X"):
    """Unit-normalize rows for the cosine metric (a copy); zero rows are an error."""
    norms = np.sqrt(np.einsum("ij,ij->i", X, X, dtype=np.float64))
    if X.shape[0] and (norms == 0).any():
        raise ValueError(f"{name} has all-zero rows (first at row "
                         f"{int(np.argwhere(norms == 0)[0, 0])}); the cosine metric needs "
                         "non-zero vectors")
    return np.ascontiguousarray(X / norms[:, None].astype(X.dtype, copy=False), dtype=X.dtype)
