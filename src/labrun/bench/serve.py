"""Serving benchmark: POST /predict through a real `labrun serve` process vs the bare runtime.

In one run, on the same JPEGs and the same exported model:
    served:     --clients threads POST JPEGs to /predict on 127.0.0.1 (uvicorn, one worker,
                dynamic batching with --max-batch and --max-delay-ms)
    unbatched:  the same to a second server started with --max-batch 1
    free model: the same to a third server, with the served server's settings, whose model costs
                almost nothing (a 1-channel CNN, 0.1% of ResNet-18's multiply-adds): what HTTP,
                multipart, decoding, preprocessing and the clients cost without the model
    direct:     --clients threads call the runtime, built as the server builds it (one intra-op
                thread a call on a CPU), on the same images already decoded, resized and
                normalised, one image a call
    ceiling:    the runtime on batches of 1, 2, 4, ... 32 of those images, in both ways of using
                the cores: one call at a time on every core, and one call per core at once on
                one thread each; the best images/s (or direct's, if higher) is the runtime's own
                ceiling
    latency:    p50/p99 of the served server at 1, 4 and --clients clients

    ratio                      served req/s / direct calls/s
    ratio_to_ceiling           served req/s / ceiling images/s: what HTTP, multipart, decoding
                               and preprocessing cost on top of the model, batching included
    ratio_batched_to_unbatched served / unbatched req/s: what dynamic batching gains
    bound                      an estimate of the most a server could serve here, from the two
                               measured costs (noise can put served a little above it):
                               on a CPU, the model's and the rest's work take turns on the same
                               cores, 1/ceiling + 1/free_model seconds a request; on a GPU they
                               overlap, and the slower of the two sets the pace
    ratio_to_bound             served / bound: how close the server's scheduling comes to that

Targets (SERVE_TARGETS, serve_targets(); each a floor, required, and a goal): no served
request fails; the goals ratio_to_ceiling >= 0.95 and ratio_to_bound >= 0.95; batching gains
>= 3x where the model runs on CUDA (on a CPU one call already uses every core, so batching
cannot gain much: the target is shown, not checked); the goal p99 at one client under
--max-delay-ms plus two lone batch-1 calls of the server's runtime (it includes the client's
own time). The floors, set from runs here, are beside the constants.

The model is an untrained torchvision resnet18 (1,000 classes, 224 px, no weight download),
exported by `labrun export`'s own code from a checkpoint in labrun's format (ONNX; TorchScript
where only torch can use the GPU, or with --format). Clients and servers share this machine's
cores, as they do in any loopback measurement, so the clients are kept cheap: the standard
library's http.client on kept-alive connections, each request's multipart body built once
(httpx, which builds every request anew, took 2.6 ms of CPU a request here against
http.client's 0.4 ms: more than half of what the server itself spends on a request besides the
model). Rounds alternate, each side keeping its best.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

import labrun
from labrun.bench import write_json
from labrun.bench.load import measure, multipart_body, new_client, post_call
from labrun.bench.targets import Target, Verdict, judge, report
from labrun.core.errors import LabrunError
from labrun.deploy import batching, export
from labrun.deploy import runtime as inference
from labrun.tasks.classification import Predictor
from labrun.train.checkpoint import save_weights_only

NUM_IMAGES = 16
CEILING_BATCHES = (1, 2, 4, 8, 16, 32)
# The ceiling's two ways of using the cores (the server's is the second one on a CPU).
ONE_CALL, CALL_PER_CORE = "one call on every core", "one call per core at once"
LATENCY_CLIENTS = (1, 4)  # besides --clients
# A served request that fails is a defect whatever the speed (a count: its floor is its goal, no
# failure). The goals: the server adds at most 5% to the runtime's own best (issue 17), and comes
# within 5% of the bound. The floors: seven runs here (2 cores shared with other engineers' tests,
# load 3-6; five of `labrun bench serve`, the last two in `make bench`), the worst moved by
# targets.WIDE_MARGIN (25%: the runs spread by 100% or more, the server, its 16 clients and the
# load sharing two cores; the worst, 0.458 and 0.535, came at load 4 while the others were at
# 0.79-1.13).
#   ratio_to_ceiling 0.786 0.458 0.886 0.832 0.874 1.04 0.849 -> floor 0.34, and
#   ratio_to_bound 0.859 0.535 1.02 0.964 0.954 1.13 0.979 -> floor 0.40. They catch a server that
#     lost 60% of its speed against its runtime in a typical run (the medians, 0.849 and 0.964), a
#     quarter in the worst: gross breakage only (every request queued behind a lone model call,
#     say); a loss of 10-30% passes them, and shows in the goals' distance.
SERVE_TARGETS = (Target("errors", "<", floor=1, goal=1),
                 Target("ratio_to_ceiling", ">=", floor=0.34, goal=0.95, of=("served", "ceiling"),
                        runs=(0.786, 0.458, 0.886, 0.832, 0.874, 1.04, 0.849)),
                 Target("ratio_to_bound", ">=", floor=0.40, goal=0.95, of=("served", "bound"),
                        runs=(0.859, 0.535, 1.02, 0.964, 0.954, 1.13, 0.979)))
# Required where the model runs on CUDA only, with its goal as its floor (no GPU here to
# measure it on); on this machine's CPU, where it is shown, it was 0.852-1.13 in the seven runs.
BATCHING_GAIN_ON_CUDA = 3.0
# p99 at one client over its bound (the goal: under it): 1.10 0.600 0.789 0.651 1.21 1.18 0.651 in
# the seven runs, a lone client's slowest requests being the ones the load delays -> floor 1.6
# (targets.WIDE_MARGIN). It catches a lone request's p99 twice as long as in a typical run (the
# median, 0.789), a third longer than in the worst: a request waiting for a batch that never fills,
# say, or queued behind another model call.
P99_1_RUNS = (1.1, 0.6, 0.789, 0.651, 1.21, 1.18, 0.651)


def serve_targets(device: str) -> tuple[Target, ...]:
    """SERVE_TARGETS, plus the targets whose weight depends on where the model runs."""
    cuda = device == "cuda"
    return (*SERVE_TARGETS,
            Target("ratio_batched_to_unbatched", ">=", floor=BATCHING_GAIN_ON_CUDA,
                   goal=BATCHING_GAIN_ON_CUDA, required=cuda,
                   of=("served", "unbatched"),
                   note="required (CUDA)" if cuda else f"on CUDA only; here: {device}"),
            Target("p99_1_to_bound", "<", floor=1.6, goal=1.0, of=("p99_1_ms", "bound_1_ms"),
                   runs=P99_1_RUNS))


def configure(parser) -> None:
    parser.add_argument("--requests", type=int, default=400,
                        help="measured requests (and direct calls) per round, after a warm-up "
                             "(default 400)")
    parser.add_argument("--clients", type=int, default=16,
                        help="concurrent clients (default 16)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternating rounds; each side keeps its best (default 2)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--max-batch", type=int, default=batching.MAX_BATCH, metavar="N",
                        help=f"the served server's --max-batch (default {batching.MAX_BATCH})")
    parser.add_argument("--max-delay-ms", type=float, default=batching.MAX_DELAY_MS,
                        metavar="T", help="the served server's --max-delay-ms (default "
                                          f"{batching.MAX_DELAY_MS:g})")
    parser.add_argument("--format", default="auto", choices=("auto", "onnx", "torchscript"),
                        help="the exported model (default auto: ONNX, or TorchScript when "
                             "torch has CUDA and onnxruntime does not)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help="write the figures here as JSON")


def run(args) -> list[Verdict]:
    # FastAPI and uvicorn: imported only for this benchmark, not for `labrun bench`.
    from labrun.deploy.serve import load_model
    from labrun.deploy.served import serving

    if min(args.requests, args.clients, args.rounds, args.max_batch) < 1:
        raise LabrunError("--requests, --clients, --rounds and --max-batch must be 1 or more")
    fmt = pick_format(args.format)
    with tempfile.TemporaryDirectory(prefix="labrun-bench-serve-") as tmp, \
            contextlib.ExitStack() as servers:
        folder = Path(tmp)
        model = export_model(folder / "resnet18", args.image_size, fmt, RESNET18)
        free_model = export_model(folder / "free", args.image_size, fmt, FREE_MODEL)
        jpegs = make_jpegs(args.image_size)
        bodies = [multipart_body(f"{i}.jpg", jpeg) for i, jpeg in enumerate(jpegs)]
        # The direct side: the server's runtime, loaded as `labrun serve` loads it (by default
        # one intra-op thread a call on a CPU), its inputs already decoded, resized and
        # normalised.
        cores = inference.default_threads(1)
        predictor, _, _ = load_model(model, cores, None)
        # The ceiling's other way of using the cores: one call on all of them.
        whole = Predictor(model, cores)
        images = torch.stack([predictor.prepare(j) for j in jpegs])
        inputs = [predictor.normalize(images[i:i + 1]) for i in range(len(jpegs))]
        batches = {b: predictor.normalize(images[torch.arange(b) % len(jpegs)])
                   for b in CEILING_BATCHES}
        batching_args = ("--log-level", "warning", "--max-batch", str(args.max_batch),
                         "--max-delay-ms", str(args.max_delay_ms))
        batched = servers.enter_context(serving(model, folder / "served.log",
                                                args=batching_args))
        free = servers.enter_context(serving(free_model, folder / "free.log",
                                             args=batching_args))
        unbatched = servers.enter_context(serving(
            model, folder / "unbatched.log", args=("--log-level", "warning", "--max-batch", "1")))

        def post(server, clients: int, requests: int) -> dict[str, Any]:
            return measure(lambda: new_client(server.port), post_call(bodies), requests, clients)

        def direct_call(_, i: int) -> bool:
            predictor.runtime(inputs[i % len(inputs)])
            return True

        def ceiling_round() -> dict[str, dict[int, float]]:
            """images/s at each batch size in both ways of using the cores, ~requests/4
            images each."""
            ways = {ONE_CALL: (whole, 1), CALL_PER_CORE: (predictor, cores)}
            per_s: dict[str, dict[int, float]] = {}
            for way, (runner, callers) in ways.items():
                for b in CEILING_BATCHES:
                    def call(_, i: int, run=runner.runtime, batch=batches[b]) -> bool:
                        return bool(run(batch).size)
                    calls = max(2 * callers, math.ceil(args.requests / 4 / b))
                    per_s.setdefault(way, {})[b] = measure(
                        lambda: None, call, calls, callers, warmup=1)["per_s"] * b
            return per_s

        def lone_call_ms() -> float:
            """A batch-1 call of the server's runtime with nothing else running."""
            return measure(lambda: None, direct_call, 20, 1, warmup=2)["p50_ms"]

        # Rounds alternate, and each side keeps its best: other processes on the machine then
        # slow every side alike instead of one of them.
        rounds = [{"served": post(batched, args.clients, args.requests),
                   "unbatched": post(unbatched, args.clients, args.requests),
                   "free_model": post(free, args.clients, args.requests),
                   "direct": measure(lambda: None, direct_call, args.requests, args.clients),
                   "ceiling": ceiling_round(), "lone_call_ms": lone_call_ms()}
                  for _ in range(args.rounds)]
        latency = {clients: post(batched, clients, max(clients * 10, args.requests // 4))
                   for clients in LATENCY_CLIENTS if clients < args.clients}
    sides = ("served", "unbatched", "free_model", "direct")
    best = {side: max((r[side] for r in rounds), key=lambda m: m["per_s"]) for side in sides}
    served, unbatched, free_model, direct = (best[side] for side in sides)
    # Every request to a server counts, the latency runs' too.
    errors = sum(r[side]["errors"] for r in rounds for side in sides[:3]) + \
        sum(m["errors"] for m in latency.values())
    by_way = {way: {b: max(r["ceiling"][way][b] for r in rounds) for b in CEILING_BATCHES}
              for way in (ONE_CALL, CALL_PER_CORE)}
    by_batch = {b: max(by_way[way][b] for way in by_way) for b in CEILING_BATCHES}
    ceiling_batch = max(by_batch, key=by_batch.get)
    best_way = max(by_way, key=lambda way: by_way[way][ceiling_batch])
    ceiling = {"per_s": max(by_batch[ceiling_batch], direct["per_s"]),
               "batch": ceiling_batch if by_batch[ceiling_batch] >= direct["per_s"] else 1,
               "way": best_way if by_batch[ceiling_batch] >= direct["per_s"] else "direct",
               "by_batch": by_batch, "by_way": by_way}
    bound = serving_bound(ceiling["per_s"], free_model["per_s"], predictor.device)
    latency[args.clients] = served
    # Below saturation (one client: one image a batch), a request waits at most --max-delay-ms
    # for company, then its own model call, with one call's slack for everything else.
    lone_ms = min(r["lone_call_ms"] for r in rounds)
    bound_1_ms = args.max_delay_ms + 2 * lone_ms
    result = {
        "model": "resnet18", "format": fmt, "device": predictor.device,
        "image_size": args.image_size, "clients": args.clients, "requests": args.requests,
        "rounds": args.rounds, "max_batch": args.max_batch, "max_delay_ms": args.max_delay_ms,
        "client": "http.client", "errors": errors, "served": served, "unbatched": unbatched,
        "free_model": free_model, "direct": direct, "ceiling": ceiling,
        "bound": {"per_s": bound},
        "latency": {str(c): {"p50_ms": m["p50_ms"], "p99_ms": m["p99_ms"], "per_s": m["per_s"]}
                    for c, m in sorted(latency.items())},
        "ratio": served["per_s"] / direct["per_s"],
        "ratio_to_ceiling": served["per_s"] / ceiling["per_s"],
        "ratio_batched_to_unbatched": served["per_s"] / unbatched["per_s"],
        "ratio_to_bound": served["per_s"] / bound,
        "lone_call_ms": lone_ms, "latency_bound_1_ms": bound_1_ms,
        "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "versions": {"labrun": labrun.__version__, "torch": torch.__version__,
                     "onnxruntime": _version("onnxruntime"), "uvicorn": _version("uvicorn"),
                     "fastapi": _version("fastapi")},
    }
    print_result(result, latency)
    write_json(args.json, result)
    p99_1 = latency[min(latency)]["p99_ms"]
    figures = {"errors": errors, "served": served["per_s"],
               "ceiling": ceiling["per_s"], "unbatched": unbatched["per_s"], "bound": bound,
               "ratio_to_ceiling": result["ratio_to_ceiling"],
               "ratio_batched_to_unbatched": result["ratio_batched_to_unbatched"],
               "ratio_to_bound": result["ratio_to_bound"],
               "p99_1_ms": p99_1, "bound_1_ms": bound_1_ms, "p99_1_to_bound": p99_1 / bound_1_ms}
    return judge("serve", figures, serve_targets(predictor.device))


def serving_bound(ceiling_per_s: float, free_model_per_s: float, device: str) -> float:
    """An estimate of the most requests/s a server could answer here, from the model's best
    images/s alone and the server's requests/s without a model (the module's docstring says
    why)."""
    if device == "cuda":
        return min(ceiling_per_s, free_model_per_s)
    return 1 / (1 / ceiling_per_s + 1 / free_model_per_s)


def print_result(result: dict[str, Any], latency: dict[int, dict[str, Any]]) -> None:
    served, unbatched, direct, ceiling = (result[k] for k in ("served", "unbatched", "direct",
                                                              "ceiling"))
    print(f"serving resnet18 ({result['format']}, {result['device']}) at "
          f"{result['image_size']} px: {result['requests']} requests from {result['clients']} "
          f"clients on 127.0.0.1, {result['cpu_count']} cores, best of {result['rounds']} "
          f"rounds; --max-batch {result['max_batch']} --max-delay-ms {result['max_delay_ms']:g}")
    print(f"  POST /predict             {served['per_s']:7.1f} req/s    p50 "
          f"{served['p50_ms']:6.1f} ms  p99 {served['p99_ms']:6.1f} ms  errors {result['errors']}")
    print(f"  ... with --max-batch 1    {unbatched['per_s']:7.1f} req/s    p50 "
          f"{unbatched['p50_ms']:6.1f} ms  p99 {unbatched['p99_ms']:6.1f} ms")
    free = result["free_model"]
    print(f"  ... with a free model     {free['per_s']:7.1f} req/s    p50 "
          f"{free['p50_ms']:6.1f} ms  p99 {free['p99_ms']:6.1f} ms  (all but the model)")
    print(f"  runtime direct, batch 1   {direct['per_s']:7.1f} calls/s  p50 "
          f"{direct['p50_ms']:6.1f} ms  p99 {direct['p99_ms']:6.1f} ms")
    for way, by_batch in ceiling["by_way"].items():
        print(f"  runtime, {way:25s} " + "  ".join(
            f"b{b} {v:.1f}" for b, v in by_batch.items()) + " images/s")
    print(f"  ceiling                   {ceiling['per_s']:7.1f} images/s (batch "
          f"{ceiling['batch']}, {ceiling['way']})")
    print(f"  bound                     {result['bound']['per_s']:7.1f} req/s (model and the "
          f"rest on {'the GPU and the CPU' if result['device'] == 'cuda' else 'the same cores'})")
    print("  served latency            " + "  ".join(
        f"{c} client{'s' * (c > 1)}: p50 {m['p50_ms']:.0f} / p99 {m['p99_ms']:.0f} ms"
        for c, m in sorted(latency.items())))
    print(f"  ratio served/direct {result['ratio']:.3f}, served/ceiling "
          f"{result['ratio_to_ceiling']:.3f}, batched/unbatched "
          f"{result['ratio_batched_to_unbatched']:.3f}, served/bound "
          f"{result['ratio_to_bound']:.3f}")


# ---------------------------------------------------------------------------------------------
# The model and the images


def pick_format(choice: str) -> str:
    """--format auto: ONNX, unless only torch can use the GPU here (goal: measure on CUDA)."""
    if choice != "auto":
        return choice
    import onnxruntime

    if torch.cuda.is_available() and \
            "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return "torchscript"
    return "onnx"


# What the benchmark serves: ResNet-18, and a model that costs almost nothing (one channel in
# each of SimpleCNN's three conv blocks), both untrained, with 1,000 classes.
RESNET18 = {"_target_": "labrun.models.torchvision_model", "_partial_": True, "name": "resnet18"}
FREE_MODEL = {"_target_": "labrun.models.SimpleCNN", "_partial_": True, "width": 1}


def export_model(folder: Path, size: int, fmt: str, model_cfg: dict[str, Any]) -> Path:
    """An untrained checkpoint in labrun's format, exported by labrun.deploy.export."""
    from omegaconf import OmegaConf

    from labrun import models

    class_names = [f"class_{i}" for i in range(1000)]
    model = models.build(OmegaConf.create(model_cfg), len(class_names))
    checkpoint = save_weights_only(
        folder / "model.pt", model.state_dict(), class_names=class_names,
        config={"model": model_cfg, "checkpoint": {"monitor": "val/acc"},
                "dataset": {"name": "imagenet-like", "image_size": size,
                            "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
                            "augment": {"val_resize_ratio": 0.875}}})
    suffix = ".onnx" if fmt == "onnx" else ".torchscript.pt"
    return export.export(checkpoint, out=folder / f"model{suffix}", fmt=fmt,
                         check_data="random").path


def make_jpegs(size: int) -> list[bytes]:
    """Photo-like JPEGs (smooth shapes plus grain) a little larger than the input, as a camera
    image scaled for upload would be."""
    import cv2

    rng = np.random.default_rng(0)
    jpegs = []
    for _ in range(NUM_IMAGES):
        height, width = int(size * rng.uniform(1.2, 1.8)), int(size * rng.uniform(1.2, 1.8))
        coarse = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
        image = cv2.resize(coarse, (width, height), interpolation=cv2.INTER_CUBIC)
        image = np.clip(image + rng.normal(0, 8, image.shape), 0, 255).astype(np.uint8)
        ok, encoded = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 90])
        jpegs.append(encoded.tobytes())
    return jpegs


def _version(package: str) -> str:
    from importlib.metadata import version
    return version(package)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    configure(parser)
    sys.exit(report(run(parser.parse_args()), check=True))
