"""`cluster=lab` against a cluster shaped like a lab's (scripts/slurm_up.sh: three nodes in
their own network namespaces, four GPUs each as GRES, QOS normal / urgent / scavenger with
preemption, fair share across accounts): GPUs from SLURM, two-node DDP, QOS preemption, a node
failure, fair share and `labrun queue`. The jobs train on the CPU; OMP_NUM_THREADS=1 (through
cluster.env) keeps them from fighting over this machine's two cores.

The slow waits (fair share's priority pass, the preemption grace time, a node's time-out) are
started side by side by the module's `scenarios` fixture; each test then finishes its own."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import pytest

from conftest import (
    DDP_LOSS_TOLERANCE,
    DDP_SHORT,
    DDP_WEIGHT_TOLERANCE,
    FAST,
    LABRUN,
    PROJECT,
    PYTHON,
    THREE_EPOCHS,
    assert_identical,
    final_weights,
    in_podman,
    manifest,
    max_difference,
    rank_records,
    read_metrics,
    read_summary,
    run_labrun,
    slurm_configured,
    wait_for,
)
from labrun.launch import SLURM_COMMENT_PREFIX
from labrun.runs import lock_holder

pytestmark = pytest.mark.slurm

STATE = Path(os.environ.get("LABRUN_SLURM_STATE", "/tmp/labrun-slurm"))
LAB = ["cluster=lab", "+cluster.env.OMP_NUM_THREADS=1"]
# The scavenger QOS's GraceTime in scripts/slurm_up.sh: a preempted job is killed this long
# after its --signal.
GRACE_S = 15


@pytest.fixture(autouse=True, scope="module")
def lab_cluster():
    # Never a skip (see conftest.py): the lab-shaped cluster must be up.
    if not slurm_configured():
        pytest.fail("no SLURM cluster: `make test` as root starts one (scripts/slurm_up.sh)")
    out = subprocess.run(["sinfo", "-h", "-p", "gpu", "-N", "-o", "%N %G %T"],
                         capture_output=True, text=True, timeout=30)
    nodes = {line.split()[0] for line in out.stdout.splitlines() if "gpu:4" in line}
    if out.returncode != 0 or len(nodes) < 3:
        pytest.fail(f"the lab-shaped cluster is not up (sinfo: {out.stdout or out.stderr}); "
                    "`make test` as root starts it (scripts/slurm_up.sh)")


SWEEPS: list[tuple[Path, subprocess.Popen]] = []  # every sweep started, for the clean-up


def sweep(sweep_dir: Path, *overrides: str, env: dict[str, str] | None = None
          ) -> subprocess.Popen:
    """`python train.py -m cluster=lab ...` in the background."""
    args = [PYTHON, "train.py", "-m", *LAB, *FAST, *overrides, f"hydra.sweep.dir={sweep_dir}"]
    proc = subprocess.Popen(args, cwd=PROJECT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    SWEEPS.append((sweep_dir, proc))
    return proc


def single_run(run_dir: Path, *overrides: str) -> subprocess.Popen:
    """`python train.py cluster=lab ...` without -m, in the background: submitted as one
    job, which it follows (launch/cluster_run.py)."""
    args = [PYTHON, "train.py", *LAB, *FAST, *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(args, cwd=PROJECT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    SWEEPS.append((run_dir, proc))
    return proc


OUTPUTS: dict[int, str] = {}


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    """The sweep's output once it has ended (asked again, the same output)."""
    if proc.pid not in OUTPUTS:
        # 600 s: a few short trainings sharing two cores with the rest of the sweep's jobs.
        OUTPUTS[proc.pid] = proc.communicate(timeout=timeout)[0]
    return OUTPUTS[proc.pid]


@pytest.fixture(autouse=True, scope="module")
def no_job_left_behind():
    """Whatever a failed test leaves (a sweep still waiting, its jobs), the cluster is clean for
    the tests that follow: Ctrl-C makes each launcher cancel its own jobs, and any job marked
    with one of this module's sweep folders is cancelled."""
    yield
    for _, proc in SWEEPS:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)  # cancelling takes a second or two; 60 s: a hang
            except subprocess.TimeoutExpired:
                proc.kill()
    folders = [f"{SLURM_COMMENT_PREFIX}{folder.resolve()}" for folder, _ in SWEEPS]
    queue = subprocess.run(["squeue", "-h", "-o", "%A|%k"], capture_output=True, text=True,
                           timeout=30).stdout
    left = [job for job, _, comment in (line.partition("|") for line in queue.splitlines())
            if comment in folders]
    if left:
        subprocess.run(["scancel", *left], check=False)


def sbatch(*args: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", *args],
                         capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.strip().split(";")[0]


def sacct(job_id: str, fields: str) -> list[dict[str, str]]:
    out = subprocess.run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", fields],
                         capture_output=True, text=True, timeout=30)
    names = fields.split(",")
    return [dict(zip(names, line.split("|"), strict=True)) for line in out.stdout.splitlines()]


def environment(run_dir: Path) -> dict:
    return json.loads((run_dir / "provenance" / "environment.json").read_text())


def losses(run_dir: Path) -> list[tuple]:
    """The deterministic part of each logged point (no wall-clock fields)."""
    return [(p["step"], p["epoch"], p.get("train/loss"), p.get("val/loss"))
            for p in read_metrics(run_dir)]


# ---------------------------------------------------------------------------------------------
# The scenarios with slow waits, started side by side


class Trigger:
    """Runs a scenario's fault in a thread the moment the job is ready for it (the test that
    checks the outcome may come much later); `join()` re-raises what went wrong there."""

    def start_trigger(self) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.trigger()
        except BaseException as error:  # noqa: BLE001 - handed to the test by join()
            self.error = error

    def join(self) -> None:
        self.thread.join(timeout=900)  # the trigger waits at most wait_for's 300 s
        assert not self.thread.is_alive(), f"{type(self).__name__}: the trigger never ended"
        if self.error is not None:
            raise self.error


@dataclass
class Preemption(Trigger):
    """node3: a normal-QOS twin and a scavenger job train the same deterministic run, a
    scavenger placeholder holds the node's other two GPUs; once the scavenger job has written a
    checkpoint, an urgent job asks for three GPUs, which only preempting both scavenger jobs
    frees."""
    sweep_dir: Path
    proc: subprocess.Popen
    placeholder: str
    urgent: str | None = None

    @classmethod
    def start(cls, sweep_dir: Path) -> Preemption:
        proc = sweep(sweep_dir, *THREE_EPOCHS, "cluster.qos=normal,scavenger",
                     "+cluster.extra_sbatch.nodelist=node3", "cluster.cpus_per_task=1")
        placeholder = sbatch("-p", "gpu", "-q", "scavenger", "-w", "node3", "--gres=gpu:2",
                             "-J", "placeholder", "--wrap", "sleep 900")
        scenario = cls(sweep_dir, proc, placeholder)
        scenario.start_trigger()
        return scenario

    def trigger(self) -> None:
        # Mid-training: the scavenger job has checkpointed at step 10 (of 66).
        wait_for(self.sweep_dir / "1" / "checkpoints" / "step-00000010.pt", self.proc)
        self.urgent = sbatch("-p", "gpu", "-q", "urgent", "-w", "node3", "--gres=gpu:3",
                             "-J", "urgent", "--wrap", "echo $SLURM_JOB_GPUS")


def hold_still(run_dir: Path) -> int:
    """SIGSTOP the process training `run_dir` (the PID its lock names: the job's nodes share
    this machine's PID namespace) and its DataLoader workers; returns its PID. A stand-in for a
    run long enough that what comes next (its node failing, its time limit) comes mid-training:
    a THREE_EPOCHS run would otherwise end first. SLURM continues it (SIGCONT) with any
    signal it sends the job's step; a failing node kills it stopped."""
    pid = lock_holder.read_holder(run_dir / ".lock").pid
    children = [int(child) for task in Path(f"/proc/{pid}/task").glob("*/children")
                for child in task.read_text().split()]
    for process in [pid, *children]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process, signal.SIGSTOP)
    # The signal is delivered asynchronously: until the process says it stopped.
    deadline = time.monotonic() + 30
    while state(pid) != "T":
        assert time.monotonic() < deadline, f"PID {pid} did not stop: {state(pid)}"
        time.sleep(0.05)
    return pid


def state(pid: int) -> str:
    """The state letter of /proc/PID/status ("T": stopped, "R": running, ...)."""
    return next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("State:"))


@dataclass
class NodeFailure(Trigger):
    """node1 (node3 is the preemption's, node2 the time limit's): a sweep's job and a single
    run (no -m, submitted as one job) train there; once each has checkpointed it is held still (hold_still), and once
    both have, every process of the node is killed, slurmd and the jobs' steps with it, as when
    a node dies. Both are requeued and resume elsewhere."""
    sweep_dir: Path
    proc: subprocess.Popen
    single_dir: Path
    single: subprocess.Popen
    node: str | None = None

    @classmethod
    def start(cls, sweep_dir: Path, single_dir: Path) -> NodeFailure:
        # Not pinned to a node (its requeued job would wait for that node): SLURM fills the
        # first node that fits first, node1, where node2 and node3 have jobs of their own.
        not_node3 = [*THREE_EPOCHS, "+cluster.extra_sbatch.exclude=node3",
                     "cluster.cpus_per_task=1"]
        proc = sweep(sweep_dir, *not_node3)
        scenario = cls(sweep_dir, proc, single_dir, single_run(single_dir, *not_node3))
        scenario.start_trigger()
        return scenario

    def trigger(self) -> None:
        for run, proc in ((self.sweep_dir / "0", self.proc), (self.single_dir, self.single)):
            wait_for(run / "checkpoints" / "step-00000010.pt", proc)
            hold_still(run)
        self.node = environment(self.sweep_dir / "0")["hostname"]
        assert self.node == environment(self.single_dir)["hostname"] == "node1", \
            "the sweep's job and the single run were not both placed on node1"
        namespace = f"labrun-{self.node}"
        pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                              text=True, check=True).stdout.split()
        assert (STATE / "pids" / f"slurmd-{self.node}.pid").read_text().strip() in pids
        for pid in pids:
            subprocess.run(["kill", "-KILL", pid], check=False)

    def restore(self) -> None:
        """The node back for the tests that follow (once: the test does it, or else teardown)."""
        if self.node:
            subprocess.run(["bash", str(PROJECT / "scripts" / "slurm_up.sh"), "--restart-node",
                            self.node], check=True, capture_output=True, timeout=180)
            self.node = None


@dataclass
class ContainerRequeue(Trigger):
    """The preemption's deterministic run again as a single run (no -m: submitted as one job,
    launch/cluster_run.py), its task in a podman container (conftest.in_podman), on whichever
    of node1 and node2 the node failure spares: it starts once that job has. While it trains,
    its run-folder lock is judged as another process on its node would judge it; once it has
    checkpointed at step 10, it gets SLURM's USR2, which inside the container checkpoints and
    requeues it (launch/container.py's relay)."""
    sweep_dir: Path
    failure: NodeFailure
    proc: subprocess.Popen | None = None
    node: str = ""
    holder: lock_holder.Holder | None = None
    holder_cmdline: str = ""
    judged: str | None = "not judged"

    @classmethod
    def start(cls, sweep_dir: Path, failure: NodeFailure) -> ContainerRequeue:
        scenario = cls(sweep_dir, failure)
        scenario.start_trigger()
        return scenario

    def trigger(self) -> None:
        failing = self.failure.sweep_dir / "0" / "provenance" / "environment.json"
        wait_for(failing, self.failure.proc)
        self.node = "node2" if environment(failing.parent.parent)["hostname"] == "node1" \
            else "node1"
        self.proc = single_run(self.sweep_dir, *THREE_EPOCHS, *in_podman(),
                               f"+cluster.extra_sbatch.nodelist={self.node}",
                               "cluster.cpus_per_task=1")
        run = self.sweep_dir  # a single run: its folder is the run folder
        wait_for(run / "checkpoints" / "step-00000010.pt", self.proc)
        # The PID in the lock is the host's (podman --pid=host): on the job's node, which
        # shares this machine's PID namespace, that process is the job's Python, live.
        self.holder = lock_holder.read_holder(run / ".lock")
        with contextlib.suppress(OSError):
            self.holder_cmdline = Path(f"/proc/{self.holder.pid}/cmdline").read_text()
        on_its_node = replace(lock_holder.me(), host=self.node, job_id=None, restart=0)
        self.judged = lock_holder.stale_reason(self.holder, run / ".lock", on_its_node)
        job_id = manifest(self.sweep_dir)["jobs"][0]["job_id"]
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True)


@dataclass
class TimeLimit(Trigger):
    """The preemption's deterministic run again as a single run on node2, with a time limit of
    2 minutes and SLURM's warning (USR2) 30 s before it: held still (hold_still) once it has
    checkpointed at step 10, it is continued by SLURM's warning (sent up to a minute before
    the 30 s: SLURM looks at time limits every half minute), checkpoints and is requeued
    (submitit counts a time-out: it judges by the job's elapsed time against its limit)."""
    run_dir: Path
    proc: subprocess.Popen
    stopped: str = ""  # its state letter once held ("T")

    @classmethod
    def start(cls, run_dir: Path) -> TimeLimit:
        scenario = cls(run_dir, single_run(run_dir, *THREE_EPOCHS, "cluster.timeout_min=2",
                                           "cluster.signal_delay_s=30",
                                           "+cluster.extra_sbatch.nodelist=node2",
                                           "cluster.cpus_per_task=1"))
        scenario.start_trigger()
        return scenario

    def trigger(self) -> None:
        wait_for(self.run_dir / "checkpoints" / "step-00000010.pt", self.proc)
        self.stopped = state(hold_still(self.run_dir))


@dataclass
class FairShare:
    """Account vision uses node3's four GPUs for 15 s (the preemption scenario's jobs wait for
    them); one job of vision and one of nlp wait (held back by --begin) while SLURM's priority
    pass (every minute) weighs the two accounts' usage."""
    usage_job: str
    vision: str
    nlp: str

    @classmethod
    def start(cls) -> FairShare:
        usage = sbatch("-A", "vision", "-p", "gpu", "-w", "node3", "--gres=gpu:4", "-c", "4",
                       "-J", "vision-usage", "--wrap", "sleep 15")
        later = "--begin=now+3600"  # pending the whole module, never started
        return cls(usage, sbatch("-A", "vision", later, "-J", "vision-next", "--wrap", "true"),
                   sbatch("-A", "nlp", later, "-J", "nlp-next", "--wrap", "true"))


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab")
    fair = FairShare.start()
    preemption = Preemption.start(root / "preemption")
    failure = NodeFailure.start(root / "failure", root / "failure-single")
    in_container = ContainerRequeue.start(root / "container", failure)
    time_limit = TimeLimit.start(root / "time-limit")
    yield {"fair": fair, "preemption": preemption, "failure": failure,
           "container": in_container, "time_limit": time_limit}
    jobs = [fair.usage_job, fair.vision, fair.nlp, preemption.placeholder]
    subprocess.run(["scancel", *jobs, *([preemption.urgent] if preemption.urgent else [])],
                   check=False)
    failure.restore()


# ---------------------------------------------------------------------------------------------
# The tests


def test_preempted_scavenger_job_requeues_resumes_and_matches_its_twin(scenarios):
    preemption: Preemption = scenarios["preemption"]
    preemption.join()
    output = finish(preemption.proc)
    assert preemption.proc.returncode == 0, output
    twin, preempted = preemption.sweep_dir / "0", preemption.sweep_dir / "1"
    log = Path(manifest(preemption.sweep_dir)["jobs"][1]["log"]).read_text()
    assert "SIGUSR2" in log and "resuming from" in log  # its --signal came, then a restart
    assert read_summary(preempted)["requeued"] >= 1 and read_summary(twin)["requeued"] == 0
    assert_identical(final_weights(preempted), final_weights(twin))
    assert losses(preempted) == losses(twin)

    [urgent] = sacct(preemption.urgent, "State,Submit,Start")
    assert urgent["State"] == "COMPLETED"
    waited = (datetime.fromisoformat(urgent["Start"])
              - datetime.fromisoformat(urgent["Submit"])).total_seconds()
    # The urgent job waits for the preempted jobs' grace time, then the scheduler's next pass
    # (every 2 s) and the preempted jobs' exit; 30 s covers those on a loaded machine. A job
    # that waited for the scavenger run to finish instead would wait minutes.
    assert waited <= GRACE_S + 30, f"the urgent job waited {waited:.0f} s"
    # node3 is free again for the tests that follow.
    subprocess.run(["scancel", preemption.placeholder], check=True)


def test_a_failed_node_requeues_its_job_which_resumes_elsewhere_losing_nothing(scenarios):
    failure: NodeFailure = scenarios["failure"]
    preemption: Preemption = scenarios["preemption"]
    twin = preemption.sweep_dir / "0"  # the same deterministic run, never stopped
    failure.join()
    output = finish(failure.proc)
    assert failure.proc.returncode == 0, output
    run = failure.sweep_dir / "0"
    assert read_summary(run)["status"] == "completed"
    assert environment(run)["hostname"] not in (failure.node, "node3")
    finish(preemption.proc)  # the twin's sweep (done already when the preemption test ran)
    assert read_summary(twin)["status"] == "completed"
    assert_identical(final_weights(run), final_weights(twin))
    assert losses(run) == losses(twin)  # every point, once, as the uninterrupted run has it
    status = run_labrun("status", str(failure.sweep_dir))
    assert "requeued 1x" in status.stdout, status.stdout
    failure.restore()


def test_a_single_run_whose_node_fails_is_requeued_and_resumes_to_its_twins_weights(scenarios):
    """The single run killed with node1 beside the sweep's job: SLURM requeues its job, which
    resumes from its last checkpoint elsewhere, followed to the end from this terminal."""
    failure: NodeFailure = scenarios["failure"]
    twin = scenarios["preemption"].sweep_dir / "0"
    failure.join()
    output = finish(failure.single)
    assert failure.single.returncode == 0, output
    run = failure.single_dir
    assert "completed: best val/acc" in output, output
    assert read_summary(run)["status"] == "completed" and read_summary(run)["requeued"] >= 1
    assert environment(run)["hostname"] not in ("node1", "node3")
    log = Path(manifest(run)["jobs"][0]["log"]).read_text()
    resumed = re.search(r"resuming from \S+/step-(\d+)\.pt", log)
    assert resumed and int(resumed.group(1)) >= 10, log[-3000:]
    finish(scenarios["preemption"].proc)
    assert_identical(final_weights(run), final_weights(twin))
    assert losses(run) == losses(twin)


def test_a_single_run_at_its_time_limit_is_requeued_and_resumes_to_its_twins_weights(scenarios):
    """SLURM's warning before the time limit (cluster.signal_delay_s) reaches the run held
    still at step 10: it checkpoints, is requeued as a time-out (one of cluster.max_num_timeout
    used), resumes from that checkpoint and ends with the uninterrupted twin's weights."""
    time_limit: TimeLimit = scenarios["time_limit"]
    twin = scenarios["preemption"].sweep_dir / "0"
    time_limit.join()
    assert time_limit.stopped == "T"  # held still when SLURM's warning came
    output = finish(time_limit.proc)
    assert time_limit.proc.returncode == 0, output
    run = time_limit.run_dir
    log = Path(manifest(run)["jobs"][0]["log"]).read_text()
    stopped = re.search(r"SIGUSR2 at step (\d+): checkpoint saved, requeueing", log)
    resumed = re.search(r"resuming from \S+/step-(\d+)\.pt", log)
    assert stopped and resumed, log[-3000:]
    assert int(resumed.group(1)) == int(stopped.group(1)) >= 10
    assert "this job is timed-out" in log and "(2 remaining timeouts)" in log, log[-3000:]
    assert read_summary(run)["requeued"] >= 1
    finish(scenarios["preemption"].proc)
    assert_identical(final_weights(run), final_weights(twin))
    assert losses(run) == losses(twin)


def test_a_single_run_in_a_container_requeues_on_usr2_resumes_and_matches_its_twin(scenarios):
    in_container: ContainerRequeue = scenarios["container"]
    twin = scenarios["preemption"].sweep_dir / "0"  # the same deterministic run, no container
    in_container.join()
    output = finish(in_container.proc)
    assert in_container.proc.returncode == 0, output
    run = in_container.sweep_dir
    # Followed from this terminal through the requeue: queued, running, the run's lines.
    assert "labrun: submitted SLURM job" in output and "RUNNING on node" in output, output
    assert "SIGUSR2" in output and "completed: best val/acc" in output, output
    recorded = environment(run)
    assert (recorded["hostname"], recorded["container"]) == (in_container.node, "podman")
    # The lock named the job's own Python by its host PID, and its node judged it live.
    assert in_container.holder.host == in_container.node
    assert "submitit.core._submit" in in_container.holder_cmdline
    assert in_container.judged is None, in_container.judged
    # The USR2 reached the training process in the container, which checkpointed at the step
    # it stopped and was requeued (SLURM's restart count), then resumed from that checkpoint.
    log = Path(manifest(in_container.sweep_dir)["jobs"][0]["log"]).read_text()
    stopped = re.search(r"SIGUSR2 at step (\d+): checkpoint saved, requeueing", log)
    resumed = re.search(r"resuming from \S+/step-(\d+)\.pt", log)
    assert stopped and resumed, log[-3000:]
    assert int(resumed.group(1)) == int(stopped.group(1)) >= 10
    assert read_summary(run)["requeued"] >= 1
    finish(scenarios["preemption"].proc)
    assert_identical(final_weights(run), final_weights(twin))
    assert losses(run) == losses(twin)


def test_two_2_gpu_jobs_share_a_node_with_disjoint_gpus_from_slurm(tmp_path, scenarios):
    proc = sweep(tmp_path, "trainer.devices=2", "trainer.max_epochs=1",
                 "trainer.limit_train_batches=3", "optimizer.lr=0.1,0.2",
                 "cluster.cpus_per_task=8", "+cluster.extra_sbatch.nodelist=node3")
    output = finish(proc)
    assert proc.returncode == 0, output
    gpus = []
    for num in ("0", "1"):
        env = environment(tmp_path / num)
        assert env["hostname"] == "node3" and env["slurm"]["SLURM_NTASKS"] == "2"
        gpus.append(set(env["cuda_visible_devices"].split(",")))
        assert len(gpus[-1]) == 2
    assert gpus[0].isdisjoint(gpus[1]), gpus  # two jobs on one node at once, each its own GPUs
    assert gpus[0] | gpus[1] == {"0", "1", "2", "3"}


# The sweep's three jobs are one array, in order: element 2 is the `failing` variant. Its rank
# 1 (on the second node) raises after training, so rank 0 completes and SLURM says COMPLETED.
INJECT_RANK_1_FAILURE = """
import os
if os.environ.get("SLURM_PROCID") == "1" and os.environ.get("SLURM_ARRAY_TASK_ID") == "2":
    from labrun.train.trainer import Trainer
    fit = Trainer.fit
    def fit_then_fail(self, *args, **kwargs):
        fit(self, *args, **kwargs)
        raise RuntimeError("failure injected by the test on the second node")
    Trainer.fit = fit_then_fail
"""


def test_two_node_ddp_matches_one_process_and_resumes_bit_exact(tmp_path, scenarios,
                                                                ddp_short_one_process):
    """One rank on each of two nodes (gloo over the nodes' own addresses): the ranks run on
    different hosts, the result matches one process with the same global batch, in the venv
    and in podman containers (whose rendezvous reads the node list SLURM gave, with no SLURM
    command in the image), a requeued two-node job ends bit-identical to its uninterrupted
    twin, and a failure on the second node's rank is reported in the sweep table."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(INJECT_RANK_1_FAILURE)
    two_nodes = ["trainer.num_nodes=2", "trainer.devices=1", "cluster.cpus_per_task=1",
                 "+cluster.extra_sbatch.exclude=node3"]
    sweep_dir = tmp_path / "sweep"
    proc = sweep(sweep_dir, *two_nodes, "trainer.max_epochs=2", "trainer.deterministic=true",
                 "checkpoint.every_n_steps=5", "+variant=plain,requeued,failing",
                 env={"PYTHONPATH": str(inject)})
    # Side by side: DDP_SHORT on two nodes, a single run (no -m: one job), and the same
    # global batch in one local process (with the jobs' one thread), compared within
    # conftest's measured tolerances.
    short = single_run(tmp_path / "short", *two_nodes, *DDP_SHORT)
    in_image = sweep(tmp_path / "in_image", *two_nodes, *DDP_SHORT, *in_podman())
    # The requeue, mid-training (step 10 of 44), before keep_last rotates that checkpoint away.
    wait_for(sweep_dir / "1" / "checkpoints" / "step-00000010.pt", proc)
    job_id = manifest(sweep_dir)["jobs"][1]["job_id"]
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    one = ddp_short_one_process
    short_output = finish(short)
    assert short.returncode == 0, short_output
    two = tmp_path / "short"
    difference = max_difference(final_weights(two), final_weights(one))
    loss_gap = abs(read_summary(two)["val/loss"] - read_summary(one)["val/loss"])
    print(f"two nodes vs one process: weights {difference:.2e}, val/loss {loss_gap:.2e}")
    assert difference <= DDP_WEIGHT_TOLERANCE and loss_gap <= DDP_LOSS_TOLERANCE
    records = rank_records(two)
    assert [(r["rank"], r["world_size"], r["status"], r["optimizer_steps"]) for r in records] \
        == [(0, 2, "completed", 8), (1, 2, "completed", 8)]
    assert sorted(r["host"] for r in records) == ["node1", "node2"], records  # two nodes
    image_output = finish(in_image)
    assert in_image.returncode == 0, image_output
    contained = tmp_path / "in_image" / "0"
    assert environment(contained)["container"] == "podman"
    assert sorted(r["host"] for r in rank_records(contained)) == ["node1", "node2"]
    difference = max_difference(final_weights(contained), final_weights(one))
    print(f"two nodes in containers vs one process: weights {difference:.2e}")
    assert difference <= DDP_WEIGHT_TOLERANCE

    output = finish(proc)

    plain, requeued = sweep_dir / "0", sweep_dir / "1"
    assert sorted(r["host"] for r in rank_records(plain)) == ["node1", "node2"]
    log = Path(manifest(sweep_dir)["jobs"][1]["log"]).read_text()
    assert "SIGUSR2" in log and "resuming from" in log
    assert_identical(final_weights(requeued), final_weights(plain))
    assert losses(requeued) == losses(plain)
    assert read_summary(requeued)["requeued"] >= 1
    ids = {job["job_id"].split("_")[0] for job in manifest(sweep_dir)["jobs"]}
    assert len(ids) == 1 and manifest(sweep_dir)["jobs"][2]["job_id"].endswith("_2")
    assert proc.returncode != 0
    assert "rank 1: RuntimeError: failure injected by the test on the second node" in output
    assert read_summary(sweep_dir / "2")["status"] == "completed"  # rank 0's view


def test_fair_share_favours_the_account_that_used_less_and_queue_says_why(scenarios):
    fair: FairShare = scenarios["fair"]
    deadline = time.time() + 180  # the priority pass runs every minute (PriorityCalcPeriod=1)
    while True:
        view = json.loads(run_labrun("queue", "--json").stdout)
        pending = {p["job_id"]: p for p in view["pending"]}
        vision, nlp = pending[fair.vision], pending[fair.nlp]
        if nlp["priority"] > vision["priority"] or time.time() > deadline:
            break
        time.sleep(5)  # a priority pass lands within the minute
    assert nlp["priority"] > vision["priority"], (vision, nlp)
    assert [p["job_id"] for p in view["pending"]].index(fair.nlp) < \
        [p["job_id"] for p in view["pending"]].index(fair.vision)  # listed first
    shares = {(s["account"], s["user"]): s for s in view["fair_share"]}
    assert shares[("vision", "root")]["usage"] > 0 and shares[("nlp", "root")]["usage"] == 0
    assert shares[("vision", "root")]["fairshare"] < shares[("nlp", "root")]["fairshare"]
    text = run_labrun("queue").stdout
    assert "Fair share" in text and fair.nlp in text


def test_queue_shows_the_users_labrun_sweeps_and_gpus_in_use(tmp_path):
    proc = sweep(tmp_path, "cluster.detach=true", "trainer.devices=2", "trainer.max_epochs=3",
                 "optimizer.lr=0.1,0.2", "cluster.cpus_per_task=1")
    output = finish(proc)
    assert proc.returncode == 0, output
    ids = [job["job_id"] for job in manifest(tmp_path)["jobs"]]
    try:
        deadline = time.time() + 120  # both jobs start within a few scheduler passes
        while True:
            view = json.loads(run_labrun("queue", "--json").stdout)
            mine = [s for s in view["sweeps"] if s["sweep_dir"] == str(tmp_path.resolve())]
            if (mine and mine[0]["jobs"].get("running") == 2) or time.time() > deadline:
                break
            time.sleep(2)
        assert mine and mine[0]["jobs"] == {"running": 2}, view["sweeps"]
        assert view["gpus_in_use"]["by_user"]["root"] >= 4  # 2 jobs x 2 GPUs
    finally:
        subprocess.run(["scancel", *ids], check=False)


def test_doctor_finds_cluster_lab_healthy():
    result = subprocess.run([LABRUN, "doctor", "--json"], capture_output=True, text=True,
                            timeout=300, cwd=PROJECT)
    checks = {c["check"]: c for c in json.loads(result.stdout)}
    assert checks["slurm"]["status"] == "ok", checks["slurm"]
    assert checks["slurm partition"]["status"] == "ok", checks["slurm partition"]
    assert "gpu" in checks["slurm partition"]["detail"]
