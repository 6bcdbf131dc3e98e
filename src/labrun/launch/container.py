"""cluster.container: every task of a SLURM job runs its Python inside the lab's image.

submitit starts each task as `srun [SRUN_ARGS] PYTHON -u -m submitit.core._submit FOLDER`.
labrun sets PYTHON (submitit's `python`) or SRUN_ARGS, per runtime:
- apptainer: PYTHON is a script that runs `apptainer exec [--nv] --bind P,... IMAGE python3`.
  Apptainer shares the host's PID namespace, network and environment by default.
- podman: PYTHON is a script that runs `podman run --pid=host --network=host --env-host -v P:P
  ... IMAGE python3`, with a `--device` for exactly each of the task's GRES GPUs.
- pyxis: SRUN_ARGS `--container-image=IMAGE --container-mounts=P:P,... --container-workdir=DIR`
  (srun's own plug-in; PYTHON is the image's interpreter).
The host folders a job reads and writes are mounted at the same paths (`mounts`): the code it
runs, the sweep folder (its run folders, the Optuna journal), the data and every other path key,
and cluster.container.mounts. cluster.env is exported before srun, so it holds inside too.

Why a script rather than the runtime's command itself: a task's own GPUs (SLURM_STEP_GPUS) are
known only in the task, and a runtime or image missing on the node is said in one line (which
the sweep's table shows, launch/slurm.failure_reason) before the runtime fails in its own words.
The script `exec`s the runtime, so SLURM's USR2 and SIGTERM reach it, and podman (--sig-proxy,
its default) and apptainer pass them on to the training process. With the host's PID namespace,
the process ids a run-folder lock records are the host's, so its liveness checks hold
(runs/lock.py).

The image runs the labrun version that submitted the job (installed in it, or the host's
environment mounted, as the test cluster does): a task whose image has another refuses to
start, in one line (check_labrun_version).

Requeueing from inside: on USR2 submitit checkpoints, then runs `scontrol requeue JOB`, and the
image has no SLURM client (nor the cluster's munge key, nor a build of it that matches the
cluster's). So the job's Python puts labrun's relay first on its PATH (relay_requeues): an
`scontrol` that writes the request into the sweep folder, mounted at the same path; the batch
script, on the host, runs the real `scontrol requeue` once srun has returned (submitit's
teardown lines). One mechanism for all three runtimes, as the batch script runs outside the
container for each.
"""

from __future__ import annotations

import hashlib
import os
import shlex
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

import labrun
from labrun.config import facts
from labrun.core.errors import LabrunError
from labrun.core.files import atomic_path
from labrun.core.scheduler import SlurmScheduler
from labrun.runs.provenance import CONTAINER_DIGEST_ENV as DIGEST_ENV
from labrun.runs.provenance import CONTAINER_IMAGE_ENV as IMAGE_ENV


def mounts(cluster: DictConfig, job_config: DictConfig, code_dir: Path, sweep_dir: Path,
           submitted_from: str) -> list[str]:
    """The host folders the job's tasks need, each once, sorted: the code, the sweep folder
    (its run folders, the Optuna journal), the folders of the config's path keys that exist
    (relative ones taken from `submitted_from`; one that does not, a scratch folder say, is
    the container's own) and cluster.container.mounts."""
    found = {str(code_dir), str(sweep_dir)}
    for key in facts.path_keys():
        value = OmegaConf.select(job_config, key, default=None, throw_on_missing=False)
        if key.startswith("cluster.") or not isinstance(value, str) or not value:
            continue
        path = Path(os.path.normpath(os.path.join(submitted_from, value)))
        if path.is_dir() or path.is_file():  # not checkpoint.resume=auto
            found.add(str(path if path.is_dir() else path.parent))
    found.update(os.path.normpath(os.path.join(submitted_from, m))
                 for m in cluster.container.mounts)
    # A folder inside another mounted one is mounted with it.
    ordered = sorted(found)
    return [m for m in ordered if not any(m.startswith(other.rstrip("/") + "/")
                                          for other in ordered if other != m)]


def srun_args(container: DictConfig, binds: list[str], workdir: str) -> list[str]:
    """Pyxis's options for srun (pyxis README: --container-image, --container-mounts,
    --container-workdir, --container-env); nothing for the other runtimes."""
    if container.runtime != "pyxis":
        return []
    args = [f"--container-image={container.image}",
            f"--container-mounts={','.join(f'{m}:{m}' for m in binds)}",
            f"--container-workdir={workdir}"]
    if not container.gpus:
        # enroot's NVIDIA hook does nothing for NVIDIA_VISIBLE_DEVICES=void (setup exports it).
        args.append("--container-env=NVIDIA_VISIBLE_DEVICES")
    return args


# The folder of the relay's scontrol, as the batch script exports it to the job's tasks.
RELAY_ENV = "LABRUN_CONTAINER_BIN"


def relay_script() -> str:
    """labrun's scontrol inside the image: a requeue is written down, beside the script, for
    the batch script on the host to carry out (teardown_lines); anything else is refused in one
    line."""
    command, verb = SlurmScheduler.REQUEUE_COMMAND
    return f"""#!/bin/sh
# Written by labrun (launch/container.py): {command} inside cluster.container's image, which has
# no SLURM client. submitit's `{command} {verb} JOB` is written down beside this file; the job's
# batch script, on the host, runs the real one once this job's tasks have ended.
if [ "$1" = {verb} ] && [ $# -eq 2 ]; then
  request="$(dirname "$0")/requeue-${SlurmScheduler.JOB_ID_VARIABLE}"
  printf '%s\\n' "$2" > "$request.tmp" && mv "$request.tmp" "$request" && exit 0
fi
echo "error: {command} $*: SLURM's commands do not run inside cluster.container's image (labrun relays a requeue only); run them on the host" >&2
exit 1
"""


def relay_folder(folder: Path) -> Path:
    """The folder (in `folder`, a submission's .submitit/STAMP, inside the mounted sweep folder)
    holding the relay's scontrol, written once."""
    relay = folder / "container-bin"
    script = relay / SlurmScheduler.REQUEUE_COMMAND[0]
    if not script.is_file():
        relay.mkdir(parents=True, exist_ok=True)
        with atomic_path(script) as tmp:
            Path(tmp).write_text(relay_script())
            os.chmod(tmp, 0o755)
    return relay


def setup_lines(container: DictConfig, relay: Path) -> list[str]:
    """What the job's batch script exports before srun: where the relay is (the runtimes pass
    the host's environment: podman --env-host, Apptainer and Pyxis by default), and for Pyxis
    the image, for provenance."""
    lines = [f"export {RELAY_ENV}={shlex.quote(str(relay))}"]
    if container.runtime == "pyxis":
        lines.append(f"export {IMAGE_ENV}={shlex.quote(str(container.image))}")
        if not container.gpus:
            lines.append("export NVIDIA_VISIBLE_DEVICES=void")
    return lines


def teardown_lines() -> list[str]:
    """What the batch script runs once srun has returned: the requeue the job asked for from
    inside the container, then srun's exit status as the job's (a failed task fails the job).
    The request goes first, so that the requeued job cannot find it."""
    return ["labrun_status=$?",
            f"labrun_request=\"${RELAY_ENV}/requeue-${SlurmScheduler.JOB_ID_VARIABLE}\"",
            "if [ -e \"$labrun_request\" ]; then",
            "  labrun_job=$(cat \"$labrun_request\") && rm -f \"$labrun_request\"",
            "  " + SlurmScheduler.requeue_line('"$labrun_job"'),
            "fi",
            "exit $labrun_status"]


def relay_requeues() -> None:
    """In a task of a cluster.container job: labrun's scontrol first on this process's PATH,
    where submitit's requeue looks for it."""
    relay = os.environ.get(RELAY_ENV)
    if relay:
        os.environ["PATH"] = relay + os.pathsep + os.environ.get("PATH", "")


def check_labrun_version(submitted: str | None) -> None:
    """In a task of a cluster.container job: the image runs the labrun version that submitted
    the job (its code, configs and pickles are that version's), or the task stops here, in one
    line, which the sweep's table shows."""
    image = os.environ.get(IMAGE_ENV)
    if image and submitted and labrun.__version__ != submitted:
        raise LabrunError(f"cluster.container.image={image} runs labrun {labrun.__version__}, "
                          f"but the job was submitted with labrun {submitted}; install "
                          f"labrun=={submitted} in the image (the lab's wheel), or submit "
                          f"with the labrun the image has")


def python_command(container: DictConfig, binds: list[str], folder: Path) -> str:
    """submitit's `python` for the job: the image's interpreter for Pyxis, else the script
    (written into `folder` once, named by its content) that runs it in the image."""
    if container.runtime == "pyxis":
        return shlex.quote(container.python)
    script = task_script(container, binds)
    path = folder / f"container-{hashlib.sha256(script.encode()).hexdigest()[:12]}.sh"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            Path(tmp).write_text(script)
    return f"/bin/bash {shlex.quote(str(path))}"


def task_script(container: DictConfig, binds: list[str]) -> str:
    """The bash script one task runs: checks the runtime and the image on this node (one line
    and exit 127 or 125, as the runtimes themselves exit), then execs the runtime."""
    runtime, image = container.runtime, str(container.image)
    q = shlex.quote
    lines = ["#!/bin/bash",
             f"# Written by labrun (launch/container.py): this task's Python in {image}, "
             f"through {runtime}.",
             "set -euo pipefail",
             f"if ! command -v {runtime} >/dev/null; then",
             f"  echo \"error: cluster.container.runtime={runtime}: {runtime} is not installed "
             f"on $(hostname); install it there, or run without cluster.container.runtime\" >&2",
             "  exit 127",
             "fi"]
    if runtime == "podman":
        lines += [f"if ! podman image exists {q(image)}; then",
                  f"  echo \"error: cluster.container.image={image}: podman on $(hostname) has "
                  f"no such image; build or pull it there (podman images lists them)\" >&2",
                  "  exit 125",
                  "fi"]
        # Provenance records the image and its digest (runs/provenance.py).
        lines.append(f"digest=$(podman image inspect --format '{{{{.Digest}}}}' {q(image)})")
        run = ["exec podman run --rm --pull=never --env-host --network=host --pid=host "
               "--ipc=host --workdir \"$PWD\"",
               f"-e {IMAGE_ENV}={q(image)} -e {DIGEST_ENV}=\"$digest\"",
               *(f"-v {q(m)}:{q(m)}" for m in binds)]
        if container.gpus:
            prefix, _, suffix = str(container.gpu_device).partition("{index}")
            # The task's GPUs, as SLURM gave them (GRES indexes), each its device; inside, CUDA
            # numbers the devices it sees from 0.
            lines += ["devices=()",
                      "IFS=, read -ra gpus <<< \"${SLURM_STEP_GPUS:-${SLURM_JOB_GPUS:-}}\"",
                      "for index in \"${gpus[@]}\"; do",
                      f"  devices+=(--device {q(prefix)}\"$index\"{q(suffix) if suffix else ''})",
                      "done",
                      "visible=$(seq -s, 0 $(( ${#gpus[@]} - 1 )))"]
            run += ["\"${devices[@]}\"", "-e CUDA_VISIBLE_DEVICES=\"$visible\""]
        lines.append(" \\\n  ".join([*run, q(image), q(container.python), "\"$@\""]))
    else:  # apptainer
        if "://" not in image:
            lines += [f"if [ ! -e {q(image)} ]; then",
                      f"  echo \"error: cluster.container.image={image}: no such image on "
                      f"$(hostname); build it there (apptainer build) or give its path\" >&2",
                      "  exit 125",
                      "fi"]
        # Provenance records the image and (a SIF file) its ID (runs/provenance.py); Apptainer
        # passes the environment. The ID is the UUID SIF's global header holds at byte 48
        # (sylabs/sif pkg/sif/sif.go: launch[32], magic[10], version[3], arch[3], ID[16]), set
        # when the image was built: read from the header because hashing a multi-GB image at
        # every task's start costs minutes, and Apptainer has no cheaper digest of its own.
        lines.append(f"export {IMAGE_ENV}={q(image)}")
        if "://" not in image:
            lines += [f"if [ -f {q(image)} ] && "
                      f"[ \"$(head -c 41 {q(image)} | tail -c 9)\" = SIF_MAGIC ]; then",
                      f"  id=$(od -An -tx1 -j48 -N16 {q(image)} | tr -d ' \\n')",
                      f"  export {DIGEST_ENV}=\"sif-id:${{id:0:8}}-${{id:8:4}}-"
                      "${id:12:4}-${id:16:4}-${id:20:12}\"",
                      "fi"]
        run = ["exec apptainer exec", *(["--nv"] if container.gpus else []),
               f"--bind {q(','.join(binds))}", "--pwd \"$PWD\""]
        lines.append(" \\\n  ".join([*run, q(image), q(container.python), "\"$@\""]))
    return "\n".join(lines) + "\n"
