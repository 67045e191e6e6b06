"""A rank's DataLoader whose workers start from the fork server, die with their rank and are never silent
(data/worker_process.py says how the processes start and stop).

Timeout: a rank that waits `timeout_s` for a batch raises `DataWorkerTimeout`, which names the worker that owes it,
instead of waiting forever for a worker stuck in a shard read or a transform.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator

from torch.utils.data import DataLoader

from data import worker_process
from data.worker_process import init_worker, stop_signals_blocked

_TIMED_OUT = "DataLoader timed out after"  # the start of torch's own message


class DataWorkerTimeout(RuntimeError):
    """A data worker gave no batch within the loader's timeout."""


def worker_loader(dataset, *, num_workers: int, timeout_s: float, rank: int, **kwargs) -> DataLoader:
    """A DataLoader whose workers (if any) start from the fork server, die with this process, ignore SIGINT and foreign
    SIGTERMs, and whose iterators raise `DataWorkerTimeout` after `timeout_s` without a batch.

    Args:
        dataset: What the workers iterate (pickled to each of them).
        num_workers: DataLoader workers; 0 iterates `dataset` in this process (no timeout applies).
        timeout_s: Seconds a rank waits for one batch before `DataWorkerTimeout`.
        rank: This process's rank, for the error message.
        **kwargs: The other DataLoader arguments.
    """
    if num_workers == 0:
        return DataLoader(dataset, num_workers=0, **kwargs)
    init = functools.partial(init_worker, os.getpid())
    return _WorkerLoader(
        dataset,
        num_workers=num_workers,
        timeout=timeout_s,
        multiprocessing_context=worker_process.context(),
        worker_init_fn=init,
        rank=rank,
        **kwargs,
    )


class _WorkerLoader(DataLoader):
    """DataLoader that starts its workers with SIGTERM and SIGINT blocked and names the worker a timeout waited for."""

    def __init__(self, dataset, *, rank: int, **kwargs):
        super().__init__(dataset, **kwargs)
        self.rank = rank

    def __iter__(self) -> Iterator:
        # Processes inherit the mask of the thread that starts them: the fork server (started at the first iter())
        # and the resource tracker, hence every worker, begin with SIGTERM and SIGINT blocked. A signal meanwhile
        # waits, then reaches the rank's handler.
        with stop_signals_blocked():
            batches = super().__iter__()
        return _named_timeouts(batches, self.rank, self.timeout)


def _named_timeouts(batches, rank: int, timeout_s: float) -> Iterator:
    """`batches`, with torch's timeout error replaced by one naming the worker and rank."""
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except RuntimeError as err:
            if not str(err).startswith(_TIMED_OUT):
                raise
            raise DataWorkerTimeout(_timeout_message(batches, rank, timeout_s)) from None
        yield batch


def _timeout_message(batches, rank: int, timeout_s: float) -> str:
    # The iterator's task bookkeeping (torch's _MultiProcessingDataLoaderIter): batch _rcvd_idx is the one waited
    # for, and its task records the worker it was asked of.
    task = getattr(batches, "_task_info", {}).get(getattr(batches, "_rcvd_idx", None))
    worker = task[0] if task else None
    pid = batches._workers[worker].pid if worker is not None else None
    who = f"data worker {worker}" if worker is not None else "a data worker"
    return (
        f"{who} of rank {rank} gave no batch for {timeout_s:g} s (pid {pid}, data.loader_timeout_s={timeout_s:g}); "
        "a shard read or a transform is stuck in it: check the shards it reads, or raise data.loader_timeout_s if "
        "batches can take that long"
    )
