"""Validation of what the schemas' types cannot say: ranges, choices, paths that must exist,
and how keys fit together. `validate(cfg)` raises a ConfigError naming the first key that
cannot work and its fix; Hydra has already checked names and types while composing against
config/schema.py.
"""

from __future__ import annotations

import difflib
import functools
import ipaddress
import logging
from pathlib import Path

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from labrun.config.facts import all_facts
from labrun.config.keys import check_keys
from labrun.core.environment import Environment
from labrun.core.errors import ConfigError

log = logging.getLogger(__name__)

POSITIVE = ("distributed.bucket_cap_mb", "distributed.timeout_s", "trainer.max_epochs",
            "trainer.max_steps", "trainer.batch_size", "trainer.devices", "trainer.num_nodes",
            "dataset.image_size", "dataset.block_size", "optimizer.lr",
            "trainer.log_every_n_steps", "trainer.stop_check_every_n_steps",
            "schedule.step_every_n_steps")
NON_NEGATIVE = ("optimizer.weight_decay", "trainer.grad_clip", "checkpoint.keep_last",
                "checkpoint.every_n_steps", "trainer.val_every_n_steps", "dataset.num_workers",
                "schedule.warmup_epochs", "schedule.warmup_steps", "trainer.ema_warmup_steps")
# What the trainer logs itself, whatever the task: StepWindow.metrics (train/progress.py) at each
# logged step, and perf/gpu_util where NVML reads the run's GPUs (train/trainer.py). At an
# epoch's end the trainer takes checkpoint.monitor from the validation metrics, else from the
# last logged value of these (Trainer.validate).
TRAINER_METRICS = ("train/loss", "train/lr", "perf/samples_per_s", "perf/images_per_s",
                   "perf/tokens_per_s", "perf/data_wait_frac", "perf/gpu_util")
# Callbacks that judge an epoch by checkpoint.monitor among its validation metrics alone: to
# them a train/ or perf/ monitor is always missing (early stopping would end the run after
# `patience` epochs with "best none"; the pruner would never hear a value).
READ_VALIDATION_ONLY = ("labrun.train.callbacks.EarlyStopping",
                        "labrun.train.pruning.OptunaPruning")


def validate(cfg: DictConfig, *, read_data: bool = True) -> None:
    """Raise ConfigError naming the first key that cannot work, and how to fix it.
    read_data=False leaves out what reads the machine's files (that path keys exist, and the
    task's check of the data's own files, check_task), for a config whose paths stand in for
    what the command line or another machine will give (`labrun configs check`, `review`)."""
    check_keys(cfg)
    declared = all_facts()  # each key's facts, as its schema field states them
    for dotted, facts in declared.items():
        if facts.choices:
            _check_choice(cfg, dotted, facts.choices)
    for dotted in POSITIVE:
        value = OmegaConf.select(cfg, dotted)
        if value is not None and not value > 0:
            raise ConfigError(f"{dotted}={value} must be greater than 0")
    for dotted in NON_NEGATIVE:
        value = OmegaConf.select(cfg, dotted)
        if value is not None and value < 0:
            raise ConfigError(f"{dotted}={value} must be 0 or more")
    if cfg.dataset.get("decode") == "cuda" and cfg.trainer.accelerator in ("cpu", "mps"):
        raise ConfigError(f"dataset.decode=cuda puts batches on the GPU, but "
                          f"trainer.accelerator={cfg.trainer.accelerator}; use "
                          f"dataset.decode=cpu or workers")
    check_budget(cfg.trainer)
    decay = cfg.trainer.get("ema_decay")
    if decay is not None and not 0 <= decay < 1:
        raise ConfigError(f"trainer.ema_decay={decay} must be in [0, 1): the weight of the old "
                          f"average at each step, 0.9999 for most recipes")
    check_cluster(cfg)
    fraction = cfg.dataset.get("val_fraction", 0.0)  # image datasets hold val out of train
    if not 0 <= fraction < 1:
        raise ConfigError(f"dataset.val_fraction={fraction} must be in [0, 1)")
    check_folds(cfg.dataset)
    check_detection_augment(cfg.dataset)
    world_size = cfg.trainer.devices * cfg.trainer.num_nodes
    micro = cfg.trainer.micro_batch_size
    if micro != "auto":
        if not isinstance(micro, int) or isinstance(micro, bool) or micro <= 0:
            raise ConfigError(
                f"trainer.micro_batch_size={micro} must be a positive integer or auto")
        if cfg.trainer.batch_size % (micro * world_size):
            raise ConfigError(
                f"trainer.batch_size={cfg.trainer.batch_size} is not divisible by "
                f"trainer.micro_batch_size x world size = {micro} x {world_size}; "
                f"pick a batch_size that is a multiple of {micro * world_size}")
    elif cfg.trainer.batch_size % world_size:
        raise ConfigError(
            f"trainer.batch_size={cfg.trainer.batch_size} is not divisible by the world size "
            f"{world_size} (trainer.devices x trainer.num_nodes)")
    for dotted, facts in declared.items():
        if facts.must_exist:
            _check_exists(cfg, dotted, read_data)
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "never") and not Path(resume).is_file():
        raise ConfigError(
            f"checkpoint.resume={resume}: no such file; give a checkpoint path, auto or never")
    check_checkpoint_monitor(cfg)
    _validate_monitor(cfg)
    if read_data:
        check_task(cfg)


def check_detection_augment(dataset: DictConfig) -> None:
    """A detection dataset's augmentation (data/detection/transforms.py): each key within what
    its transform can do, refused in one line before any data loads."""
    augment = dataset.get("augment")
    if not isinstance(augment, DictConfig) or "close_mosaic" not in augment:
        return  # not detection's augment section
    for name in ("mosaic", "min_visible"):
        if not 0 <= augment[name] <= 1:
            raise ConfigError(f"dataset.augment.{name}={augment[name]} must be in [0, 1]")
    for name in ("brightness", "contrast", "saturation"):
        if not 0 <= augment[name] < 1:
            raise ConfigError(f"dataset.augment.{name}={augment[name]} must be in [0, 1): "
                              f"factors are drawn from [1 - x, 1 + x]")
    if not 0 <= augment.hue <= 0.5:
        raise ConfigError(f"dataset.augment.hue={augment.hue} must be in [0, 0.5] (a share of "
                          f"the colour wheel each way)")
    if augment.close_mosaic < 0:
        raise ConfigError(f"dataset.augment.close_mosaic={augment.close_mosaic} must be 0 or "
                          f"more (epochs at the end without mosaic)")
    scale = list(augment.scale)
    if len(scale) != 2 or not 0 < scale[0] <= scale[1]:
        raise ConfigError(f"dataset.augment.scale={scale} must be [low, high] with "
                          f"0 < low <= high (for example [0.5, 1.5])")


def check_task(cfg: DictConfig) -> None:
    """The task's own check that its data and model fit, if it has one: a classmethod
    `check_config(cfg)` raising ConfigError (LanguageModelling reads the token folder's
    tokens.json and the sizes of model.init_from). Run by validate() and, for each job of a
    sweep, by launch/sweep.plan: before any data loads or any job is submitted."""
    target = OmegaConf.select(cfg, "task._target_", default=None, throw_on_missing=False)
    task = _task_class(target) if isinstance(target, str) else None
    check = getattr(task, "check_config", None)
    if check is not None:
        check(cfg)


def check_folds(dataset: DictConfig) -> None:
    """dataset.num_folds and dataset.fold: both or neither, the fold one of the K."""
    folds, fold = dataset.get("num_folds"), dataset.get("fold")
    if folds is None and fold is None:
        return
    if folds is None:
        raise ConfigError(f"dataset.fold={fold} needs dataset.num_folds (the K of k-fold "
                          f"cross-validation): dataset.num_folds=5 dataset.fold={fold}")
    if folds < 2:
        raise ConfigError(f"dataset.num_folds={folds} must be 2 or more")
    if fold is None or not 0 <= fold < folds:
        raise ConfigError(f"dataset.fold={fold} must be one of 0..{folds - 1} "
                          f"(dataset.num_folds={folds}); a sweep over every fold: "
                          f"-m 'dataset.fold=range(0,{folds})'")


def check_budget(trainer: DictConfig) -> None:
    """One budget: epochs or steps. trainer.max_steps alone replaces the default epochs
    (conf/train.yaml); both given, by the command line or a preset, cannot both hold."""
    epochs, steps = trainer.max_epochs, trainer.max_steps
    if epochs is not None and steps is not None:
        raise ConfigError(f"trainer.max_epochs={epochs} and trainer.max_steps={steps} are both "
                          f"set: a run's budget is one of them; drop one (trainer.max_epochs="
                          f"null keeps the step budget)")
    if epochs is None and steps is None:
        raise ConfigError("neither trainer.max_epochs nor trainer.max_steps is set: give the "
                          "run's budget in one of them")


# What SLURM would be handed (sbatch's --array %N, -c, -t, -N, --ntasks-per-node, --mem; submitit's
# requeue count and USR2 lead): keys of a SLURM cluster config, absent from cluster=local.
CLUSTER_AT_LEAST_ONE = ("cluster.array_parallelism", "cluster.cpus_per_task",
                        "cluster.timeout_min", "cluster.nodes", "cluster.tasks_per_node",
                        "cluster.controller.cpus_per_task", "cluster.controller.timeout_min")
CLUSTER_POSITIVE_OR_NULL = ("cluster.mem_gb", "cluster.controller.mem_gb")
CLUSTER_NON_NEGATIVE = ("cluster.max_num_timeout", "cluster.signal_delay_s")


def check_cluster(cfg: DictConfig) -> None:
    """The cluster keys' ranges and the container, before anything is submitted: run by
    validate() and, for each job of a sweep, by launch/sweep.plan."""
    for dotted in CLUSTER_AT_LEAST_ONE:
        value = OmegaConf.select(cfg, dotted, default=None)
        if value is not None and value < 1:
            raise ConfigError(f"{dotted}={value} must be 1 or more")
    for dotted in CLUSTER_POSITIVE_OR_NULL:
        value = OmegaConf.select(cfg, dotted, default=None)
        if value is not None and not value > 0:
            raise ConfigError(f"{dotted}={value} must be greater than 0, or null for the "
                              f"partition's default")
    for dotted in CLUSTER_NON_NEGATIVE:
        value = OmegaConf.select(cfg, dotted, default=None)
        if value is not None and value < 0:
            raise ConfigError(f"{dotted}={value} must be 0 or more")
    _check_container(cfg)


def _check_container(cfg: DictConfig) -> None:
    container = OmegaConf.select(cfg, "cluster.container", default=None)
    if container is None or container.runtime is None:
        return
    if not container.image:
        raise ConfigError(f"cluster.container.runtime={container.runtime} needs the image to "
                          f"run: set cluster.container.image")
    if container.runtime == "podman" and container.gpus and "{index}" not in container.gpu_device:
        raise ConfigError(f"cluster.container.gpu_device={container.gpu_device} names no GPU: "
                          f"it needs {{index}}, the place of a GRES GPU's index "
                          f"(nvidia.com/gpu={{index}}, /dev/nvidia{{index}})")


def check_single_run(cfg: DictConfig, here: Environment) -> str | None:
    """A run without -m that trains in this process (`here`): on this machine (cluster=local),
    in the job labrun submitted it as, or inside a person's own SLURM allocation (salloc, srun
    --pty), where it trains in that allocation instead of submitting a job from a job. There
    it returns the line that says so, or refuses an allocation smaller than the run asks and
    a cluster.container it would not run in (the image affects results; config/fields.py)."""
    if here.scheduler is None or here.submitted_by_labrun:
        return None  # no allocation, or the one labrun asked for (image and resources)
    trainer, job = cfg.trainer, f"{here.scheduler} job {here.job_id}"
    processes = trainer.devices * trainer.num_nodes
    asked = (f"trainer.devices={trainer.devices} x trainer.num_nodes={trainer.num_nodes} "
             f"needs {processes}")
    if here.num_nodes < trainer.num_nodes:
        raise ConfigError(f"inside {job}, which has {here.num_nodes} node(s): "
                          f"trainer.num_nodes={trainer.num_nodes}; ask the allocation for "
                          f"{trainer.num_nodes} nodes, or run outside it to submit a job")
    if here.job_tasks is not None and here.job_tasks < processes:
        raise ConfigError(f"inside {job}, which has {here.job_tasks} task(s): {asked}; ask "
                          f"the allocation for --ntasks={processes}, or lower trainer.devices")
    if OmegaConf.select(cfg, "cluster.gpus_per_node", default=None) and (
            here.job_gpus_on_node * here.num_nodes < processes):
        raise ConfigError(f"inside {job}, which has {here.job_gpus_on_node} GPU(s) a node: "
                          f"{asked} GPUs; ask the allocation for --gpus-per-node="
                          f"{trainer.devices}, or lower trainer.devices")
    container = OmegaConf.select(cfg, "cluster.container", default=None)
    if container is not None and container.runtime is not None and here.container is None:
        raise ConfigError(f"cluster.container.runtime={container.runtime}: inside {job} this "
                          f"run would train here, outside {container.image}; run it outside "
                          f"the allocation (it is submitted into the image), or "
                          f"cluster.container.runtime=null to train here")
    return (f"inside {job} ({here.num_nodes} node(s)): training in this allocation, not "
            f"submitting a job")


def check_checkpoint_monitor(cfg: DictConfig) -> None:
    """Refuse a checkpoint.monitor that no metric of the run carries: best.pt, early stopping
    and the sweepers' objective read it, and a typo would train the whole run to end "best
    none". Run by validate() and, before a sweep submits anything, by launch/sweep.plan.

    Accepted: val/NAME for each of the task's `metric_names`, and TRAINER_METRICS. Not test/
    (measured once, after training, on best.pt: it cannot choose best.pt) nor best/ (the best
    so far of the metric after it)."""
    monitor = cfg.checkpoint.monitor
    target = OmegaConf.select(cfg, "task._target_", default=None, throw_on_missing=False)
    task = _task_class(target) if isinstance(target, str) else None
    if task is None:
        return  # no task, or one that does not import: instantiate says why
    names = getattr(task, "metric_names", None)
    if names is None:
        _warn_undeclared(target, monitor)
        return
    if isinstance(names, str):  # one name, not its letters
        names = (names,)
    validation_metrics = [f"val/{name}" for name in names]
    reported = [*validation_metrics, *TRAINER_METRICS]
    if monitor not in reported:
        raise ConfigError(f"checkpoint.monitor={monitor} is not among the metrics this run "
                          f"reports while training ({', '.join(reported)}); "
                          f"{_closest(monitor, reported)}{_why_not(monitor)}")
    if monitor in validation_metrics:
        return
    for name, node in (cfg.get("callbacks") or {}).items():
        callback = node.get("_target_") if isinstance(node, DictConfig) else None
        if callback in READ_VALIDATION_ONLY:
            raise ConfigError(f"checkpoint.monitor={monitor}: callbacks.{name} ({callback}) "
                              f"reads it from the validation metrics alone "
                              f"({', '.join(validation_metrics)}); monitor one of them")


@functools.cache  # each task is imported once per process, however many jobs name it
def _task_class(target: str) -> object | None:
    try:
        return get_object(target)
    except Exception:  # importing runs foreign code: any error means "cannot tell"
        return None


@functools.cache  # once per process: a sweep checks every job's config before submitting
def _warn_undeclared(target: str, monitor: str) -> None:
    log.warning(f"task {target} declares no metric_names: checkpoint.monitor={monitor} is not "
                f"checked against what it reports (docs/plugins.md, Add a task)")


def _why_not(monitor: str) -> str:
    if monitor.startswith("test/"):
        return " (test/ is measured once, after training, on best.pt)"
    if monitor.startswith("best/"):
        return " (best/X is the best X so far, which the trainer logs itself)"
    return ""


def _closest(monitor: str, reported: list[str]) -> str:
    # test/X and best/X are no monitors, but val/X and X are what was meant.
    for prefix, instead in (("test/", "val/"), ("best/", "")):
        if monitor.startswith(prefix):
            monitor = instead + monitor[len(prefix):]
    hint = difflib.get_close_matches(monitor, reported, n=1)
    return f"did you mean {hint[0]}?" if hint else "monitor one of them"


def _validate_monitor(cfg: DictConfig) -> None:
    monitor = cfg.get("monitor")
    if monitor is None:
        return
    if not 0 <= monitor.port <= 65535:
        raise ConfigError(f"monitor.port={monitor.port} must be in 0..65535 (0: a free port)")
    if monitor.bind != "node":
        try:
            ipaddress.ip_address(monitor.bind)
        except ValueError:
            # A host name would be looked up in DNS on every node; an address says where.
            raise ConfigError(
                f"monitor.bind={monitor.bind} is not an IP address; use 127.0.0.1 (this "
                f"machine only), node (this node's address towards the SLURM controller) or "
                f"an address of this machine") from None
    if not monitor.gpu_poll_s > 0:
        raise ConfigError(f"monitor.gpu_poll_s={monitor.gpu_poll_s} must be greater than 0")
    for name in ("data_bound_wait_frac", "gpu_idle_util", "gpu_good_util"):
        value = monitor[name]
        if not 0 < value < 1:
            raise ConfigError(f"monitor.{name}={value} must be a fraction in (0, 1), "
                              f"e.g. 0.3")
    if not monitor.gpu_idle_util < monitor.gpu_good_util:
        raise ConfigError(f"monitor.gpu_idle_util={monitor.gpu_idle_util} must be below "
                          f"monitor.gpu_good_util={monitor.gpu_good_util}: GPUs busy between "
                          f"the two are underused, above the second well used")


def _check_choice(cfg: DictConfig, dotted: str, choices: tuple[str, ...]) -> None:
    """The key's value is one of the `choices` its schema field declares (key(choices=...))."""
    value = OmegaConf.select(cfg, dotted)
    if value is not None and value not in choices:
        raise ConfigError(f"{dotted}={value} is not one of: {', '.join(choices)}")


def _check_exists(cfg: DictConfig, key: str, read_data: bool) -> None:
    """A required path key is given (`???` left is refused either way) and, when the machine's
    files are read, exists."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent)
    if not isinstance(node, DictConfig) or leaf not in node.keys():
        return
    if OmegaConf.is_missing(node, leaf):
        raise ConfigError(f"{key} is required with {parent}={_option_name(cfg, parent)}; "
                          f"add {key}=...")
    value = node[leaf]
    if value is None or (key == "dataset.root" and node.get("download")) or not read_data:
        return  # unset, downloaded on first use, or not this machine's to judge
    if not Path(value).exists():
        raise ConfigError(f"{key}={value}: no such file or folder; check the path")


def _option_name(cfg: DictConfig, group: str) -> str:
    node = OmegaConf.select(cfg, group)
    return node.get("name", "...") if isinstance(node, DictConfig) else "..."
