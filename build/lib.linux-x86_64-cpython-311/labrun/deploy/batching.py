"""Dynamic batching for `labrun serve`: concurrent requests share one model call.

    batcher = Batcher(run_batch, max_batch=16, max_delay_ms=2)
    result, size = await batcher.submit(item)    # in a request handler, on the event loop;
                                                 # size: how many items its model call took
    answers = await batcher.submit_many(items)   # several items of one request, in order
    await batcher.close()                        # at shutdown

One consumer task takes the oldest waiting item, then gathers more until it holds `max_batch`
of them (or its share, below) or `max_delay_ms` have passed since that first item was queued
(an item that already waited through the previous model call is not made to wait again), and
calls
`run_batch(items) -> results` (one result per item, in order) in its own worker thread, so that
the event loop goes on accepting and parsing requests while the model runs. Each caller's
Future gets its own result. When run_batch raises, the callers of that batch, and only they,
get the exception; the consumer goes on with the next batch.

At most `model_calls` model calls run at once (one consumer gathers the next batch while they
run). One is right on a GPU, where a stream of larger batches is what batching is for. On a CPU
the server runs by default one call per core plus one, each on one intra-op thread, rather than
one call at a time on every core: calls on one thread never wait for each other's threads at
the end of each operator, and the spare call keeps the cores busy while another call's batch is
being gathered. Measured with 16 clients on 2 cores (ResNet-18, 224 px, 6 alternating rounds of
300 requests, req/s best and median): 3 calls on 1 thread each 59.2 and 54.5; 3 calls on 2
threads 52.3 and 50.2; 2 calls on 2 threads (the previous setting) 48.4 and 47.0; 1 call on 2
threads 50.0 and 47.0 in an earlier run. The price is a lone request's time, since its call
has one core: `labrun serve --model-calls N` shares the cores out among N calls instead
(threads_per_call), and --model-calls 1 answers a lone request soonest (one client, p50 of 40
requests in each of 4 rounds: 29-34 ms, against 38-47 ms by default; 16 clients: 42-47 req/s,
against 40-58).

With several model calls, a call takes at most its share of what is waiting when it starts,
ceil(waiting / model_calls) items: otherwise the first free call takes the whole queue onto one
core while the others, freed a moment later, find it empty. Measured as above (4 rounds): p99
at 16 clients 433-516 ms against 637-885 ms when a call took up to --max-batch, req/s 44.8-57.3
against 39.8-51.5, and a lone request no longer waits --max-delay-ms for company (p50 34-42 ms
against 41-50).

Hand-written (one asyncio.Queue and one task) because the field's dynamic batchers (Ray Serve's
@serve.batch, Triton's, TorchServe's, LitServe's) come only inside their own serving stacks,
while labrun serves with FastAPI on uvicorn, and the small stand-alone PyPI batchers are young
single-author projects.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from labrun.core.errors import LabrunError

log = logging.getLogger(__name__)

# `labrun serve`'s defaults (--max-batch, --max-delay-ms), chosen with `labrun bench serve`
# (ResNet-18, 224 px, onnxruntime on 2 CPU cores shared with other jobs, so only coarse): the
# runtime's images/s peaked at batch 16 (20.8, against 10.4 at batch 1 and 15.6 at 32; issue 17
# measured 1.09x batch 1 there on a quiet machine), and 16 is the goal's client count. A lone
# request waits the whole delay, so it is kept small against one model call (26 ms at batch 1
# on a quiet machine, 38 images/s in issue 17; measured here at one client: p99 107 ms against
# its bound of 194); under load requests queue during the previous call, so the delay is rarely
# waited at all.
MAX_BATCH = 16
MAX_DELAY_MS = 2.0


def model_calls(device: str, cores: int, requested: int | None = None) -> int:
    """Model calls at once on `cores`: `requested` (--model-calls), else one on a GPU and one
    per core plus one on a CPU (the module's docstring says why)."""
    if requested is not None:
        return requested
    return 1 if device == "cuda" else cores + 1


def threads_per_call(cores: int, calls: int) -> int:
    """Intra-op threads of each model call: the cores shared out, at least one a call."""
    return max(1, cores // calls)

T = TypeVar("T")
R = TypeVar("R")


class BatcherClosed(LabrunError):
    """The server is shutting down: the item was not, and will not be, run."""


@dataclass
class _Item:
    value: Any
    future: asyncio.Future
    queued: float  # the event loop's clock when it was queued


class Batcher(Generic[T, R]):
    def __init__(self, run_batch: Callable[[list[T]], Sequence[R]], *, max_batch: int,
                 max_delay_ms: float, model_calls: int = 1):
        if max_batch < 1:
            raise LabrunError(f"--max-batch={max_batch} must be 1 or more")
        if max_delay_ms < 0:
            raise LabrunError(f"--max-delay-ms={max_delay_ms:g} must be 0 or more")
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.max_delay_s = max_delay_ms / 1000
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        if model_calls < 1:
            raise LabrunError(f"model_calls={model_calls} must be 1 or more")
        self._task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()  # model calls in flight
        self.model_calls = model_calls
        self._slots = asyncio.Semaphore(model_calls)
        self._closed = False
        # Model calls never run in the request thread pool, where decoding goes on meanwhile.
        self._executor = ThreadPoolExecutor(model_calls, thread_name_prefix="labrun-model")

    def start(self) -> None:
        """Start the consumer on the running event loop (the first submit does it too)."""
        if self._closed:
            raise BatcherClosed("the server is shutting down")
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._consume(),
                                                                name="labrun-batcher")

    def _enqueue(self, value: T) -> asyncio.Future:
        self.start()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put_nowait(_Item(value, future, loop.time()))
        return future

    async def submit(self, value: T) -> tuple[R, int]:
        """run_batch's result for `value`, and how many items its model call took."""
        return await self._enqueue(value)

    async def submit_many(self, values: Sequence[T]) -> list[tuple[R, int]]:
        """submit() of each; queued back to back, so that they share model calls as far as
        max_batch allows."""
        futures = [self._enqueue(value) for value in values]
        return list(await asyncio.gather(*futures))

    async def close(self) -> None:
        """Stop the consumer; whatever is still queued gets BatcherClosed."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for running in list(self._running):  # their callers get BatcherClosed
            running.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        self._fail_queued()
        self._executor.shutdown(wait=False)

    def _fail_queued(self) -> None:
        while not self._queue.empty():
            _fail([self._queue.get_nowait()], BatcherClosed("the server is shutting down"))

    async def _consume(self) -> None:
        loop = asyncio.get_running_loop()
        batch: list[_Item] = []
        try:
            while True:
                await self._slots.acquire()  # a model thread is free
                batch = [await self._queue.get()]
                deadline = batch[0].queued + self.max_delay_s
                limit = self.max_batch
                if self.model_calls > 1:  # this call's share of what waits (module docstring)
                    limit = min(limit, -(-(1 + self._queue.qsize()) // self.model_calls))
                while len(batch) < limit:
                    if not self._queue.empty():  # already waiting: no reason to wait longer
                        batch.append(self._queue.get_nowait())
                        continue
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    try:
                        batch.append(await asyncio.wait_for(self._queue.get(), remaining))
                    except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
                        break
                # A caller that went away (its task cancelled) cancelled its Future: skip it.
                batch = [item for item in batch if not item.future.done()]
                if batch:
                    running = loop.create_task(self._run(loop, batch))
                    self._running.add(running)
                    running.add_done_callback(self._running.discard)
                else:
                    self._slots.release()
                batch = []
        finally:  # cancelled by close(), or a bug: nobody may wait forever
            self._closed = True
            _fail(batch, BatcherClosed("the server is shutting down"))
            self._fail_queued()

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[_Item]) -> None:
        try:
            results = await loop.run_in_executor(self._executor, self.run_batch,
                                                 [item.value for item in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"the model returned {len(results)} results for a batch "
                                   f"of {len(batch)}")
        except asyncio.CancelledError:  # close()
            _fail(batch, BatcherClosed("the server is shutting down"))
            raise
        except Exception as error:  # noqa: BLE001 - this batch's callers get it, not the server
            log.exception("model call on a batch of %d failed", len(batch))
            _fail(batch, error)
            return
        finally:
            self._slots.release()
        for item, result in zip(batch, results, strict=True):
            if not item.future.done():
                item.future.set_result((result, len(batch)))


def _fail(items: list[_Item], error: BaseException) -> None:
    for item in items:
        if not item.future.done():
            item.future.set_exception(error)
