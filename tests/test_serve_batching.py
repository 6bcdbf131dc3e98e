"""Dynamic batching in `labrun serve` (labrun.deploy.batching).

The HTTP tests run a real `labrun serve` process on 127.0.0.1 with the digits run's exported
model, started with --max-batch 8 --max-delay-ms 200: long enough a wait that concurrent
requests share model calls even on a loaded machine. Each runs twice: with --model-calls 1 (one
call at a time, as on a GPU: the waiting requests gather into one call) and with the server's
default on a CPU (one call per core plus one, running at once, each taking its share of what
waits), where an answer could also go to a caller of another call running at the same time.
Each answer's X-Batch-Size header says how many images its model call took. Every image sent
is a different validation digit, and each answer is compared with that image's answer when
sent alone, so an answer that went to the wrong caller shows.

The batcher's own tests run it in-process with a fake model function that records the batches it
is given: they test the queue logic (gathering, max_batch, the delay, errors, shutdown), which
no real model could make observable; the HTTP tests run the real model.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import math
import os
import threading
from dataclasses import dataclass

import cv2
import httpx
import pytest
from PIL import Image

from conftest import PROJECT
from labrun.data.image import digits
from labrun.deploy import batching
from labrun.deploy.batching import Batcher, BatcherClosed
from labrun.deploy.served import serving

MAX_BATCH = 8
HEADER = "x-batch-size"


@dataclass
class Server:
    url: str
    calls: int  # model calls at once (/health's model_calls)


# "one call": as on a GPU, the waiting requests gather into one call; "default calls": the
# server's own choice on this CPU, several calls at once, each taking its share of what waits.
MODEL_CALLS = {"one call": ("--model-calls", "1"), "default calls": ()}


@pytest.fixture(scope="module", params=list(MODEL_CALLS))
def server(request, onnx_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("batching-server") / "server.log"
    try:
        with serving(onnx_model, log, cwd=PROJECT,
                     args=("--max-batch", str(MAX_BATCH), "--max-delay-ms", "200",
                           *MODEL_CALLS[request.param])) as served:
            health = httpx.get(f"{served.url}/health", timeout=10).json()
            # The default: several calls on a CPU (one per core plus one), one on a GPU.
            default = batching.model_calls(health["device"], os.cpu_count())
            assert health["model_calls"] == (1 if request.param == "one call" else default)
            yield Server(served.url, health["model_calls"])
    finally:
        print(log.read_text()[-3000:])


@pytest.fixture(scope="module")
def images() -> list[tuple[str, bytes]]:
    """16 different validation digits as 64 px JPEG files, named by their index."""
    val = digits.load(32, 0.2)["val"]
    files = []
    for i in range(16):
        image = cv2.resize(val.load(i), (64, 64), interpolation=cv2.INTER_LINEAR)
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=95)
        files.append((f"{i}.jpg", buffer.getvalue()))
    return files


@pytest.fixture(scope="module")
def alone(server, images) -> dict[str, dict[int, float]]:
    """Each image's answer (all 10 classes) when it is the only request: a batch of one."""
    answers = {}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for name, data in images:
            answer = client.post("/predict?k=10", files={"file": (name, data)})
            assert answer.status_code == 200, answer.text
            assert answer.headers[HEADER] == "1"
            answers[name] = probs(answer.json()["top"])
    # The images must tell callers apart: were two answers alike within assert_same's
    # tolerance, a swap of the two could not show. Every pair differs by more.
    assert len({max(p, key=p.get) for p in answers.values()}) >= 4, answers
    for (a, first), (b, second) in itertools.combinations(answers.items(), 2):
        gap = max(abs(first[c] - second[c]) for c in first)
        assert gap > SAME_ANSWER_TOLERANCE, (a, b, gap)
    return answers


# float32 rounding: onnxruntime may sum in another order for a batch of 8 than for one.
SAME_ANSWER_TOLERANCE = 1e-4


def probs(top: list[dict]) -> dict[int, float]:
    return {entry["index"]: entry["prob"] for entry in top}


def assert_same(got: dict[int, float], expected: dict[int, float], name: str) -> None:
    """The same answer as the image's own, up to float32 rounding: onnxruntime may sum in
    another order for a batch of 8 than for a batch of 1."""
    assert got.keys() == expected.keys(), name
    worst = max(abs(got[c] - expected[c]) for c in got)
    assert worst <= SAME_ANSWER_TOLERANCE, (name, worst, got, expected)


def at_once(calls: list) -> list:
    """Run every call in its own thread, released together; their results, in order."""
    start = threading.Barrier(len(calls))
    results: list = [None] * len(calls)

    def worker(i: int) -> None:
        start.wait()
        try:
            results[i] = calls[i]()
        except Exception as error:  # noqa: BLE001 - reported below, with the others
            results[i] = error

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [r for r in results if isinstance(r, Exception)]
    assert not failed, failed
    return results


def post(url: str, path: str, files) -> httpx.Response:
    # 60 s: one small request; slack for a loaded 2-core machine.
    return httpx.post(f"{url}{path}", files=files, timeout=60)


def test_concurrent_requests_share_model_calls_and_each_gets_its_own_answer(server, images,
                                                                          alone):
    answers = at_once([lambda name=name, data=data: post(server.url, "/predict?k=10",
                                                         {"file": (name, data)})
                       for name, data in images])
    sizes = []
    for (name, _), answer in zip(images, answers, strict=True):
        assert answer.status_code == 200, answer.text
        assert_same(probs(answer.json()["top"]), alone[name], name)
        sizes.append(int(answer.headers[HEADER]))
    print(f"model calls' sizes seen by 16 concurrent requests ({server.calls} at once): {sizes}")
    assert max(sizes) <= MAX_BATCH, sizes
    if server.calls == 1:
        # Gathered: several requests answered by one model call. With several calls a free
        # call starts on what waits at once, so requests that arrive one by one may each get
        # a call of their own: their answers are checked all the same.
        assert max(sizes) > 1, sizes


def shares(waiting: int, calls: int) -> list[int]:
    """The X-Batch-Size of each of `waiting` images queued at once on an idle server: each call
    takes ceil(what waits / calls), at most MAX_BATCH (labrun.deploy.batching), in turn."""
    sizes: list[int] = []
    while waiting:
        take = min(MAX_BATCH, math.ceil(waiting / calls))
        sizes += [take] * take
        waiting -= take
    return sizes


def test_one_requests_files_are_shared_out_among_the_calls_and_answered_in_order(server,
                                                                              images, alone):
    """16 files in one /predict/batch request are queued at once, so how the server splits
    them is fixed: one call takes 8, then 8; three calls (two cores) take 6, 4 and 2 at once,
    then 2, 1 and 1. Each file's answer is that image's own, whichever call ran it."""
    answer = post(server.url, "/predict/batch?k=10", [("files", item) for item in images])
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    assert [r["filename"] for r in results] == [name for name, _ in images]
    for result in results:
        assert_same(probs(result["top"]), alone[result["filename"]], result["filename"])
    sizes = [int(size) for size in answer.headers[HEADER].split(",")]
    assert sizes == shares(len(images), server.calls), sizes


def test_an_undecodable_image_fails_only_its_own_request(server, images, alone):
    good = images[:6]
    bad = [("junk.jpg", b"GIF89a this is not really a gif"),
           ("cut.jpg", images[6][1][: len(images[6][1]) // 2])]
    sent = good[:3] + bad[:1] + good[3:] + bad[1:]
    answers = at_once([lambda name=name, data=data: post(server.url, "/predict?k=10",
                                                         {"file": (name, data)})
                       for name, data in sent])
    for (name, _), answer in zip(sent, answers, strict=True):
        if name in ("junk.jpg", "cut.jpg"):
            assert answer.status_code == 400, answer.text
            assert f"file ({name})" in answer.json()["error"]
        else:
            assert answer.status_code == 200, answer.text
            assert_same(probs(answer.json()["top"]), alone[name], name)
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"


def test_batch_and_single_requests_share_the_queue_and_keep_their_order(server, images,
                                                                       alone):
    # Four /predict/batch requests of three files each (the last file first: order matters)
    # and four single /predict requests, all at once.
    groups = [images[i:i + 3][::-1] for i in range(0, 12, 3)]
    singles = images[12:16]
    calls = [lambda group=group: post(server.url, "/predict/batch?k=10",
                                      [("files", item) for item in group]) for group in groups]
    calls += [lambda name=name, data=data: post(server.url, "/predict?k=10",
                                                {"file": (name, data)})
              for name, data in singles]
    answers = at_once(calls)
    sizes = []
    for group, answer in zip(groups, answers[:len(groups)], strict=True):
        assert answer.status_code == 200, answer.text
        results = answer.json()["results"]
        assert [r["filename"] for r in results] == [name for name, _ in group]
        for result in results:
            assert_same(probs(result["top"]), alone[result["filename"]], result["filename"])
        group_sizes = [int(size) for size in answer.headers[HEADER].split(",")]
        assert len(group_sizes) == len(group), answer.headers[HEADER]
        sizes += group_sizes
    for (name, _), answer in zip(singles, answers[len(groups):], strict=True):
        assert answer.status_code == 200, answer.text
        assert_same(probs(answer.json()["top"]), alone[name], name)
        sizes.append(int(answer.headers[HEADER]))
    print(f"model calls' sizes ({server.calls} at once): {sizes}")
    assert max(sizes) <= MAX_BATCH, sizes
    if server.calls == 1:
        # A call larger than any one request (3 files at most) held images of several
        # requests: the queue was really shared. (With several calls at once, see above.)
        assert max(sizes) > max(len(group) for group in groups), sizes


# ---------------------------------------------------------------------------------------------
# The batcher in-process, with a fake model that records its batches (see the docstring).


class FakeModel:
    """run_batch for Batcher: answers x -> ("out", x), records each batch; raises on a "bad"
    item; with `hold`, each call waits for hold.set() (to catch the batcher mid-call)."""

    def __init__(self, hold: threading.Event | None = None):
        self.batches: list[list] = []
        self.hold, self.started = hold, threading.Event()

    def __call__(self, items: list) -> list:
        self.batches.append(list(items))
        self.started.set()
        if self.hold is not None:
            self.hold.wait(60)
        if "bad" in items:
            raise ValueError("the model failed on this batch")
        return [("out", item) for item in items]


def test_the_batcher_gathers_waiting_items_up_to_max_batch_and_answers_each_caller():
    model = FakeModel()

    async def main():
        batcher = Batcher(model, max_batch=4, max_delay_ms=50)
        answers = await asyncio.gather(*(batcher.submit(i) for i in range(10)))
        await batcher.close()
        return answers

    answers = asyncio.run(main())
    assert model.batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert answers == [(("out", i), 4 if i < 8 else 2) for i in range(10)]


def test_an_item_arriving_within_the_delay_joins_the_waiting_one():
    model = FakeModel()

    async def main():
        # 60 s of delay: the batch closes because it is full, not because the delay passed.
        batcher = Batcher(model, max_batch=2, max_delay_ms=60_000)
        first = asyncio.ensure_future(batcher.submit("a"))
        await asyncio.sleep(0.05)
        assert not first.done()  # still waiting for company
        second = await batcher.submit("b")
        answers = [await first, second]
        await batcher.close()
        return answers

    assert asyncio.run(main()) == [(("out", "a"), 2), (("out", "b"), 2)]
    assert model.batches == [["a", "b"]]


def test_submit_many_keeps_one_requests_items_together_and_in_order():
    model = FakeModel()

    async def main():
        batcher = Batcher(model, max_batch=3, max_delay_ms=0)
        answers = await asyncio.gather(batcher.submit_many(["x", "y", "z", "w"]),
                                       batcher.submit("single"))
        await batcher.close()
        return answers

    many, single = asyncio.run(main())
    assert many == [(("out", "x"), 3), (("out", "y"), 3), (("out", "z"), 3),
                    (("out", "w"), 2)]
    assert single == (("out", "single"), 2)
    assert model.batches == [["x", "y", "z"], ["w", "single"]]


def test_a_failing_model_call_fails_only_its_batch_and_the_batcher_goes_on():
    model = FakeModel()

    async def main():
        batcher = Batcher(model, max_batch=2, max_delay_ms=0)
        first = await asyncio.gather(*(batcher.submit(x) for x in ("a", "bad", "c", "d")),
                                     return_exceptions=True)
        later = await batcher.submit("e")
        await batcher.close()
        return first, later

    first, later = asyncio.run(main())
    assert model.batches == [["a", "bad"], ["c", "d"], ["e"]]
    assert [type(answer) for answer in first[:2]] == [ValueError, ValueError]
    assert first[2:] == [(("out", "c"), 2), (("out", "d"), 2)]
    assert later == (("out", "e"), 1)


def test_a_caller_that_went_away_is_left_out_of_the_batch():
    model = FakeModel()

    async def main():
        batcher = Batcher(model, max_batch=4, max_delay_ms=0)
        gone = asyncio.ensure_future(batcher.submit("gone"))
        kept = asyncio.ensure_future(batcher.submit("kept"))
        await asyncio.sleep(0)  # both queued
        gone.cancel()
        answer = await kept
        await batcher.close()
        return answer

    assert asyncio.run(main()) == (("out", "kept"), 1)
    assert model.batches == [["kept"]]


def test_close_answers_every_waiting_caller_and_refuses_new_items():
    hold = threading.Event()
    model = FakeModel(hold)

    async def main():
        batcher = Batcher(model, max_batch=1, max_delay_ms=0)
        waiting = [asyncio.ensure_future(batcher.submit(x)) for x in ("running", "queued")]
        await asyncio.to_thread(model.started.wait, 60)  # "running" is in the model call
        await batcher.close()
        outcomes = await asyncio.gather(*waiting, return_exceptions=True)
        with pytest.raises(BatcherClosed):
            await batcher.submit("late")
        return outcomes

    try:
        outcomes = asyncio.run(main())
    finally:
        hold.set()  # let the model thread finish
    assert [type(outcome) for outcome in outcomes] == [BatcherClosed, BatcherClosed]
    assert model.batches == [["running"]]


def test_model_calls_run_that_many_batches_at_once():
    """On a CPU the server keeps one model call per core plus one in flight
    (batching.model_calls). Each call here waits until the others have started too: fewer
    calls at a time would time out (BrokenBarrierError)."""
    all_running = threading.Barrier(3, timeout=10)

    def model(items):
        all_running.wait()
        return [("out", item) for item in items]

    async def main():
        batcher = Batcher(model, max_batch=1, max_delay_ms=0,
                          model_calls=batching.model_calls("cpu", cores=2))
        answers = await asyncio.gather(*(batcher.submit(x) for x in "abc"))
        await batcher.close()
        return answers

    assert asyncio.run(main()) == [(("out", x), 1) for x in "abc"]


def test_several_model_calls_share_out_the_waiting_items():
    """Two calls busy, four items waiting: the first call to free up takes its share (2), not
    the whole queue, and the others follow one by one as the waiting shrinks."""
    hold = threading.Event()
    model = FakeModel(hold)

    async def main():
        batcher = Batcher(model, max_batch=8, max_delay_ms=0, model_calls=2)
        busy = []
        for x in "ab":  # one at a time: each call running, and held, before the next item
            busy.append(asyncio.ensure_future(batcher.submit(x)))
            await asyncio.wait_for(until(lambda: len(model.batches) == len(busy)), 10)
        waiting = [asyncio.ensure_future(batcher.submit(x)) for x in "cdef"]
        await asyncio.sleep(0.05)  # all four queued behind the two calls
        hold.set()
        answers = await asyncio.gather(*busy, *waiting)
        await batcher.close()
        return answers

    answers = asyncio.run(main())
    assert model.batches == [["a"], ["b"], ["c", "d"], ["e"], ["f"]]
    # Each caller gets its own item's answer, with its call's size, whichever call ran it.
    assert answers == [(("out", x), size) for x, size in zip("abcdef", [1, 1, 2, 2, 1, 1],
                                                             strict=True)]


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


def test_model_calls_share_out_the_cores():
    assert batching.model_calls("cuda", cores=2) == 1
    assert batching.model_calls("cpu", cores=16, requested=2) == 2
    assert batching.threads_per_call(2, calls=3) == 1
    assert batching.threads_per_call(16, calls=2) == 8
