"""The differentiable separation objective and its exact gradient (docs/theory.md section 5).

:func:`value_and_grad` returns the loss ``L = L_comp - lam * L_sep`` of a set of free
centers at temperature ``T``, its gradients with respect to the centers and to the
embeddings, and the parts the adaptive temperature schedule feeds back on (entropy and the
separation-gradient norm), from two blockwise passes over the rows.
"""
import numbers
from typing import NamedTuple

import numba
import numpy as np

from . import _config
from . import _grad_kernels as G_
from . import _kernels as K_
from ._moments import blas_single_thread, pinned_blas
from ._validation import (as_float_matrix, as_weights, check_range, check_temperature,
                          check_temperature_for, far_from_origin, metric_code, row_sqnorms,
                          rows_mean, shifted_rows)

_PHIS = {"identity": G_.PHI_IDENTITY, "log": G_.PHI_LOG, "hinge": G_.PHI_HINGE}
_RESPS = {"softmax": 0, "entmax15": 1}

#: Largest allowed deviation of a row norm from 1 with ``metric="cosine"``.
COSINE_NORM_TOL = 1e-2

#: Default ``eps`` of ``phi="log"``: ``phi(s) = log(s + eps)``.
LOG_EPS_DEFAULT = 1e-12


class Loss(NamedTuple):
    """Result of :func:`value_and_grad`; a tuple, so ``L, gC, gX = result[:3]`` works."""
    value: float                  #: ``L = L_comp - lam * L_sep``
    grad_centers: np.ndarray      #: ``dL/dC`` (K, D), float64
    grad_X: np.ndarray            #: ``dL/dX`` (n, D), the dtype of ``X``
    entropy: float                #: ``sum_i w_i H_i / W`` (nats; Tsallis-1.5 for entmax15)
    compactness: float            #: ``L_comp``
    separation: float             #: ``L_sep`` (not multiplied by ``lam``)
    separation_grad_norm: float   #: ``||dL_sep/dC||_F`` (not multiplied by ``lam``)
    empty: np.ndarray             #: bool (K,): clusters with ``N_k == 0``, left out of L_sep


def _check_real(value, name):
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a real number; got {type(value).__name__}")
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value}")
    return value


@pinned_blas
def value_and_grad(X, centers, T, *, lam=1.0, phi="identity", margin=None, eps=None,
                   weights=None, metric="euclidean", responsibilities="softmax"):
    r"""Separation objective of soft centroids, with exact gradients w.r.t. centers and data.

    With ``d_ik`` the squared distance of row ``x_i`` to center ``c_k``, responsibilities
    ``r_i = softmax(-d_i / T)`` (or ``entmax15`` of the same logits), soft counts
    ``N_k = sum_i w_i r_ik``, soft centroids ``mu_k = sum_i w_i r_ik x_i / N_k`` and
    ``W = sum_i w_i``:

    * compactness ``L_comp = sum_i w_i sum_k r_ik ||x_i - mu_k||^2 / W``,
    * separation ``L_sep = 2 / (K (K - 1)) sum_{k<l} phi(||mu_k - mu_l||^2)``,
    * loss ``L = L_comp - lam * L_sep``.

    Parameters
    ----------
    X : array (n, D)
        Embeddings, float32 or float64 (float32 stays float32 for ``grad_X``; everything is
        computed and accumulated in float64). Other dtypes become float64.
    centers : array (K, D)
        The free centers ``C`` (any float dtype; used in float64).
    T : float > 0
        Temperature of the logits ``z_ik = -d_ik / T``.
    lam : float, default 1.0
        Weight of the separation term (``lam > 0`` rewards separated centroids).
    phi : {"identity", "log", "hinge"}, default "identity"
        Monotone increasing transform of the squared centroid distance ``s``:
        ``"identity"``: ``phi(s) = s``;
        ``"log"``: ``phi(s) = log(s + eps)``;
        ``"hinge"``: ``phi(s) = -max(0, margin - s)``, so ``-lam * L_sep`` is ``lam`` times the
        mean hinge penalty of the pairs closer than ``margin`` and pairs beyond the margin
        contribute nothing (at ``s == margin`` the derivative 0 is used).
    margin : float > 0, required with ``phi="hinge"`` (an error otherwise)
        Margin on the *squared* centroid distance (the units of ``d``).
    eps : float > 0, only with ``phi="log"``; default ``1e-12``
        Offset in ``log(s + eps)``, in squared-distance units. Pure ``log s`` diverges where
        centroids coincide, e.g. at the collapsed start of annealing (all centers at the
        mean); there ``phi'(s) = 1 / eps`` is still huge, so raise ``eps`` to a small
        fraction of the data variance for a softer barrier.
    weights : array (n,), optional
        Non-negative sample weights (weights equal repetition); ``sum w`` must be > 0.
    metric : {"euclidean", "cosine"}, default "euclidean"
        ``"euclidean"``: ``d = ||x - c||^2``. ``"cosine"``: ``d = 2 - 2 x.c`` for the vectors
        *as given* (see Notes); rows of ``X`` and ``centers`` must be unit-normalized (norms
        within ``1e-2`` of 1, else ``ValueError``).
    responsibilities : {"softmax", "entmax15"}, default "softmax"
        Soft assignments; entmax-1.5 gives exactly sparse rows (docs/theory.md section 4.2).

    Returns
    -------
    Loss
        NamedTuple ``(value, grad_centers, grad_X, entropy, compactness, separation,
        separation_grad_norm, empty)``:

        - ``value`` (float): ``L``.
        - ``grad_centers`` (K, D) float64: ``dL/dC``.
        - ``grad_X`` (n, D), dtype of ``X``: ``dL/dX`` (total derivative: through ``d``, the
          responsibilities, ``mu`` and ``L_comp``).
        - ``entropy`` (float): ``sum_i w_i H_i / W`` (Shannon, nats, for softmax; Tsallis-1.5
          for entmax15, as in :class:`fastanneal.Moments`).
        - ``compactness``, ``separation`` (float): ``L_comp`` and ``L_sep`` (``L_sep``
          without ``lam``).
        - ``separation_grad_norm`` (float): Frobenius norm of ``dL_sep/dC`` (without
          ``lam``), the ``g_t`` of the adaptive temperature rule (docs/theory.md section 5).
        - ``empty`` (K,) bool: clusters with ``N_k == 0`` (see Notes).

        ``loss, gC, gX = value_and_grad(...)[:3]`` unpacks the first three.

    Raises
    ------
    ValueError
        Shape mismatch, NaN or infinity in ``X``, ``centers`` or ``weights``, negative
        weights or ``sum w == 0``, ``T <= 0``, unknown ``phi``, ``metric`` or
        ``responsibilities``, ``margin`` missing (hinge) or given (other ``phi``), ``eps``
        given without ``phi="log"`` or ``<= 0``, non-unit rows with ``metric="cosine"``.
    TypeError
        ``T``, ``lam``, ``margin`` or ``eps`` not a real number.

    Notes
    -----
    Gradient (all in float64). With ``G_k = dL_sep/dmu_k = 2/(K(K-1)) sum_{l != k}
    phi'(s_kl) 2 (mu_k - mu_l)`` and ``dL_comp/dmu_k = 0`` at ``mu = S/N``:
    ``dL/dr_ik = w_i (||x_i - mu_k||^2 / W - lam G_k . (x_i - mu_k) / N_k)``, pulled back
    through the softmax Jacobian ``dL/dz_ik = r_ik (dL/dr_ik - sum_j r_ij dL/dr_ij)`` or the
    entmax-1.5 Jacobian ``diag(s) - s s^T / sum s`` (``s = sqrt(r)``); then
    ``dz_ik/dc_k = 2 (x_i - c_k) / T``, ``dz_ik/dx_i = -2 (x_i - c_k) / T``, and ``X`` also
    enters directly: ``dL/dx_i += 2 w_i / W (x_i - sum_k r_ik mu_k) - lam w_i sum_k r_ik
    G_k / N_k``. Two blockwise passes over the rows (soft counts, then the backward pass),
    never an ``n x K`` matrix; per-thread partial sums with a static row split, so a fixed
    thread count gives bit-identical results.

    Cosine convention: ``X`` and ``centers`` are taken as given and the gradients are those
    of ``d = 2 - 2 x.c`` (no normalization Jacobian), i.e. the derivatives in the ambient
    space ``R^D``. To move on the unit sphere, project a row gradient ``g`` of a unit
    vector ``v`` onto the tangent space, ``g - (g . v) v``, and renormalize after the step.
    ``dz_ik/dc_k = 2 x_i / T`` and ``dz_ik/dx_i = 2 c_k / T``; ``mu`` and ``L_comp`` are the
    Euclidean ones of the given vectors.

    Empty clusters: a cluster with ``N_k == 0`` (entmax-1.5 at low ``T``, underflow of
    ``exp`` for a center far from all data, or zero weights) has no soft centroid. Its pairs
    are left out of ``L_sep`` (the normalization stays ``2/(K(K-1))``), it contributes
    nothing to ``L_comp``, and its row of ``grad_centers`` is 0 (the loss is locally constant
    in it). ``K == 1`` gives ``L_sep = 0``.

    ``phi="hinge"`` and entmax-1.5 are piecewise smooth: the gradient is exact where the set
    of pairs inside the margin and the supports are locally constant.

    References
    ----------
    .. [1] B. Peters, V. Niculae, A. F. T. Martins, "Sparse Sequence-to-Sequence Models",
       ACL 2019 (entmax-1.5 and its Jacobian).
    .. [2] K. Rose, "Deterministic annealing for clustering, compression, classification,
       regression, and related optimization problems", Proc. IEEE 86(11), 1998.

    Examples
    --------
    >>> import numpy as np
    >>> from fastanneal.gradient import value_and_grad
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(100, 3)); C = X[:4].copy()
    >>> res = value_and_grad(X, C, T=1.0, lam=0.5)
    >>> loss, gC, gX = res[:3]
    >>> gC.shape, gX.shape, bool(res.empty.any())
    ((4, 3), (100, 3), False)
    """
    X = as_float_matrix(X, "X", allow_empty=False)
    C = as_float_matrix(centers, "centers", dtype=np.float64, allow_empty=False)
    if C.shape[1] != X.shape[1]:
        raise ValueError(f"centers have {C.shape[1]} features but X has {X.shape[1]}")
    check_range(X, "X")
    check_range(C, "centers", too_small=False)    # (centers near 0 are harmless)
    T = check_temperature(T)
    mc = metric_code(metric)
    check_temperature_for(T, X, C, mc, ties_only=False)   # (no one-hot shortcut here)
    lam = _check_real(lam, "lam")
    try:
        rc = _RESPS[responsibilities]
    except (KeyError, TypeError):
        raise ValueError("responsibilities must be 'softmax' or 'entmax15' (hard assignments "
                         f"have no gradient); got {responsibilities!r}") from None
    try:
        pc = _PHIS[phi]
    except (KeyError, TypeError):
        raise ValueError(f"phi must be one of 'identity', 'log', 'hinge'; got {phi!r}") from None
    if pc == G_.PHI_HINGE:
        if margin is None:
            raise ValueError("phi='hinge' needs a margin > 0 (on the squared centroid distance)")
        margin = _check_real(margin, "margin")
        if margin <= 0:
            raise ValueError(f"margin must be > 0; got {margin}")
    elif margin is not None:
        raise ValueError(f"margin applies only to phi='hinge'; got phi={phi!r}")
    if pc == G_.PHI_LOG:
        eps = LOG_EPS_DEFAULT if eps is None else _check_real(eps, "eps")
        if eps <= 0:
            raise ValueError(f"eps must be > 0 (phi(s) = log(s + eps)); got {eps}")
    elif eps is not None:
        raise ValueError(f"eps applies only to phi='log'; got phi={phi!r}")
    w = as_weights(weights, X.shape[0], "weights")
    # L and its gradients do not change when every weight is scaled: bring the largest to
    # [0.5, 1) by a power of two (exact), so that neither W nor 1/W over- or underflows
    top = float(w.max())
    if top > 0:
        w = np.ldexp(w, -np.frexp(top)[1])
    W = float(w.sum())
    if not W > 0:
        raise ValueError("the weights sum to 0; the objective needs a positive total weight")
    if mc == 1:
        for name, A in (("X", X), ("centers", C)):
            norms = np.sqrt(np.einsum("ij,ij->i", A, A, dtype=np.float64))
            dev = np.abs(norms - 1.0)
            if dev.max() > COSINE_NORM_TOL:
                i = int(dev.argmax())
                raise ValueError(
                    f"metric='cosine' needs unit-norm rows; {name} row {i} "
                    f"has norm {norms[i]:.6g} (off by {dev[i]:.3g}). Normalize the "
                    "rows first: the gradient is that of d = 2 - 2 x.c for the given vectors")
    dtype = X.dtype
    if mc == 0:
        # rows far from the origin are measured from their mean (docs/theory.md section
        # 7): L and both gradients are the same when X and C move together. The kernels
        # compute in float64 whatever the rows' dtype, so float64's threshold decides, and
        # the shifted rows are float64 (float32's threshold, with the shift rounded back to
        # float32, changed the gradient of float32 rows by ~3e-6 relative for nothing)
        mean = rows_mean(X, w)
        msq = float(w @ row_sqnorms(X)) / W
        if far_from_origin(mean, msq, np.float64):
            X, C = shifted_rows(X, mean, dtype=np.float64), C - mean
    out = _value_and_grad(X, C, T, lam, pc, float(margin or 0.0), float(eps or 0.0), w, W,
                          mc, rc)
    if out.grad_X.dtype != dtype:
        out = out._replace(grad_X=out.grad_X.astype(dtype))
    return out


class GradMoments(NamedTuple):
    """Additive sums of the backward pass of :func:`value_and_grad` over a block of rows
    (given the global soft centroids and separation gradient of the forward pass):
    ``comp = sum_i w_i sum_k r_ik ||x_i - mu_k||^2``, ``A`` (2K, D) ``= sum_i g_ik x_i`` and
    ``a`` (2K,) ``= sum_i g_ik`` for the full loss (rows ``:K``) and ``L_sep`` alone (rows
    ``K:``). Blocks, chunks and devices add them with :meth:`merge`."""
    comp: float
    A: np.ndarray
    a: np.ndarray

    def merge(self, other):
        return GradMoments(self.comp + other.comp, self.A + other.A, self.a + other.a)


class GradForward(NamedTuple):
    """Additive sums of the forward pass of :func:`value_and_grad` over a block of rows:
    soft counts ``N`` (K,), sums ``S = sum_i w_i r_ik x_i`` (K, D) and ``H = sum_i w_i H_i``,
    with every responsibility kept. (The ordinary moments leave out entries below the drop
    threshold; the backward pass recomputes the full responsibilities, and divides by these
    ``N``: both passes must see the same ones.) Blocks, chunks and devices add them with
    :meth:`merge`."""
    N: np.ndarray
    S: np.ndarray
    H: float

    def merge(self, other):
        return GradForward(self.N + other.N, self.S + other.S, self.H + other.H)


class GradGlobals(NamedTuple):
    """What the backward pass needs from the forward one: the soft centroids ``mu``, the
    separation gradient ``Gmu = dL_sep/dmu``, the soft counts ``N``, the total weight and
    ``lam``."""
    mu: np.ndarray
    Gmu: np.ndarray
    N: np.ndarray
    W: float
    lam: float


def separation_terms(N, S, pc, margin, eps):
    """Soft centroids, empty mask, ``L_sep`` and ``dL_sep/dmu`` from the forward sums."""
    K, D = S.shape
    empty = ~(N > 0)
    mu = np.zeros((K, D))
    np.divide(S, N[:, None], out=mu, where=~empty[:, None])
    if K > 1:
        pair = 2.0 / (K * (K - 1))
        sep, Gmu = G_.separation_kernel(mu, ~empty, pc, margin, eps)
        sep *= pair
        Gmu *= pair
    else:
        sep, Gmu = 0.0, np.zeros((K, D))
    return mu, empty, float(sep), Gmu


def forward_moments(X, w, C, T, metric, resp):
    """The forward pass over the rows ``X`` (weights ``w``) as :class:`GradForward`."""
    C = np.asarray(C, dtype=np.float64)
    csq = np.einsum("ij,ij->i", C, C)
    with blas_single_thread():
        N, S, H = G_.grad_forward_kernel(X, w, np.ascontiguousarray(C.T), csq, T, metric,
                                         resp, int(_config.CPU_BLOCK_ROWS),
                                         K_.entmax_sort_max(resp),
                                         int(numba.get_num_threads()))
    return GradForward(N, S, float(H))


def backward_moments(X, w, C, T, metric, resp, g, gX=None):
    """The backward pass over the rows ``X`` (weights ``w``) as :class:`GradMoments`;
    writes ``dL/dX`` into ``gX`` when given (else nothing of size n x D is made)."""
    C = np.asarray(C, dtype=np.float64)
    csq = np.einsum("ij,ij->i", C, C)
    B = np.ascontiguousarray(np.concatenate([C, g.mu, g.Gmu]))
    musq = np.einsum("ij,ij->i", g.mu, g.mu)
    gmu = np.einsum("ij,ij->i", g.Gmu, g.mu)
    if gX is None:
        gX = np.empty((0, X.shape[1]), dtype=X.dtype)
    with blas_single_thread():
        comp, A, a = G_.grad_backward_kernel(
            X, w, B, np.ascontiguousarray(B.T), csq, musq, gmu, g.N, 1.0 / g.W, g.lam, T,
            metric, resp, int(_config.CPU_BLOCK_ROWS), K_.entmax_sort_max(resp),
            int(numba.get_num_threads()), gX)
    return GradMoments(float(comp), A, a)


def center_gradients(C, T, metric, gm):
    """``(dL/dC, dL_sep/dC)`` from the merged backward sums."""
    K = C.shape[0]
    A, a = gm.A, gm.a
    gC = A[:K] if metric == 1 else A[:K] - C * a[:K, None]
    gS = A[K:] if metric == 1 else A[K:] - C * a[K:, None]
    return gC * (2.0 / T), gS * (2.0 / T)


def value_and_grad_from_source(source, C, T, resp, lam, pc, margin=0.0, eps=0.0):
    """:func:`value_and_grad` for the rows of a moment source (in memory, Dask, CUDA): the
    forward sums come from ``source.grad_forward`` (:class:`GradForward`), the backward
    sums from ``source.grad_moments``; both are additive, so no backend needs the rows in
    one place. ``grad_X`` is None.

    A source without ``grad_forward`` (written before it existed) gives the forward sums
    through its ordinary moments, whose entries below the drop threshold (``2^-53`` of a
    row's largest for float64 rows, ``2^-24`` for float32) are left out: then the loss and gradient are those of the truncated
    responsibilities, off by about that much per entry (and a cluster that only such
    entries reach counts as empty)."""
    C = np.asarray(C, dtype=np.float64)
    forward = getattr(source, "grad_forward", None)
    if forward is not None:
        f = forward(C, T, resp)
        N, S, H = f.N, f.S, f.H
        W = float(source.total_weight)
    else:
        m = source.moments(C, T, resp, None, hard_sums=False)
        N, S, H, W = m.N, m.S, m.entropy, float(m.weight)
    if not 2.0 ** -1000 < W < 2.0 ** 1000:
        # (value_and_grad rescales its weights; a source's are its own: 1 / W would
        # overflow, or W itself, and every gradient turn NaN)
        raise ValueError(f"the weights sum to {W:.3g}, outside the range in which the "
                         "gradient's 1/W stays finite; multiply sample_weight by a constant "
                         "(only their ratios matter)")
    mu, empty, sep, Gmu = separation_terms(N, S, pc, margin, eps)
    gm = source.grad_moments(C, T, resp, GradGlobals(mu, Gmu, N, W, float(lam)))
    gC, gS = center_gradients(C, T, source.metric, gm)
    comp = gm.comp / W
    return Loss(value=float(comp - lam * sep), grad_centers=gC, grad_X=None,
                entropy=float(H / W), compactness=float(comp), separation=float(sep),
                separation_grad_norm=float(np.linalg.norm(gS)), empty=empty)


def _value_and_grad(X, C, T, lam, pc, margin, eps, w, W, mc, rc):
    """Fast path: validated ``X`` (C-contiguous float32/64), float64 ``C`` and ``w``."""
    N, S, Hsum = forward_moments(X, w, C, T, mc, rc)
    mu, empty, sep, Gmu = separation_terms(N, S, pc, margin, eps)
    gX = np.empty_like(X)
    gm = backward_moments(X, w, C, T, mc, rc, GradGlobals(mu, Gmu, N, W, lam), gX)
    gC, gS = center_gradients(C, T, mc, gm)
    comp = gm.comp / W
    return Loss(value=float(comp - lam * sep), grad_centers=gC, grad_X=gX,
                entropy=float(Hsum / W), compactness=float(comp), separation=float(sep),
                separation_grad_norm=float(np.linalg.norm(gS)), empty=empty)
