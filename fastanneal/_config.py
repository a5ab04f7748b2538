"""Tunables of fastanneal, in one place.

Tests patch these (small block sizes keep the CUDA simulator fast); users rarely need to.
"""

#: Rows per block in the CPU moments kernel. Each thread holds two ``block x K`` buffers
#: of the input dtype, so memory is ``O(threads * block * K)``, never ``O(N * K)``.
CPU_BLOCK_ROWS = 512

#: A block is accumulated sparsely (row by row, only non-zero responsibilities) when
#: its number of non-zero responsibilities is at most this fraction of ``rows * K``;
#: otherwise densely with one GEMM ``R_b^T X_b``. The cross-over was measured with
#: ``benchmarks/bench_kernels.py`` (scalar float64 axpy vs single-thread sgemm).
SPARSE_FRACTION = 0.125

#: Candidate count above which entmax-1.5 uses bisection instead of sorting.
ENTMAX_SORT_MAX = 48

#: The number of the first row in error messages of the Dask route (``ROW_BASE.get()``, read
#: when a dataset is opened or a fit starts): 0 in the library; the ``fastanneal`` command
#: sets 1 in its own context while it runs, as its in-memory and in-process routes count
#: rows (a context variable: other threads and later calls keep 0).
ROW_BASE = __import__("contextvars").ContextVar("fastanneal_row_base", default=0)

#: CUDA: threads per block for the row kernels, and rows per block of the tiled kernels.
CUDA_THREADS_PER_BLOCK = 256
CUDA_ROWS_PER_BLOCK = 64
#: CUDA: threads per row and rows per block of the row-reduction kernels (None: one thread
#: per 32 centers, from a warp to 256, and 2 rows, fewer for short chunks; see
#: fastanneal/cuda/source.py's ``_row_launch`` and ``benchmarks/gpu_check.py``'s sweep).
CUDA_ROW_THREADS = None
CUDA_ROW_BLOCK_ROWS = None

#: CUDA: rows per chunk of the device pass (the chunk x K buffer is the only N-dependent
#: allocation), and the non-zero fraction below which a chunk is accumulated sparsely.
CUDA_CHUNK_ROWS = 65536
CUDA_SPARSE_FRACTION = 0.08
#: CUDA: who computes a pass's two matrix products -- "auto" (cuBLAS through CuPy when CuPy
#: is installed and a tiny product through it checks out, else the numba.cuda kernels),
#: "cublas" or "numba"; and the rows per dense accumulation GEMM before its float32 sums
#: enter the float64 accumulators (:mod:`fastanneal.cuda._blas`).
#: ``FASTANNEAL_CUDA_PRODUCTS`` sets the first.
CUDA_PRODUCTS = __import__("os").environ.get("FASTANNEAL_CUDA_PRODUCTS", "auto")
CUDA_BLAS_ACCUM_ROWS = 16384
#: CUDA: a source keeps its rows on the device when they take at most this fraction of the
#: free device memory, else it streams them from host memory in every pass.
CUDA_RESIDENT_FRACTION = 0.5

#: In-memory CPU passes keep per-row distance bounds (Hamerly) between passes and skip the
#: distances of rows whose every other center is provably beyond the responsibility drop
#: threshold (``docs/theory.md``, "Pruning"). ``FASTANNEAL_PRUNE=0`` turns it off.
PRUNE = __import__("os").environ.get("FASTANNEAL_PRUNE", "1") != "0"
#: The bounds are forgotten at every temperature step only when the fit saves checkpoints
#: there (a resumed fit then repeats the uninterrupted one bit for bit); without a checkpoint
#: they are kept across steps (a fit with and one without a checkpoint agree to rounding).
#: ``FASTANNEAL_PRUNE_RESET=1`` forgets them at every step in any case.
PRUNE_RESET_EACH_STEP = __import__("os").environ.get("FASTANNEAL_PRUNE_RESET", "0") != "0"

#: Passes below this much work (rows x (K + D)) run in the calling thread, without waking
#: the kernel threads (``fastanneal/_pool.py``); ``FASTANNEAL_PARALLEL_MIN_WORK=0`` always
#: splits the rows over ``numba.get_num_threads()`` threads.
PARALLEL_MIN_WORK = int(__import__("os").environ.get("FASTANNEAL_PARALLEL_MIN_WORK", 1 << 18))
#: The light passes (the covariance-vector products of the Lanczos iterations and the
#: k-means++ candidate steps: one multiply-add per element, no K x D product per row) count
#: their rows x D work divided by this against ``PARALLEL_MIN_WORK``: per element they cost
#: about a fifth of a moments pass, and a hand-off to the pool (~0.15-0.2 ms here) only pays
#: from about 0.5 ms of work. Measured single vs two threads, 2,250 x 384: matvec 0.41 vs
#: 0.49 ms, k-means++ step 0.43 vs 0.52 ms; 9,000 x 384: 1.96 vs 1.27, 2.39 vs 1.69 ms.
LIGHT_PASS_FACTOR = 4
