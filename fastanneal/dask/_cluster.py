"""Which Dask cluster does the work: an existing Client, an address, the default client, or an
embedded LocalCluster that the caller closes again."""
import logging
import os

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
            info = self.client.scheduler_info(n_workers=-1)["workers"]
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

    def n_worker_threads(self):
        info = self.client.scheduler_info(n_workers=-1)["workers"]
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


def embedded_cluster_size(cpus=None):
    """``(n_workers, threads_per_worker)`` of the embedded cluster: one in-process worker with
    ``max(1, cpus // 2)`` task threads (each task's Numba kernel then uses the other cores)."""
    cpus = _cpu_count() if cpus is None else int(cpus)
    return 1, max(1, cpus // 2)


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
        return ClientHandle(Client(str(scheduler), set_as_default=False), owned_client=True)
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
