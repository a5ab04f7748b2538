"""Which Dask cluster does the work: an existing Client, an address, the default client, or an
embedded LocalCluster that the caller closes again."""
import logging
import os
from concurrent.futures import CancelledError
import socket
import time

log = logging.getLogger("fastanneal")


def _cpu_count():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


class ClientHandle:
    """A client and whatever this library started for it (closed by :meth:`close`)."""

    def __init__(self, client, owned_client=False, cluster=None):
        self.client = client
        self.owned_client = owned_client
        self.cluster = cluster
        self._threads = None

    @property
    def owned(self):
        return self.owned_client or self.cluster is not None

    def task_threads(self):
        """Numba threads for one task: the host's cores over the worker threads on that host
        (the minimum over hosts, so every task uses the same count and results do not depend
        on which worker ran a chunk)."""
        if self._threads is None:
            info = self.require_workers()
            per_host = {}
            for w in info.values():
                per_host[w.get("host")] = per_host.get(w.get("host"), 0) + int(w.get("nthreads", 1))
            try:
                cpus = self.client.run(_cpu_count)
            except Exception:  # pragma: no cover - restricted clusters
                cpus = {}
            host_cpus = {}
            for addr, n in cpus.items():
                h = info.get(addr, {}).get("host")
                host_cpus[h] = n
            vals = [max(1, host_cpus.get(h, _cpu_count()) // max(t, 1))
                    for h, t in per_host.items()]
            self._threads = min(vals) if vals else 1
        return self._threads

    def require_workers(self):
        """The scheduler's workers, after waiting up to ``WORKER_TIMEOUT`` seconds for the
        first one (a scheduler without workers would otherwise take the tasks and hang)."""
        info = self._workers()
        if info:
            return info
        timeout = _worker_timeout()
        # a pending task: an adaptive cluster (adapt(minimum=0): dask-gateway, jobqueue)
        # starts workers only when there is work
        probe = self.client.submit(int, 1, pure=False)
        try:
            self.client.wait_for_workers(1, timeout=timeout)
        except Exception as exc:      # TimeoutError (distributed raises its own kinds too)
            addr = getattr(self.client, "scheduler", None)
            addr = getattr(addr, "address", None) or "the scheduler"
            raise ClusterLostError(
                f"the Dask scheduler at {addr} has no workers (waited {timeout:g} s): start "
                f"some (`dask worker {addr}`), or set FASTANNEAL_WORKER_TIMEOUT to wait "
                "longer") from exc
        finally:
            probe.cancel()
        return self._workers()

    #: seconds between two looks at the cluster while waiting for results
    POLL = 2.0

    def wait(self, futures, return_when="ALL_COMPLETED"):
        """``distributed.wait`` that gives up when the cluster has had no worker for
        ``FASTANNEAL_WORKER_TIMEOUT`` seconds (every worker died mid-fit: the tasks would
        wait for new workers without end) with a RuntimeError saying so."""
        import asyncio
        from distributed import wait as dwait
        from distributed.comm import CommClosedError
        futures = list(futures)
        since = None
        while True:
            try:
                with self.client.as_current():
                    return dwait(futures, timeout=self.POLL, return_when=return_when)
            except (TimeoutError, asyncio.TimeoutError):   # (two classes before Python 3.11)
                pass
            except (CancelledError, CommClosedError) as e:   # Future(s)CancelledError
                why = " ".join(str(e).split())[:200] or type(e).__name__
                raise ClusterLostError(
                    "the fit's tasks were cancelled or its connection closed on the Dask "
                    f"cluster (its scheduler went away or the cluster was restarted: {why}); "
                    "rerun the fit") from e
            if self._workers():
                since = None
                continue
            now = time.monotonic()
            since = now if since is None else since
            timeout = _worker_timeout()
            if now - since >= timeout:
                for f in futures:
                    f.cancel()
                addr = getattr(getattr(self.client, "scheduler", None), "address", None)
                raise ClusterLostError(
                    f"the Dask cluster at {addr or 'the scheduler'} has had no workers for "
                    f"{timeout:g} s while this fit waited for results: its workers died or "
                    "left; start workers and run the fit again (or set "
                    "FASTANNEAL_WORKER_TIMEOUT to wait longer)")

    def _workers(self):
        """The scheduler's workers (a dict); :class:`ClusterLostError` once the client has
        lost its scheduler (its identity is then empty)."""
        info = self.client.scheduler_info(n_workers=-1)
        if "workers" not in info or self.client.status in ("closing", "closed", "failed"):
            addr = getattr(getattr(self.client, "scheduler", None), "address", None)
            raise ClusterLostError(
                f"the Dask scheduler at {addr or 'its address'} went away (the client is "
                f"{self.client.status}): start it and its workers again and rerun")
        return info["workers"]

    def result(self, futures):
        """The result of a future, or the results of a list of futures, waiting as
        :meth:`wait` does."""
        if isinstance(futures, (list, tuple)):
            self.wait(futures)
            return self.client.gather(list(futures))
        self.wait([futures])
        return futures.result()

    def n_worker_threads(self):
        info = self._workers()
        return max(1, sum(int(w.get("nthreads", 1)) for w in info.values()))

    def close(self):
        if self.owned_client:
            try:
                self.client.close()
            finally:
                self.owned_client = False
        if self.cluster is not None:
            try:
                self.cluster.close()
            finally:
                self.cluster = None


def _worker_timeout():
    raw = os.environ.get("FASTANNEAL_WORKER_TIMEOUT", WORKER_TIMEOUT)
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"FASTANNEAL_WORKER_TIMEOUT must be a number of seconds; got "
                         f"{raw!r}") from None


def embedded_cluster_size(cpus=None):
    """``(n_workers, threads_per_worker)`` of the embedded cluster: one in-process worker with
    ``max(1, cpus // 2)`` task threads (each task's Numba kernel then uses the other cores)."""
    cpus = _cpu_count() if cpus is None else int(cpus)
    return 1, max(1, cpus // 2)


#: Seconds to wait for a scheduler to answer (``FASTANNEAL_CONNECT_TIMEOUT`` overrides).
CONNECT_TIMEOUT = 10.0
#: Seconds to wait for a scheduler's first worker (``FASTANNEAL_WORKER_TIMEOUT`` overrides).
WORKER_TIMEOUT = 60.0


class ClusterLostError(RuntimeError):
    """The Dask cluster has (or kept) no workers, or its scheduler went away, while a fit
    needed it (the message says which and what to do)."""


class SchedulerConnectionError(ConnectionError):
    """The scheduler address is malformed or does not answer (the message names it)."""


def check_address(address):
    """``(scheme, host, port)`` of a scheduler address; ``ValueError`` naming a malformed one.
    ``host:port`` without a scheme means ``tcp://``, as in ``distributed``."""
    from distributed.comm import parse_address
    from distributed.comm.addressing import parse_host_port
    from distributed.comm.registry import backends
    addr = str(address).strip()
    if not addr:
        raise ValueError("the scheduler address is empty; expected tcp://host:port")
    try:
        scheme, loc = parse_address(addr if "://" in addr else "tcp://" + addr, strict=True)
    except (ValueError, TypeError) as e:
        raise ValueError(f"malformed scheduler address {address!r} ({e}); expected "
                         "tcp://host:port") from None
    if scheme not in backends:
        raise ValueError(f"scheduler address {address!r}: unknown scheme {scheme!r} (known: "
                         f"{', '.join(sorted(backends))})")
    host = port = None
    if scheme in ("tcp", "tls"):
        try:
            host, port = parse_host_port(loc)
        except (ValueError, TypeError) as e:
            raise ValueError(f"malformed scheduler address {address!r} ({e}); expected "
                             "tcp://host:port") from None
        if not host or port is None or not 0 < int(port) < 65536:
            raise ValueError(f"malformed scheduler address {address!r}: needs a host and a port "
                             "in 1-65535 (tcp://host:8786)")
    return scheme, host, port


def _client_class():
    """``distributed.Client`` whose constructor, when it fails half-way, stops what it started
    at once (a plain half-built Client waits for its connection again when it is garbage
    collected, up to twice the timeout at interpreter exit, and prints a traceback)."""
    global _CLIENT_CLASS
    if _CLIENT_CLASS is None:
        from distributed import Client

        class _Client(Client):
            def __init__(self, *args, **kwargs):
                try:
                    super().__init__(*args, **kwargs)
                except BaseException:
                    self.status = "closed"            # __del__ / close() now return at once
                    try:
                        self._loop_runner.stop()
                    except Exception:                 # noqa: BLE001 - never started
                        pass
                    raise
        _Client.__name__ = _Client.__qualname__ = "Client"
        _CLIENT_CLASS = _Client
    return _CLIENT_CLASS


_CLIENT_CLASS = None


def connect(address, timeout=None):
    """A ``distributed.Client`` connected to the scheduler at ``address``.

    A malformed address is a ``ValueError``; an address where nothing answers (checked first
    with a plain socket for ``tcp``/``tls``, so a refused port fails at once) is a
    :class:`SchedulerConnectionError` naming the address. A client that failed half-way is
    closed at once.
    """
    if timeout is None:
        timeout = float(os.environ.get("FASTANNEAL_CONNECT_TIMEOUT", CONNECT_TIMEOUT))
    scheme, host, port = check_address(address)
    if host is not None:
        try:
            sock = socket.create_connection((host, int(port)), timeout=timeout)
        except OSError as e:
            why = e.strerror or str(e) or type(e).__name__
            raise SchedulerConnectionError(
                f"cannot reach the Dask scheduler at {address}: {why}") from None
        with sock:
            if scheme == "tcp":
                # a Dask server speaks first (its handshake), as soon as it accepts: a port
                # that accepts and stays silent (another service) would hang distributed's
                # own handshake, which its connect timeout does not cover
                try:
                    first = sock.recv(1)
                except OSError as e:        # socket.timeout included
                    first = None
                    why = ("nothing was sent" if isinstance(e, (socket.timeout, TimeoutError))
                           else e.strerror or str(e) or type(e).__name__)
                if not first:
                    why = why if first is None else "it closed the connection"
                    raise SchedulerConnectionError(
                        f"cannot connect to the Dask scheduler at {address}: something "
                        f"accepts connections there but is not a Dask scheduler ({why} "
                        f"within {timeout:g} s)")
    for attempt in (0, 1):
        try:
            return _client_class()(str(address), timeout=timeout, set_as_default=False)
        except Exception as e:             # noqa: BLE001 -- named below
            # one more try after a fast failure: distributed's handshake asserts that the
            # scheduler's first message starts the stream, which it may not be while the
            # scheduler serves another client of this process (seen once in CI); a timeout
            # or a refused connection is not tried again
            if attempt == 0 and not isinstance(e, (OSError, TimeoutError)):
                time.sleep(0.5)
                continue
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise SchedulerConnectionError(
                f"cannot connect to the Dask scheduler at {address} (something answers there, "
                f"but not as a Dask scheduler would, or too slowly: {why})") from None


def resolve_client(scheduler=None):
    """A :class:`ClientHandle` for ``scheduler``.

    ``scheduler`` may be a ``distributed.Client`` (used as is), an address string
    (``"tcp://host:8786"``; a client is opened and closed again), or None: the current default
    client if one exists, else an embedded ``LocalCluster`` (threads, in this process, sized to
    the machine) that :meth:`ClientHandle.close` shuts down again.
    """
    from distributed import Client, LocalCluster, default_client

    if isinstance(scheduler, Client):
        return ClientHandle(scheduler)
    if isinstance(scheduler, (str, os.PathLike)):
        return ClientHandle(connect(str(scheduler)), owned_client=True)
    if scheduler is not None:
        raise TypeError("scheduler must be None, an address string or a distributed.Client; "
                        f"got {type(scheduler).__name__}")
    try:
        return ClientHandle(default_client())
    except ValueError:
        pass
    n_workers, threads = embedded_cluster_size()
    log.info("starting an embedded LocalCluster (%d worker, %d threads)", n_workers, threads)
    # in-process transport (no TCP listener); no dashboard; the scheduler's plain HTTP
    # routes on a free port of the loopback interface only (not 8787)
    cluster = LocalCluster(n_workers=n_workers, threads_per_worker=threads, processes=False,
                           dashboard_address=None,
                           scheduler_kwargs={"dashboard_address": "127.0.0.1:0"})
    try:
        client = Client(cluster, set_as_default=False)
    except BaseException:
        cluster.close()
        raise
    return ClientHandle(client, owned_client=True, cluster=cluster)
