"""The threads of the CPU kernels: serial Numba kernels (``nogil``) on a pool of Python threads.

The kernels used to be Numba ``parallel=True`` functions (``prange`` over the row ranges).
They are plain serial functions now, each taking the row ranges it owns, and this module runs
them: range 0 in the calling thread, the others on a process-wide pool of worker threads.
Why (measured; ``BENCHMARKS.md`` §14):

* **compile time**: Numba's parfor machinery compiles every parallel kernel twice (the
  function and its gufunc) and was about a third of the cold compile of a default fit;
* **small passes**: a parallel region wakes sleeping worker threads on every call. On a
  few thousand rows that costs more than the second core gains, so passes below
  :data:`fastanneal._config.PARALLEL_MIN_WORK` now run in the calling thread. (fastanneal
  used to set ``OMP_WAIT_POLICY=PASSIVE`` for Numba's OpenMP threads; it runs no OpenMP
  region any more and leaves the variable -- which also governs scikit-learn's threads in
  the same process -- alone.) A hand-off to the pool costs about 80 us on this machine
  (a thread wake-up, the GIL for the worker's call, another wake-up at the end).

The thread count is still Numba's (``numba.get_num_threads()`` of the calling thread, so
``NUMBA_NUM_THREADS`` and ``numba.set_num_threads`` keep working, also per Dask worker
thread). Results depend on the number of row ranges only through the association of the
sums, as before.
"""
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

from . import _config

_lock = threading.Lock()
_pool = None
_pool_size = 0
_pool_pid = None


def threads_for(nth, work, light=False):
    """Row ranges to use for a pass of about ``work`` element operations with ``nth``
    threads available: one (the calling thread) below ``_config.PARALLEL_MIN_WORK``.
    ``light``: a pass of one multiply-add per element (``_config.LIGHT_PASS_FACTOR``)."""
    nth = int(nth)
    if light:
        work = work // _config.LIGHT_PASS_FACTOR
    if nth <= 1 or work < _config.PARALLEL_MIN_WORK:
        return 1
    return nth


def _executor(workers):
    global _pool, _pool_size, _pool_pid
    with _lock:
        pid = os.getpid()
        if _pool is None or _pool_pid != pid or _pool_size < workers:
            old = _pool if _pool_pid == pid else None    # a forked child: threads are gone
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fastanneal")
            _pool_size, _pool_pid = workers, pid
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def run(fn, args, nch):
    """``fn(*args, t, t + 1)`` for ``t`` in ``range(nch)``: ``t = 0`` in the calling thread,
    the others on the pool. A range no pool thread has started by the time the calling
    thread is done with its own is taken back and run here (``Future.cancel``): the caller
    never sleeps waiting for a thread that has not woken up yet (on a busy or oversubscribed
    machine a wake-up can take longer than a small range). Waits for every range before
    returning or raising (no range may still write into the caller's arrays), then
    re-raises the first error."""
    if nch <= 1:
        fn(*args, 0, nch)
        return
    pool = _executor(nch - 1)
    futures = [(t, pool.submit(fn, *args, t, t + 1)) for t in range(1, nch)]
    error = None
    try:
        fn(*args, 0, 1)
    except BaseException as e:      # noqa: B902 -- re-raised below, after the others end
        error = e
    for t, f in futures:
        if f.cancel():              # not started: run it in this thread
            try:
                fn(*args, t, t + 1)
            except BaseException as e:   # noqa: B902
                error = error or e
    # (a cancelled future counts as done for ``wait`` only once a pool thread dequeued it)
    running = [f for _, f in futures if not f.cancelled()]
    wait(running)
    for f in running:
        if error is None:
            error = f.exception()
    if error is not None:
        raise error


def run_groups(fn, args, nch, nthreads):
    """``fn(*args, t0, t1)`` over the ranges ``0 .. nch`` in ``nthreads`` contiguous groups
    (as :func:`run`: group 0 in the calling thread). For kernels whose number of ranges --
    so the association of their sums -- must not depend on the thread count."""
    nthreads = max(1, min(int(nthreads), int(nch)))
    if nthreads <= 1:
        fn(*args, 0, nch)
        return
    run(_group_task, (fn, args, nch, nthreads), nthreads)


def _group_task(fn, args, nch, nthreads, g0, g1):
    for g in range(g0, g1):
        fn(*args, g * nch // nthreads, (g + 1) * nch // nthreads)


def run_rows(fn, n, nch, args_of):
    """Row-parallel kernels: ``fn(*args_of(r0, r1))`` over ``nch`` contiguous row ranges
    (``args_of`` slices the per-row arguments), in the same way as :func:`run`."""
    if nch <= 1:
        fn(*args_of(0, n))
        return
    run(_rows_task, (fn, n, nch, args_of), nch)


def _rows_task(fn, n, nch, args_of, t0, t1):
    for t in range(t0, t1):
        fn(*args_of(t * n // nch, (t + 1) * n // nch))
