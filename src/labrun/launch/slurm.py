"""cluster=lab / slurm_dev with -m: the sweep as one SLURM job array, through submitit.

The steps every launcher takes (planning, jobs.json, polling, each job's result, the table) are
sweep.SweepLauncher's; SLURM itself is asked through core/scheduler/slurm.py. On top, what a
lab needs:
- every key is read from the `cluster` config (partition, qos, account, cpus, memory, time,
  GPUs and tasks per node, array parallelism, retries, sbatch extras, environment);
- a request that no node of the partition can ever satisfy fails at submission, in one line;
- jobs run a snapshot of the code taken at submission (submitit's RsyncSnapshot), import labrun
  from it, and get their config composed at submission with relative paths made absolute, so
  editing the working tree while a sweep waits cannot mix versions;
- the submitting process waits and prints one table built from every job's own result, or
  returns at once with cluster.detach=true (`labrun status SWEEP_DIR` later); Ctrl-C cancels
  the sweep's jobs;
- jobs that already completed with the same config are not submitted again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shlex
import shutil
import time
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, run_job
from omegaconf import DictConfig, open_dict

from labrun.config import validation
from labrun.core import environment, probes
from labrun.core.errors import LabrunError, one_line
from labrun.core.files import atomic_path
from labrun.core.project import project_dir
from labrun.core.scheduler import LIVE_STATES, SlurmScheduler
from labrun.launch import SLURM_COMMENT_PREFIX, container, sweep
from labrun.launch.compose import free_dropped_config

# Pickled into jobs by their paths: a job queued when they lived here still finds them.
from labrun.launch.slurm_job import ArrayTask, StudyController
from labrun.launch.slurm_limits import (
    check_controller,
    check_resources,
    check_submission,
    cluster_limits,
    split,
    throttle_shares,
)
from labrun.runs.sweepdir import (
    Job,
    ended_without_result,
    submitit_result,
    submitit_result_path,
)

POLL_S = 2.0
# A job that neither squeue nor sacct lists for this long has ended without a trace (a cluster
# without accounting forgets it MinJobAge after its end); its run folder tells how it ended.
FORGOTTEN_AFTER_S = 60.0
log = logging.getLogger(__name__)


class SlurmLauncher(sweep.SweepLauncher):
    scheduler = SlurmScheduler
    POLL_S = POLL_S
    POLL_MAX_S = 10.0  # one squeue (sacct too, for jobs squeue forgot) for all jobs a pass
    GLANCE_S = 0.5  # ended_soon: a file's existence, on the sweep's own (shared) file system

    # -- in the job ----------------------------------------------------------------------------

    def __call__(self, config: DictConfig, singleton_state: dict[Any, Any]) -> JobReturn:
        """Run one job of the array (every task of it, with tasks_per_node > 1)."""
        config = self.job_config(config, singleton_state)
        if environment.read().rank != 0:
            with open_dict(config.hydra):
                config.hydra.output_subdir = None  # rank 0 alone writes .hydra/
        with self.run_folder_held(config):
            return run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                           config=config, job_dir_key="hydra.sweep.dir",
                           job_subdir_key="hydra.sweep.subdir")

    # -- in the submitting process -------------------------------------------------------------

    CAN_DETACH = True
    SUBMITS_SINGLE_RUNS = True

    def __init__(self) -> None:
        super().__init__()
        self._stamp: str | None = None  # this launcher's submissions: .submitit/STAMP, .code/STAMP
        self._snapshot: Path | None = None
        self._unknown_since: dict[int, float] = {}  # job num -> when SLURM first did not know it
        self._submitted_from: str | None = None  # the folder of the first submission (begin)
        # What prepare() keeps of each planned job: job num -> (its request's index in
        # _requests, its config pickled, as its array task gets it).
        self._prepared: dict[int, tuple[int, bytes]] = {}
        # Each distinct request: (its key, the first such job's cluster config, submitit's
        # parameters, the container's). Its jobs' requests are equal, whatever config they had.
        self._requests: list[tuple[str, DictConfig, dict[str, Any], dict[str, Any]]] = []
        self._request_index: dict[str, int] = {}

    def __getstate__(self) -> dict[str, Any]:
        # Pickled for every task (shared_file): not what the submitter keeps of each job.
        return {**super().__getstate__(), "_prepared": {}, "_requests": [], "_request_index": {}}

    def _first_submission(self) -> None:
        """The stamp, snapshot folder and submitting folder every submission of this
        launcher shares, fixed at its first job."""
        if self._stamp is None:
            self._stamp = time.strftime("%Y%m%d-%H%M%S")
            self._snapshot = (self.sweep_dir / ".code" / self._stamp if self.config.cluster.snapshot
                              else None)
            # Relative paths of the config are relative to it (before the snapshot is entered).
            self._submitted_from = os.getcwd()

    def prepare(self, job: Job) -> None:
        """What submitting the job needs, from its config, which is then dropped: its request
        (submitit's and the container's parameters: one array per distinct one) and the config
        pickled for its task. A 5,000-job grid held every job's composed config until it was
        submitted (200 kB each, 1 GB resident); its pickle is a seventh of that, and the
        pickling was done at submission anyway."""
        if job.state == "pending":
            self._first_submission()
            params = executor_parameters(job.config.cluster, self.config, self._snapshot)
            in_container = self.container_parameters(job)
            key = repr((sorted(params.items()), sorted(in_container.items()),
                        job.config.cluster.max_num_timeout))
            index = self._request_index.get(key)
            if index is None:
                index = self._request_index[key] = len(self._requests)
                self._requests.append((key, job.config.cluster, params, in_container))
            self._prepared[job.num] = (index, pickle.dumps(job.config))
        job.config = None
        free_dropped_config()

    def begin(self, jobs: list[Job]) -> None:
        """Submit the jobs as job arrays: one per distinct resource request (a trial of a
        search: an array of one), split where it would exceed the cluster's MaxArraySize.
        Each job gets its SLURM id and log. Every submission of this launcher runs one
        snapshot of the code, taken at its first. Nothing is submitted when SLURM would refuse
        part of it (check_resources, check_submission); an sbatch that fails half-way cancels
        the arrays submitted before it."""
        cluster, sweep_dir = self.config.cluster, self.sweep_dir
        for job in jobs:
            if job.config is not None:  # not planned by this launcher (cluster_run's run)
                self.prepare(job)
        # One array per distinct resource request (a sweep over trainer.devices, say, asks
        # for different tasks and GPUs per node) and container (its mounts follow the paths).
        groups: dict[int, list[Job]] = {}
        for job in jobs:
            groups.setdefault(self._prepared[job.num][0], []).append(job)
        limits = cluster_limits()
        for index in groups:
            check_resources(self._requests[index][1], limits)
        check_submission([self._requests[self._prepared[job.num][0]][1] for job in jobs],
                         limits)
        # Each request's jobs in arrays that fit the cluster. cluster.array_parallelism is
        # SLURM's %N throttle, which holds per array: the sweep's requests share it out
        # (throttle_shares), and each array a request was split into starts once the one
        # before it has ended, so that it holds for the whole sweep as for one array
        # (detached, nothing is left running to meter them).
        parallelism = cluster.array_parallelism
        shares = (throttle_shares([len(group) for group in groups.values()], parallelism)
                  if parallelism else [None] * len(groups))
        if parallelism and len(groups) > parallelism:
            log.warning("cluster.array_parallelism=%d is fewer than the sweep's %d resource "
                        "requests: each runs one job at a time, %d at once", parallelism,
                        len(groups), len(groups))
        arrays = [(index, chunk, share, i > 0 and bool(parallelism))
                  for (index, group), share in zip(groups.items(), shares, strict=True)
                  for i, chunk in enumerate(split(group, limits.max_array_size))]
        submitted: list[str] = []
        task = ArrayTask(sweep_dir, self._submitted_from)
        try:
            with code_snapshot(self._snapshot):
                for index, array, share, chained in arrays:
                    submitted.append(self._submit_array(task, index, array, share,
                                                        submitted[-1] if chained else None))
        except Exception as error:
            with contextlib.suppress(probes.SlurmError):
                SlurmScheduler().cancel(submitted)
            raise LabrunError(f"submitting the sweep failed after {len(submitted)} of "
                              f"{len(arrays)} arrays ({one_line(error)}); those were "
                              f"cancelled, nothing of the sweep is queued") from error

    def _submit_array(self, task: ArrayTask, request: int, jobs: list[Job],
                      throttle: int | None, after: str | None) -> str:
        """One job array of `jobs`, of the request `request` (an index in _requests), each
        task running `task`, at most `throttle` of them at once, dependent on the array
        `after` (its SLURM id) ending; returns the array's id."""
        import submitit

        _, cluster, params, in_container = self._requests[request]
        params = dict(params)
        if in_container:
            params["slurm_srun_args"] = in_container["srun_args"]
            params["slurm_setup"] = [*params.get("slurm_setup", []), *in_container["setup"]]
            params["slurm_teardown"] = in_container["teardown"]
        if throttle is not None:
            params["slurm_array_parallelism"] = throttle
        if after is not None:
            extra = dict(params.get("slurm_additional_parameters", {}))
            extra["dependency"] = ",".join(filter(None, [f"afterany:{after}",
                                                         extra.get("dependency")]))
            params["slurm_additional_parameters"] = extra
        folder = self.sweep_dir / ".submitit" / self._stamp
        executor = submitit.AutoExecutor(folder=folder / "%j", cluster="slurm",
                                         slurm_max_num_timeout=cluster.max_num_timeout,
                                         slurm_python=in_container.get("python"))
        executor.update_parameters(**params)
        task.shared = self.shared_file(folder)
        handles = executor.map_array(task, [self._prepared.pop(job.num)[1] for job in jobs])
        submitted_at = time.time()
        # A line a job for a small sweep; a large one gets its arrays' lines (below) alone.
        level = logging.INFO if len(jobs) <= 10 else logging.DEBUG
        for job, handle in zip(jobs, handles, strict=True):
            job.state, job.job_id = "submitted", handle.job_id
            job.log, job.submitted_at = str(handle.paths.stdout), submitted_at
            job.submitit_dir = str(handle.paths.folder)
            log.log(level, "job %d: SLURM %s  log %s", job.num, handle.job_id, job.log)
        log.info("jobs %d-%d: SLURM array %s%s", jobs[0].num, jobs[-1].num,
                 handles[0].job_id.split("_")[0],
                 f", after array {after} has ended" if after else "")
        return handles[0].job_id.split("_")[0]

    def container_parameters(self, job: Job) -> dict[str, Any]:
        """What runs the job's tasks in cluster.container's image (launch/container.py):
        submitit's python, srun's arguments, the batch script's exports and, after srun, the
        requeue a task asked for from inside; {} without one."""
        image = job.config.cluster.get("container")
        if image is None or image.runtime is None:
            return {}
        code_dir = self._snapshot or project_dir() or Path.cwd()
        binds = container.mounts(job.config.cluster, job.config, code_dir, self.sweep_dir,
                                 self._submitted_from)
        # sbatch runs in the folder it was called from: the snapshot's, else the submitter's.
        workdir = str(self._snapshot or self._submitted_from)
        folder = self.sweep_dir / ".submitit" / self._stamp
        return {"python": container.python_command(image, binds, folder),
                "srun_args": container.srun_args(image, binds, workdir),
                "setup": container.setup_lines(image, container.relay_folder(folder)),
                "teardown": container.teardown_lines()}

    def shared_file(self, folder: Path) -> Path:
        """The launcher and Hydra's singleton state, pickled once into `folder` for every task
        of this submission (ArrayTask)."""
        import cloudpickle  # submitit's pickler: the task function may be a __main__ function

        path = folder / "launcher.pkl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp, open(tmp, "wb") as out:
            cloudpickle.dump((self, Singleton.get_state()), out)
        return path

    def manifest_extra(self) -> dict[str, Any]:
        return {"snapshot": str(self._snapshot or "")}

    def check_controller(self) -> None:
        """The cluster keys' ranges (cluster.controller's among them, which matter only
        here), then what SLURM would refuse or never run: the controller's request and QOS,
        and the trials' request, which the controller submits later, far from a terminal."""
        validation.check_cluster(self.config)
        limits = cluster_limits()
        check_controller(self.config.cluster, limits)
        check_resources(self.config.cluster, limits)

    def submit_controller(self, argv: list[str]) -> dict[str, Any]:
        """The controller: one job in a CPU slot (cluster.controller) that runs the study's
        command from a snapshot of the code taken now; its trials run that snapshot too.
        check_controller has passed (launch/optuna_sweeper.py asks it before the study's
        folder is made)."""
        import submitit

        cluster, sweep_dir = self.config.cluster, self.sweep_dir
        stamp = time.strftime("%Y%m%d-%H%M%S")
        snapshot = sweep_dir / ".code" / f"study-{stamp}" if cluster.snapshot else None
        params = executor_parameters(cluster, self.config, snapshot)
        for key in ("slurm_array_parallelism", "gpus_per_node", "mem_gb", "slurm_qos",
                    "slurm_partition"):
            params.pop(key, None)
        controller = cluster.controller
        params.update(
            {key: value for key, value in {
                "name": f"labrun-study-{self.config.hydra.job.name}",
                "slurm_partition": controller.partition, "slurm_qos": controller.qos,
                "slurm_account": controller.account or cluster.account,
                "cpus_per_task": controller.cpus_per_task, "mem_gb": controller.mem_gb,
                "timeout_min": controller.timeout_min, "nodes": 1, "tasks_per_node": 1,
            }.items() if value is not None})
        with code_snapshot(snapshot):
            executor = submitit.AutoExecutor(folder=sweep_dir / ".submitit" / f"study-{stamp}",
                                             cluster="slurm",
                                             slurm_max_num_timeout=cluster.max_num_timeout)
            executor.update_parameters(**params)
            # Its own command: attached (it is where the study waits), the code it runs
            # already a snapshot, and the sweep folder absolute.
            handle = executor.submit(StudyController(
                [*argv, "cluster.detach=false", "cluster.snapshot=false",
                 f"hydra.sweep.dir={sweep_dir}"], os.getcwd(), sweep_dir))
        return {"job_id": handle.job_id, "log": str(handle.paths.stdout),
                "submitted_at": time.time(), "snapshot": str(snapshot or "")}

    def ended(self, jobs: list[Job]) -> list[Job]:
        """Asks SLURM about all of them at once. squeue first: it is right about a job requeued
        a moment ago (after its node failed, say), which accounting still shows as NODE_FAIL."""
        try:
            states = SlurmScheduler().job_states([job.job_id for job in jobs])
        except probes.SlurmError as error:
            log.warning("cannot ask SLURM now (%s); asking again", error)
            return []
        done, now = [], time.time()
        for job in jobs:
            state = states.get(str(job.job_id))
            if state is None:  # neither the controller nor accounting knows it (yet)
                since = self._unknown_since.setdefault(job.num, time.monotonic())
                if time.monotonic() - since > FORGOTTEN_AFTER_S:
                    job.ended_at = now
                    done.append(job)
            elif state not in LIVE_STATES:
                job.error = failure_reason(job, state)
                job.state = "running"  # ended; read_result() tells how, from its own files
                job.ended_at = now  # when this launcher saw it end
                done.append(job)
        return done

    def ended_soon(self, job: Job) -> bool:
        """The job's call has returned (or raised): submitit has written its result, and SLURM
        will see the job end within moments."""
        path = submitit_result_path(job)
        return path is not None and path.exists()

    def stop(self, jobs: list[Job]) -> None:
        """Ctrl-C cancels the jobs (SIGHUP, the terminal gone, ends only this process, and the
        same command again attaches to them)."""
        ids = [job.job_id for job in jobs if job.job_id]
        arrays = list(dict.fromkeys(job_id.split("_")[0] for job_id in ids))
        log.warning("interrupted: cancelling the sweep's %d jobs (%s)", len(ids),
                    ", ".join(ids) if len(ids) <= 10 else f"arrays {', '.join(arrays)}")
        with contextlib.suppress(probes.SlurmError):
            SlurmScheduler().cancel(ids)
        for job in jobs:
            job.state = "cancelled"


def failure_reason(job: Job, state: str) -> str | None:
    """Why a job that ended in SLURM `state` failed: the exception its submitit result holds,
    else the state and the last error line of its stderr; None when it returned well."""
    result = submitit_result(job)
    if result is None:  # no result: killed, cancelled, timed out, or failed before Python
        return ended_without_result(job, state)
    outcome, value = result
    if outcome == "error":  # the traceback submitit caught, as text
        return one_line(str(value).strip().splitlines()[-1])[:200]
    failure = getattr(value, "_return_value", None)
    if isinstance(failure, BaseException):
        return f"{type(failure).__name__}: {one_line(failure)[:200]}"
    return None


def executor_parameters(cluster: DictConfig, config: DictConfig, snapshot: Path | None
                        ) -> dict[str, Any]:
    """submitit's parameters from the readable keys of the cluster config."""
    setup = [f"export {key}={shlex.quote(str(value))}" for key, value in cluster.env.items()]
    if snapshot is not None:
        # Import labrun from the snapshot, not from the editable install's working tree.
        setup.append(f"export PYTHONPATH={shlex.quote(str(snapshot / 'src'))}"
                     "${PYTHONPATH:+:$PYTHONPATH}")
    params = {
        "name": f"labrun-{config.hydra.job.name}",
        "slurm_partition": cluster.partition,
        "slurm_qos": cluster.qos,
        "slurm_account": cluster.account,
        "cpus_per_task": cluster.cpus_per_task,
        "mem_gb": cluster.mem_gb,
        "timeout_min": cluster.timeout_min,
        "nodes": cluster.nodes,
        "tasks_per_node": cluster.tasks_per_node,
        "gpus_per_node": cluster.gpus_per_node,
        "slurm_array_parallelism": cluster.array_parallelism,
        "slurm_signal_delay_s": cluster.signal_delay_s,
        # The comment marks the job as labrun's, with its sweep folder (`labrun queue`).
        "slurm_additional_parameters": {
            "comment": f"{SLURM_COMMENT_PREFIX}{Path(str(config.hydra.sweep.dir)).resolve()}",
            **cluster.extra_sbatch},
        "slurm_setup": setup,
    }
    return {key: value for key, value in params.items() if value not in (None, {}, [])}


class code_snapshot:  # noqa: N801 - used as a context manager, like submitit's own helper
    """submitit's RsyncSnapshot of the git checkout (tracked files as they are now), submitted
    from; a folder taken before (an earlier submission of the same search) is only entered,
    so that every trial runs the code of the first."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self.inner = None

    def __enter__(self):
        if self.folder is not None and self.folder.is_dir():
            self.inner = contextlib.chdir(self.folder)
            self.inner.__enter__()
        elif self.folder is not None:
            from submitit.helpers import RsyncSnapshot

            project = project_dir()
            if project is None or not (project / ".git").exists() or not shutil.which("rsync"):
                raise LabrunError("cluster.snapshot=true needs a project in a git checkout "
                                  "(a pyproject.toml with [tool.labrun] at or above this "
                                  "folder) and rsync (apt-get install rsync); or set "
                                  "cluster.snapshot=false")
            self.inner = RsyncSnapshot(self.folder, root_dir=project)
            self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        if self.inner is not None:
            self.inner.__exit__(*exc)
