"""Shared fixtures: the project's paths, a runner for the real `python train.py`, and trained
runs made once per test session and reused (training is the slow part)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

import text_fixtures
from labrun.core.project import LABRUN_CONF

PROJECT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
LABRUN = str(Path(PYTHON).with_name("labrun"))

# Fast, CPU-only, no W&B: the defaults of every test run unless a test says otherwise.
FAST = ["logger=csv", "trainer.progress=log", "dataset.num_workers=0"]

# A suite started in the background of a shell without job control (`make test &` in a script)
# inherits SIGINT ignored, and so would every process it starts: the tests that stop runs,
# sweeps and servers with Ctrl-C would wait for them in vain. The suite's processes get
# SIGINT's default back (a handler, unlike SIG_IGN, is not inherited across exec).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# One intra-op thread for torch in every process the tests start (they inherit it, and so do
# the SLURM jobs they submit): `make test` runs two xdist workers on two cores, so a process with
# two threads waits at every parallel region for the thread that the other worker's process has
# descheduled, and spins meanwhile. Measured here with the suite running beside it: a
# THREE_EPOCHS run took 94 s and 33 CPU-s with two threads, 29 s and 18 CPU-s with one.
# Every comparison of weights is between runs made with this same setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def run_train(*overrides: str, run_dir: Path | None = None, check: bool = True,
              env: dict[str, str] | None = None, timeout: int = 300
              ) -> subprocess.CompletedProcess:
    """Run the real `python train.py` with `overrides` (plus FAST, which overrides may change).

    timeout: the longest run a test starts (THREE_EPOCHS: 66 steps, two workers) took
    about 140 s on a loaded 2-core machine; 300 s leaves room for more load, and a hung run
    fails instead of blocking the suite."""
    args = [PYTHON, str(PROJECT / "train.py"), *FAST, *overrides]
    if run_dir is not None:
        args.append(f"hydra.run.dir={run_dir}")
    result = subprocess.run(args, cwd=PROJECT, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **(env or {})})
    if check and result.returncode != 0:
        raise AssertionError(f"train.py failed ({result.returncode}):\n{result.stdout[-3000:]}"
                             f"\n{result.stderr[-3000:]}")
    return result


def start_train(*overrides: str, run_dir: Path, env: dict[str, str] | None = None,
                output=subprocess.PIPE) -> subprocess.Popen:
    """The real `python train.py` (FAST + overrides) in the background, for tests that stop it."""
    args = [PYTHON, str(PROJECT / "train.py"), *FAST, *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(args, cwd=PROJECT, stdout=output, stderr=output, text=True,
                            env={**os.environ, **(env or {})})


def as_typed_in_a_terminal() -> None:
    """preexec_fn of a launch that stands for a command typed in a terminal: a session of its
    own (the terminal's process group) and SIGHUP at its default action, as a shell leaves it,
    even when the suite itself runs under nohup, whose ignored SIGHUP every child inherits."""
    os.setsid()
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@contextlib.contextmanager
def sweep_in_process(sweep_dir: Path, *overrides: str):
    """Hydra's context and master config of `python train.py -m OVERRIDES` composed in this
    process, as a launcher is set up with them (launch/slurm.SlurmLauncher.setup)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import HydraContext, RunMode

    from labrun.config import schema
    from labrun.core.project import LABRUN_CONF

    schema.register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(LABRUN_CONF), version_base="1.3"):
        hydra = GlobalHydra.instance().hydra
        master = hydra.compose_config("train", overrides=[
            "hydra.mode=MULTIRUN", *overrides, f"hydra.sweep.dir={sweep_dir}"],
            run_mode=RunMode.MULTIRUN, with_log_configuration=False)
        yield HydraContext(config_loader=hydra.config_loader, callbacks=None), master


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Until `path` exists; fails if the process ends first or time runs out.

    timeout: what a test waits for is written by a run before it ends, so the time run_train
    allows a whole run (300 s) is enough; 120 s was not far above the ~85 s a THREE_EPOCHS run
    took to reach its step-35 checkpoint on a loaded 2-core machine."""
    deadline = time.time() + timeout
    while not path.exists():
        if proc.poll() is not None:
            detail = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"run ended before {path.name}: {detail}")
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.02)  # a stat costs microseconds: react to the file (a kill) promptly


def run_labrun(*args: str, check: bool = True, timeout: int = 300, cwd: Path = PROJECT,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # timeout: the slowest command a test runs (`labrun resume` of a THREE_EPOCHS run) is a
    # run's remainder at most: the same 300 s as run_train.
    result = subprocess.run([LABRUN, *args], cwd=cwd, capture_output=True, text=True,
                            timeout=timeout, env={**os.environ, **(env or {})})
    if check and result.returncode != 0:
        raise AssertionError(f"labrun {' '.join(args)} failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def freeze_outside_the_journal_lock(pid: int, journal: Path) -> None:
    """SIGSTOP `pid` at a moment it does not hold the Optuna journal's lock (a symlink beside
    the journal while a process writes to it). Stopped while holding it, a trial would keep the
    study and the other trials out of the journal for Optuna's grace period (30 s), after which
    they break the lock, and the trial fails when it comes back ("did not possess lock"). A
    stopped process cannot take the lock: if the lock is free once it has stopped, it holds
    nothing."""
    lock = Path(f"{journal}.lock")
    for _ in range(500):  # the lock is held for milliseconds at a time
        os.kill(pid, signal.SIGSTOP)
        while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.001)  # the signal is delivered, and the process stopped, in moments
        if not os.path.lexists(lock):
            return
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.01)
    raise AssertionError(f"{lock} was held at every try")


def wait_for_text(path: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until `text` appears in the file `path` (a process's log); fails if `proc` ends first or
    time runs out, with what the file holds."""
    deadline = time.time() + timeout
    while not (path.is_file() and text in path.read_text(errors="replace")):
        assert proc.poll() is None and time.time() < deadline, path.read_text(errors="replace")
        time.sleep(0.1)


def nvml_stand_in(folder: Path, gpus: int, cuda_driver: int | None = None,
                  driver: str | None = None) -> dict[str, str]:
    """A pynvml module answering as a node with `gpus` GPUs (and, if given, a driver running
    CUDA up to `cuda_driver`, 12020 for 12.2) answers it, written into `folder`; returns the
    environment of a process that imports it first (no GPU here, and no CUDA_VISIBLE_DEVICES
    to hide what NVML says)."""
    lines = ["class NVMLError(Exception):", "    pass",
             "def nvmlInit():", "    pass",
             "def nvmlShutdown():", "    pass",
             "def nvmlDeviceGetCount():", f"    return {gpus}"]
    if cuda_driver is not None:
        lines += ["def nvmlSystemGetCudaDriverVersion():", f"    return {cuda_driver}",
                  "def nvmlSystemGetDriverVersion():", f"    return {driver!r}"]
    (folder / "pynvml.py").write_text("\n".join(lines) + "\n")
    env = {key: value for key, value in os.environ.items() if key != "CUDA_VISIBLE_DEVICES"}
    env["PYTHONPATH"] = os.pathsep.join([str(folder), env.get("PYTHONPATH", "")])
    return env


# A task whose items are not its samples: odd labels are ignored (as padding tokens or void
# pixels are), so micro-batches of the same size hold different numbers of items. Its count is
# a tensor, as such a count must be (it differs between micro-batches and ranks).
EVEN_LABELS = """
import os

import torch.nn.functional as F

from labrun.train.task import Classification


class EvenLabels(Classification):
    def count(self, batch):
        items = (batch[1] % 2 == 0).sum()
        with open(os.environ["COUNTS_FILE"], "a") as counts:  # what the test looks at
            counts.write(f"{int(items)}\\n")
        return items

    def loss(self, model, batch):
        images, labels = batch
        ignored = labels.masked_fill(labels % 2 == 1, -100)
        return F.cross_entropy(model(images), ignored, reduction="sum", ignore_index=-100)
"""


def even_labels_task(folder: Path) -> Path:
    """EVEN_LABELS as the lab's module `labtask` in `folder` (task._target_=labtask.EvenLabels)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "labtask.py").write_text(EVEN_LABELS)
    return folder


def even_labels_env(folder: Path, counts: Path) -> dict[str, str]:
    """A run's environment that imports labtask from `folder` and writes its counts to
    `counts`, one line per micro-batch (every rank's)."""
    return {"PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]),
            "COUNTS_FILE": str(counts)}


def read_counts(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()]


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_dashboard(path: Path, *args: str, timeout: float = 120
                    ) -> tuple[subprocess.Popen, str, list[str]]:
    """`labrun dashboard PATH --port P ARGS` started, once it has printed where to reach the
    tool: (the process, the tool's URL without its page, the lines it printed). 120 s: optuna-dashboard and TensorBoard
    start in a few seconds; a slow start on loaded cores must not fail the test."""
    port = free_port()
    proc = subprocess.Popen([LABRUN, "dashboard", str(path), "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=PROJECT)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break  # it ended
        lines.append(line.rstrip())
        if line.startswith("Ctrl-C stops"):  # its last line, after the URL and the ssh line
            url = next(line.split()[1] for line in lines if line.startswith("open "))
            return proc, url.rstrip("/").removesuffix("/dashboard"), lines
    proc.kill()
    raise AssertionError("labrun dashboard printed no URL:\n" + "\n".join(lines))


def stop_dashboard(proc: subprocess.Popen, url: str) -> None:
    """Ctrl-C, as a person stops it: labrun exits 0 and the tool it started no longer answers."""
    import signal

    import httpx

    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(url, timeout=5)


def holder_pid(run_dir: Path) -> int:
    """The process training in `run_dir`: the holder its lock file names (the test cluster's
    nodes share this machine's process ids: a network, host-name and mount namespace each)."""
    return json.loads((run_dir / ".lock").read_text())["pid"]


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def manifest(sweep_dir: Path) -> dict:
    """A sweep's jobs.json: the launcher's own record of each job."""
    return json.loads((sweep_dir / "jobs.json").read_text())


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def composed(tmp_path):
    """compose(*overrides) -> the train config, composed in this process from conf/."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from labrun.config import schema as config

    config.register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(LABRUN_CONF), version_base="1.3"):
        yield lambda *o: compose("train", overrides=[f"paths.run_dir={tmp_path}/run", *o])


@pytest.fixture(autouse=True)
def fresh_run_token(monkeypatch):
    """Composing a config in this process sets LABRUN_RUN_TOKEN (config.resolvers.run_token), which the
    processes it starts inherit, so that the ranks of one run share its folder: no test may
    hand its token on to the runs of the next (they would all train into one folder)."""
    monkeypatch.delenv("LABRUN_RUN_TOKEN", raising=False)


# ---------------------------------------------------------------------------------------------
# SLURM tests never skip silently: without a cluster they fail, unless LABRUN_NO_SLURM=1 says
# they are not to run, and then the summary says so in one line.

NO_SLURM = os.environ.get("LABRUN_NO_SLURM") == "1"
SLURM_SKIP_REASON = "LABRUN_NO_SLURM=1: the SLURM tests were asked not to run"


def pytest_itemcollected(item):
    # `make test` runs two pytest-xdist workers with --dist loadgroup: a file's tests stay on one
    # worker (its module fixtures train once), and every SLURM test shares one worker, since
    # they share one test cluster and some reconfigure it. A file whose tests share no module
    # fixture may say SPREAD_OVER_WORKERS = True: each of its tests is then a group of its own,
    # and long independent tests (tests/faults/test_kills.py) run on both workers at once.
    # Marked here, as each test is collected, because xdist reads the marks in its
    # pytest_collection_modifyitems.
    if item.get_closest_marker("slurm") is not None:
        group = "slurm"
    elif getattr(getattr(item, "module", None), "SPREAD_OVER_WORKERS", False):
        # No "]" in a group's name: xdist reads the group after the last "@" of a node id only
        # when no "]" (a parameter's id) follows it.
        group = item.nodeid.replace("[", "(").replace("]", ")")
    else:
        group = item.nodeid.split("::")[0]
    item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_modifyitems(config, items):
    if NO_SLURM:
        skip = pytest.mark.skip(reason=SLURM_SKIP_REASON)
        for item in items:
            if item.get_closest_marker("slurm"):
                item.add_marker(skip)


def slurm_configured() -> bool:
    """A slurm.conf the SLURM commands would read. Without one they look the controller up in
    DNS (configless mode), which the tests must not do here."""
    return Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")).is_file()


# ---------------------------------------------------------------------------------------------
# The fault table (tests/faults/conftest.py records the trials). A test's rows come back in its
# teardown report as user properties named FAULT_ROW: the reports are what reaches the
# controlling process from the xdist workers, and only it prints a summary. This file, not
# tests/faults/conftest.py, adds them up: the controller never collects a test, so it loads
# tests/faults/conftest.py only when given a path inside tests/faults/, which `make test` is not.

FAULT_ROW = "labrun-fault-row"
FAULT_COUNTS = ("trials", "survived", "data_lost", "cannot_tell")
FAULT_TABLE: dict[str, dict[str, int]] = {}


def pytest_runtest_logreport(report):
    if report.when != "teardown":  # the teardown report carries the rows, and only once
        return
    for name, row in report.user_properties:
        if name == FAULT_ROW:  # several tests may try one fault: their trials add up
            total = FAULT_TABLE.setdefault(row["fault"], dict.fromkeys(FAULT_COUNTS, 0))
            for count in FAULT_COUNTS:
                total[count] += row[count]


def pytest_terminal_summary(terminalreporter):
    # Counted from the reports, which reach the controller from the xdist workers too.
    not_run = [r for r in terminalreporter.stats.get("skipped", [])
               if isinstance(r.longrepr, tuple) and SLURM_SKIP_REASON in str(r.longrepr[-1])]
    if not_run:
        terminalreporter.write_line(f"SLURM: {len(not_run)} SLURM tests did not run "
                                    f"(LABRUN_NO_SLURM=1)", yellow=True, bold=True)
    if FAULT_TABLE:
        write = terminalreporter.write_line
        write("")
        write("fault injection: fault | trials | survived | data lost | cannot tell")
        # By name: the workers' reports arrive in no fixed order.
        for fault, total in sorted(FAULT_TABLE.items()):
            write(f"  {fault} | " + " | ".join(str(total[count]) for count in FAULT_COUNTS))


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """The folder `name`, filled by `build(folder)` once for the whole test session, for the
    session fixtures that train or export: under xdist each worker has its own session
    fixtures, so without this both workers would train the same run, each with half of the
    machine's two cores. The first worker to ask builds it while the other waits on a file lock
    in the folder the workers share; a build that failed (no `.done` file) is built again."""
    base = tmp_path_factory.getbasetemp()
    # Under xdist a worker's base temp is <this session's folder>/popen-gwN: the parent is
    # shared by the workers and by nothing else. Without xdist the parent holds other
    # sessions' folders, so the session's own base temp is used.
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, done = shared / name, shared / f"{name}.done"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed build left
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory) -> Path:
    """A short real training run on the built-in digits data, shared by every test that only
    reads a finished run folder (contract, export, serve, compare...)."""
    folder = built_once(tmp_path_factory, "digits_run", lambda folder: run_train(
        "trainer.max_epochs=3", "dataset.num_workers=2", run_dir=folder / "run"))
    return folder / "run"


@pytest.fixture(scope="session")
def python_docs_tokens(tmp_path_factory) -> Path:
    """A token folder (dataset=tokens) of the documentation text inside CPython, one byte a
    token: real text for the language-model tests, written once for the session."""

    def convert(folder: Path) -> None:
        from pydoc_data.topics import topics

        from labrun.data import tokens

        (folder / "topics.txt").write_text("".join(topics.values()))
        tokens.convert_text([folder / "topics.txt"], folder / "bytes", "bytes")

    return built_once(tmp_path_factory, "python_docs_tokens", convert) / "bytes"


@pytest.fixture(scope="session")
def seg_run(tmp_path_factory) -> Path:
    """experiment=seg_shapes trained once (a U-Net on dataset=shapes, about half a minute),
    shared by every segmentation test that reads a finished run: the preset's own mean IoU,
    compare, the dashboard, eval, export, serving and predict."""
    folder = built_once(tmp_path_factory, "seg_run", lambda folder: run_train(
        "experiment=seg_shapes", run_dir=folder / "run"))
    return folder / "run"


# A language model small enough for a few steps in a second or two: the sweeps and guarantees
# of task=lm (dataset.path= a token folder, such as python_docs_tokens).
LM_TINY = ["dataset=tokens", "dataset.block_size=32", "model=gpt", "model.n_layer=1",
           "model.n_head=2", "model.n_embd=32", "task=lm", "trainer.batch_size=16",
           "schedule.warmup_steps=4"]


@pytest.fixture(scope="session")
def onnx_model(digits_run, tmp_path_factory) -> Path:
    """digits_run exported to ONNX once, for the serving tests (which only read it)."""
    folder = built_once(tmp_path_factory, "digits_onnx", lambda folder: run_labrun(
        "export", str(digits_run), "--format", "onnx", "--out", str(folder / "digits.onnx")))
    return folder / "digits.onnx"


def digit_jpeg() -> bytes:
    """A real JPEG of a validation digit, upscaled to 64 px."""
    import io

    from PIL import Image

    from labrun.data.image import digits

    image = digits.load(32, 0.2)["val"].load(0)
    buffer = io.BytesIO()
    Image.fromarray(image).resize((64, 64)).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


# cluster.container on the test cluster, for real (tests/test_cluster_container.py and
# test_cluster_lab.py): podman with this machine's settings, in the image
# scripts/container_image.sh builds (`make test` builds it first), with the cluster's placeholder
# GRES devices as the GPUs. The image holds no Python: the project's Python and venv are mounted
# read-only, and the job's code, sweep folder and data are mounted by labrun itself.
PODMAN_IMAGE = "localhost/labrun-test:bookworm"
PODMAN_CONF = PROJECT / "scripts" / "podman" / "containers.conf"
SLURM_STATE = Path(os.environ.get("LABRUN_SLURM_STATE", "/tmp/labrun-slurm"))


def in_podman(python: str = PYTHON, mounts: tuple[str, ...] = ()) -> list[str]:
    """The overrides that run a cluster=lab job's tasks in PODMAN_IMAGE with `python`."""
    binds = ",".join([sys.base_prefix, str(Path(PYTHON).parent.parent), *mounts])
    return [f"+cluster.env.CONTAINERS_CONF={PODMAN_CONF}", "cluster.container.runtime=podman",
            f"cluster.container.image={PODMAN_IMAGE}",
            f"cluster.container.gpu_device=\"{SLURM_STATE}/dev/nvidia{{index}}\"",
            f"cluster.container.python={python}", f"cluster.container.mounts=[{binds}]"]


# A deterministic run of three whole epochs of 22 steps, a checkpoint every 5 steps, 2 data
# workers: the run test_cluster_lab's scenarios preempt, fail and time out, which need one still
# training many seconds after its step-10 checkpoint (a preemption lands after a grace time).
THREE_EPOCHS = ["trainer.max_epochs=3", "trainer.deterministic=true",
                "checkpoint.every_n_steps=5", "dataset.num_workers=2"]
# The reference for every resume and fault test: the same run with epochs of 12 steps (36 in
# all), which keeps every boundary a kill can fall on (a checkpoint every 5 steps, the end of an
# epoch, a validation) in a run that takes 7 CPU-s less (24 s against 17 s here, unloaded).
DETERMINISTIC = [*THREE_EPOCHS, "trainer.limit_train_batches=12"]


def final_weights(run_dir: Path) -> dict:
    import torch

    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


def same_weights(a: dict, b: dict) -> bool:
    """True when two state dicts hold the same tensors, bit for bit."""
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_identical(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Path:
    """The folder of an uninterrupted DETERMINISTIC run: what every resumed run must match
    (final weights, metrics.jsonl lines, kept checkpoints). Read it, never write to it."""
    folder = built_once(tmp_path_factory, "reference",
                        lambda folder: run_train(*DETERMINISTIC, run_dir=folder / "run"))
    return folder / "run"


@pytest.fixture(scope="session")
def reference_weights(reference_run) -> dict:
    """Final weights of an uninterrupted DETERMINISTIC run."""
    return final_weights(reference_run)


def rank_records(run_dir: Path) -> list[dict]:
    """ranks/rank-N.json of every rank, in rank order: what each process of a run did."""
    paths = sorted((run_dir / "ranks").glob("rank-*.json"))
    return sorted((json.loads(p.read_text()) for p in paths), key=lambda r: r["rank"])


def max_difference(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts' tensors."""
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# A short run on the digits data for comparing N processes with one (test_distributed.py,
# test_cluster_lab.py). SGD, not the default AdamW: Adam divides each gradient by its own running
# size, so a parameter whose gradient is near zero moves by up to the learning rate whichever
# sign rounding gives it; two processes against one then differed by 2.7e-6 in one run and
# 1.6e-4 in another. SGD passes rounding differences on linearly. model.dropout=0: each rank
# draws its own dropout masks (seeded alike), which one process drawing for 64 samples would not.
DDP_SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=8",
             "trainer.limit_val_batches=2", "model.dropout=0", "optimizer=sgd"]

# Two processes and one process differ only in the order floats are added: DDP averages the two
# ranks' gradients of 32 samples each (an all-reduce), one process averages 64 samples' at once,
# with another number of threads per matrix product. Measured here after these 8 SGD steps
# (|weights| up to 0.19): weights differ by 2.1e-8 to 6.4e-6 and val/loss by 6e-8 to 4.2e-7
# (the larger figures when the one process uses two threads and each rank one). A real difference
# in what is computed, on the same 8 steps against one process: batch_size=128 (what a per-device
# batch_size would mean) moves the weights by 1.3e-2 and val/loss by 2.1e-3; batch_size=32 by
# 1.6e-2 and 6.5e-4; dropout 0.1 by 1.9e-3 and 5.0e-5. The tolerances sit between: 15x and 24x
# above the largest rounding seen, 19x and 5x below the smallest real difference.
DDP_WEIGHT_TOLERANCE = 1e-4
DDP_LOSS_TOLERANCE = 1e-5


@pytest.fixture(scope="session")
def ddp_short_one_process(tmp_path_factory) -> Path:
    """DDP_SHORT in one process, with one thread: what N processes, local or on N nodes, with
    the same global batch must match within the tolerances above (test_distributed.py,
    test_cluster_lab.py)."""
    folder = built_once(tmp_path_factory, "ddp_short_one", lambda folder: run_train(
        "trainer.devices=1", *DDP_SHORT, run_dir=folder / "run", env={"OMP_NUM_THREADS": "1"}))
    return folder / "run"


@pytest.fixture(scope="session")
def det_run(tmp_path_factory) -> Path:
    """experiment=det_shapes trained once (FCOS on dataset=shapes_boxes), shared by every
    detection test that reads a finished run: the preset's own mAP, the loss's parts, eval."""
    folder = built_once(tmp_path_factory, "det_run", lambda folder: run_train(
        "experiment=det_shapes", run_dir=folder / "run"))
    return folder / "run"


# A checkpoint mid-epoch (epochs of 38 steps: 600 texts at 16): where the kill -9 test resumes.
TEXT_CHECKPOINTS = "checkpoint.every_n_steps=20"


@pytest.fixture(scope="session")
def text_assets(tmp_path_factory) -> Path:
    """weights/ (the tiny BERT in the hub cache's layout) and data/ (train.csv, val.csv)."""

    def make(folder: Path) -> None:
        text_fixtures.write_tiny_bert(folder / "weights")
        text_fixtures.write_corpus(folder / "data")

    return built_once(tmp_path_factory, "text_assets", make)


def text_preset(assets: Path, *more: str) -> list[str]:
    return ["experiment=text_tiny", f"dataset.path={assets / 'data'}",
            f"paths.weights_cache={assets / 'weights'}",
            f"paths.data_dir={assets / 'processed'}", TEXT_CHECKPOINTS, *more]


@pytest.fixture(scope="session")
def text_run(text_assets, tmp_path_factory) -> Path:
    """experiment=text_tiny trained whole, in a network namespace with no route anywhere: a run
    that reached for the hub would fail there."""

    def train(folder: Path) -> None:
        args = ["unshare", "--net", PYTHON, str(PROJECT / "train.py"), *FAST,
                *text_preset(text_assets), f"hydra.run.dir={folder / 'run'}"]
        result = subprocess.run(args, cwd=PROJECT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    return built_once(tmp_path_factory, "text_run", train) / "run"
