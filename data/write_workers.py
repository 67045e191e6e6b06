"""Encoding a sequence of samples in worker processes for `data.write`, handed back in order.

The workers are forked: each inherits the sequence (a source's file list, its arrays) and the encode function as
they are in the writing process, so nothing but a chunk's bounds goes to a worker and only its encoded samples come
back pickled. Chunks keep the per-task overhead low; at most `IN_FLIGHT_PER_WORKER` chunks per worker are queued,
being encoded or waiting to be written at any time, so memory does not grow with the dataset.
"""

import multiprocessing
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

CHUNK_SIZE = 16
"""Samples per task: 16 ImageNet JPEGs are ~2 MB of results, and a task's round trip is amortised over them."""
IN_FLIGHT_PER_WORKER = 2
"""Chunks per worker submitted ahead of the one being written: one being encoded, one ready."""

_samples: Sequence[Any] = ()  # set in each worker by _start_worker, before its first chunk
_encode: Callable[[Any], Any] | None = None


def encode_in_workers(
    samples: Sequence[Any], encode: Callable[[Any], Any], num_workers: int, chunk_size: int = CHUNK_SIZE
) -> Iterator[Any]:
    """`encode(samples[k])` for k = 0, 1, ..., computed by `num_workers` forked processes and yielded in order.

    An exception `encode` raises for sample k is raised here after the results of samples 0..k-1 were yielded, as
    `map(encode, samples)` would, with the worker's traceback in its notes. Stopping the iteration early (an error
    while writing) cancels the chunks not yet started and waits for the running ones.
    """
    context = multiprocessing.get_context("fork")  # the workers inherit `samples` and `encode`; see the module doc
    with ProcessPoolExecutor(
        num_workers, mp_context=context, initializer=_start_worker, initargs=(samples, encode)
    ) as pool:
        pending: deque[Future] = deque()
        try:
            for start in range(0, len(samples), chunk_size):
                pending.append(pool.submit(_encode_chunk, start, min(start + chunk_size, len(samples))))
                if len(pending) > IN_FLIGHT_PER_WORKER * num_workers:
                    yield from _results(pending.popleft())
            while pending:
                yield from _results(pending.popleft())
        finally:
            for future in pending:
                future.cancel()


def _results(future: Future) -> Iterator[Any]:
    """A chunk's encoded samples; after them, the error that stopped the chunk, if any."""
    encoded, error = future.result()
    yield from encoded
    if error is not None:
        raise error


def _start_worker(samples: Sequence[Any], encode: Callable[[Any], Any]) -> None:
    """Keeps what the chunks index and call (the fork's own copies; nothing was pickled)."""
    global _samples, _encode
    _samples, _encode = samples, encode


def _encode_chunk(start: int, stop: int) -> tuple[list[Any], BaseException | None]:
    """The encoded samples [start, stop), up to the first that fails, and that failure (None if none did)."""
    encoded = []
    for k in range(start, stop):
        try:
            encoded.append(_encode(_samples[k]))
        except Exception as exn:  # handed back with the samples before it, so that those are written first
            exn.add_note(f"in a data write worker:\n{''.join(traceback.format_exception(exn)).rstrip()}")
            return encoded, exn
    return encoded, None
