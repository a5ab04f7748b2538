"""Dask backend of fastanneal: distributed full-batch annealing, out-of-core mini-batch
annealing and streaming label output.

* :class:`DaskSource` / :func:`make_dask_source` -- the moment source that
  ``AnnealedKMeans.fit`` uses for Dask input: chunks persisted once on the cluster, the same
  Numba kernel mapped over them, records merged by a tree of tasks.
* :func:`read_parquet_embeddings`, :func:`embeddings_from_dataframe` -- lazy inputs.
* :class:`DaskBatchStream` / :func:`open_batch_stream` -- the batches of chunks (read on
  demand, moments computed on the workers) that :class:`fastanneal.MiniBatchAnnealedKMeans`
  anneals over out of core.
* :func:`write_labels` -- a streaming pass that writes hard labels as Parquet, one file per
  chunk, into a folder published atomically.

The cluster is an existing ``distributed.Client``, an address, the default client, or an
embedded ``LocalCluster`` closed again after the fit. Fitted attributes are NumPy arrays.
"""
from ._cluster import (ClientHandle, ClusterLostError, SchedulerConnectionError,  # noqa: F401
                       resolve_client)
from ._inputs import (EmbeddingArrays, SmallChunksWarning, as_dask_inputs,  # noqa: F401
                      embeddings_from_dataframe, read_parquet_embeddings)
from ._minibatch import (DaskBatchStream, map_rows, open_batch_stream,  # noqa: F401
                         predict_labels, write_labels)
from ._source import DaskSource, make_dask_source  # noqa: F401

__all__ = ["DaskSource", "make_dask_source", "read_parquet_embeddings",
           "embeddings_from_dataframe", "EmbeddingArrays", "as_dask_inputs", "resolve_client",
           "DaskBatchStream", "open_batch_stream", "write_labels", "predict_labels",
           "ClusterLostError", "SchedulerConnectionError", "SmallChunksWarning"]
