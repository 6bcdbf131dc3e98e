"""`labrun bench trainer` and `labrun bench startup`: what labrun's loop and start-up cost.

trainer: images/s of TrainingSession.train_epoch() against a bare 20-line PyTorch loop on the
    same model, the same in-memory uint8 batches and the same batch size, on the CPU, in one
    run (rounds interleaved, best of each). Target: ratio >= 0.97.
startup: wall time from launching `python train.py logger=csv` to the end of its first
    optimizer step, against `python -c "import torch, torchvision"`. Target: under 1.5 s more.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torchvision

from labrun.bench import write_json

PROJECT = Path(__file__).resolve().parents[2]


def configure_trainer(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="resnet18", help="torchvision model (default resnet18)")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=15, help="optimizer steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="FILE")


def _batches(args, generator: torch.Generator):
    shape = (args.batch_size, 3, args.image_size, args.image_size)
    return [(torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator),
             torch.randint(0, 10, (args.batch_size,), generator=generator))
            for _ in range(args.steps)]


class _InMemoryLoader:
    """Stands in for the session's DataLoader: the same ready batches every epoch."""

    class sampler:  # noqa: N801 - the attribute the session calls
        @staticmethod
        def set_epoch(epoch: int, start: int = 0) -> None:
            pass

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def _bare_loop(model, batches, mean, std) -> float:
    """What a person writes by hand: the baseline."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()
    start = time.perf_counter()
    for images, labels in batches:
        x = images.float().sub_(mean * 255).div_(std * 255)
        loss = torch.nn.functional.cross_entropy(model(x), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return len(batches) * len(batches[0][1]) / (time.perf_counter() - start)


def _session(args, run_dir: Path):
    """A TrainingSession on the same model, its loader replaced by the in-memory batches."""
    from hydra import compose, initialize_config_dir

    from labrun import config, models
    from labrun.checkpoint import CheckpointManager
    from labrun.data import Data
    from labrun.data.sources import ArraySource
    from labrun.distributed import Distributed
    from labrun.session import TrainingSession
    from labrun.tracking import RunFolder

    config.register()
    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[
            f"paths.run_dir={run_dir}", "optimizer=sgd", "optimizer.weight_decay=0",
            "optimizer.nesterov=false", "schedule=constant", "logger=none",
            "trainer.progress=none", f"trainer.batch_size={args.batch_size}",
            "dataset=synthetic", f"dataset.image_size={args.image_size}",
            "model=torchvision", f"model.name={args.model}", "dataset.num_workers=0",
            f"trainer.log_every_n_steps={args.steps}"])
    images = torch.zeros((args.batch_size, args.image_size, args.image_size, 3), dtype=torch.uint8)
    labels = torch.zeros(args.batch_size, dtype=torch.int64)
    source = ArraySource(images.numpy(), labels.numpy(), "bench", [str(i) for i in range(10)])
    data = Data({"train": source, "val": source}, cfg.dataset)
    model = models.build(cfg.model, 10)
    session = TrainingSession(cfg, data, model, folder=RunFolder(run_dir, enabled=False),
                              checkpoints=CheckpointManager(run_dir), dist=Distributed())
    return session


def run_trainer(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    batches = _batches(args, torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        session = _session(args, Path(tmp))
        bare = torchvision.models.get_model(args.model, num_classes=10)  # the same, by hand
        mean, std = session.normalize.mean, session.normalize.std
        session.train_loader = _InMemoryLoader(batches)
        session.steps_per_epoch = len(batches)
        best = {"bare": 0.0, "session": 0.0}
        for _ in range(args.rounds):
            best["bare"] = max(best["bare"], _bare_loop(bare, batches, mean, std))
            start = time.perf_counter()
            session.position = 0
            session.train_epoch()
            seen = len(batches) * args.batch_size
            best["session"] = max(best["session"], seen / (time.perf_counter() - start))
    ratio = best["session"] / best["bare"]
    print(f"trainer ({args.model}, {args.image_size} px, batch {args.batch_size}, CPU):")
    print(f"  bare PyTorch loop   {best['bare']:8.1f} images/s")
    print(f"  TrainingSession     {best['session']:8.1f} images/s")
    print(f"  ratio               {ratio:8.3f}   (target >= 0.97)")
    write_json(args.json, {"bare": best["bare"], "session": best["session"], "ratio": ratio})
    return 0


def configure_startup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="FILE")


def run_startup(args: argparse.Namespace) -> int:
    imports, first_step = [], []
    for _ in range(args.repeats):
        # Both are timed from launch to a moment inside the process (interpreter shutdown,
        # which tears torch down slowly, is not counted in either).
        start = time.time()
        done = subprocess.run([sys.executable, "-c", "import torch, torchvision, time; "
                               "print(time.time())"], check=True, capture_output=True, text=True)
        imports.append(float(done.stdout) - start)
        with tempfile.TemporaryDirectory() as tmp:
            start = time.time()
            subprocess.run([sys.executable, str(PROJECT / "train.py"), "logger=csv",
                            "trainer.max_epochs=1", "trainer.limit_train_batches=1",
                            "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1",
                            "trainer.progress=none", f"hydra.run.dir={tmp}"],
                           check=True, cwd=PROJECT, capture_output=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
            first = json.loads((Path(tmp) / "metrics.jsonl").read_text().splitlines()[0])
            first_step.append(first["time"] - start)
    extra = min(first_step) - min(imports)
    print("start-up (best of", args.repeats, "):")
    print(f"  python -c 'import torch, torchvision'   {min(imports):6.2f} s")
    print(f"  python train.py to its first step        {min(first_step):6.2f} s")
    print(f"  difference                               {extra:6.2f} s   (target < 1.5 s)")
    write_json(args.json, {"import_torch_s": min(imports), "first_step_s": min(first_step),
                            "difference_s": extra})
    return 0
