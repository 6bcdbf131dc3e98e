"""Structured-config schemas, registered in Hydra's ConfigStore under `schema/`.

Each YAML file in conf/ starts from one of these schemas (its defaults list names
`/schema/<group>/<name>@_here_`), so Hydra checks key names and types while it composes, and
`python train.py optimizer.lr=abc` fails before anything runs. config/validation.py then checks
what types cannot express: ranges, choices, paths and how keys fit together.

A key added with `+` (which Hydra lets through even into a typed section) must be one something
reads: each schema says which new keys it takes with its class attribute `new_keys`, and
`keys.check_keys()` refuses the rest, naming the closest known key.

Fields declared with `key(...)` carry their facts (a path? may it change on resume? does it change
the result? which values may it take?) as metadata; config/facts.py derives every key list from
them, config/validation.py its checks.

One table of every key labrun takes, in three files for length: the dataset/ group's schemas in
config/dataset_schema.py, the model/ group's in config/model_schema.py, the rest here; SCHEMAS
registers them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from labrun.config.dataset_schema import (
    CIFAR10Config,
    COCOConfig,
    DetHDF5Config,
    DigitsConfig,
    HDF5Config,
    ImageFolderConfig,
    PythonDocsConfig,
    SegFolderConfig,
    SegHDF5Config,
    ShapesBoxesConfig,
    ShapesConfig,
    SyntheticConfig,
    TextConfig,
    TokensConfig,
    YOLOConfig,
)
from labrun.config.fields import NewKeys, key
from labrun.config.model_schema import (
    FCOSModelConfig,
    GPTConfig,
    HFModelConfig,
    SimpleCNNConfig,
    TimmModelConfig,
    TorchvisionDetModelConfig,
    TorchvisionModelConfig,
    TorchvisionSegModelConfig,
    UNetConfig,
)
from labrun.config.objective import DEFAULT_MODE, DEFAULT_MONITOR, MODES

# ---------------------------------------------------------------------------------------------
# Top level


@dataclass
class TrainerConfig:
    # The budget: epochs, or optimizer steps (max_steps); one of the two. More: resume and
    # train on.
    max_epochs: int | None = key(8, resume_safe=True)
    max_steps: int | None = key(None, resume_safe=True)
    # Validation (with best.pt, early stopping, pruning) every this many optimizer steps;
    # 0: at each epoch's end. Either way also when the budget ends mid-epoch.
    val_every_n_steps: int = key(0, resume_safe=True)
    batch_size: int = 64  # effective, global: micro_batch_size x accumulation x world size
    micro_batch_size: Any = key("auto", resume_safe=True)  # per process, or "auto": batch_size / world size, halved on OOM
    accelerator: str = key("auto", choices=("auto", "cpu", "cuda", "mps"))  # auto: cuda, then mps, then cpu
    devices: int = 1  # processes per node, one per GPU
    num_nodes: int = 1
    deterministic: bool = False  # bit-reproducible on the CPU
    grad_clip: float = 0.0  # max gradient norm; 0 turns clipping off
    channels_last: bool = False
    compile: bool = False  # torch.compile the model
    log_every_n_steps: int = key(10, resume_safe=True, affects_result=False)
    limit_train_batches: int | None = None  # optimizer steps per epoch, for smoke runs
    limit_val_batches: int | None = key(None, resume_safe=True)
    # What a non-finite loss does. stop: at the next log point or checkpoint, naming the first
    # bad step; skip: reads the loss every step.
    nan_policy: str = key("stop", choices=("stop", "skip"))
    # Under DDP the ranks agree on a stop signal (USR2, SIGTERM, Ctrl-C) every this many steps:
    # at a few seconds a step, 10 steps stay well inside SLURM's warning (cluster.signal_delay_s)
    # and a QOS's preemption grace time. A process alone checks every step.
    stop_check_every_n_steps: int = key(10, resume_safe=True, affects_result=False)
    # auto: a rich bar on a TTY, log lines otherwise
    progress: str = key("auto", resume_safe=True, affects_result=False,
                        choices=("auto", "bar", "log", "none"))
    # An exponential moving average of the weights (train/ema.py), updated after every optimizer
    # step taken; validation, test, best.pt's choice, `labrun eval` and `labrun export` use it.
    # Update n weighs the old average by ema_decay * (1 - exp(-n / ema_warmup_steps)), YOLO's
    # warm-up (0: by ema_decay from the start); the first update copies the weights.
    ema: bool = False
    ema_decay: float = 0.9999
    ema_warmup_steps: int = 2000


@dataclass
class CheckpointConfig:
    # What a run is judged by: the task's config sets both (conf/task/); these hold for a task
    # whose config names no monitor (config/objective.py).
    monitor: str = DEFAULT_MONITOR
    mode: str = key(DEFAULT_MODE, choices=MODES)
    keep_last: int = key(3, resume_safe=True, affects_result=False)  # step-NNNNNNNN.pt history files kept beside last.pt and best.pt
    # What a completed or pruned run keeps (train/checkpoint.py, labrun gc). best_last: best.pt
    # and last.pt; best: best.pt alone; auto: best_last in a sweep job, all in a single run.
    on_finish: str = key("auto", resume_safe=True, affects_result=False,
                         choices=("auto", "all", "best_last", "best"))
    every_n_steps: int = key(0, resume_safe=True, affects_result=False)  # 0: only at the end of every epoch
    resume: str = key("auto", path=True, resume_safe=True, affects_result=False)  # auto | never | PATH to a checkpoint


@dataclass
class PathsConfig:
    # Where things are, not what a run computes: the folder a run's data sits in may move.
    data_dir: str = key("data", path=True, resume_safe=True, affects_result=False)
    raw_dir: str = key("data/raw", path=True, resume_safe=True, affects_result=False)
    processed_dir: str = key("data/processed", path=True, resume_safe=True, affects_result=False)
    output_root: str = key("outputs", resume_safe=True, affects_result=False)
    multirun_root: str = key("multirun", resume_safe=True, affects_result=False)
    scratch_dir: str = key("/tmp/labrun-scratch", path=True, resume_safe=True,
                           affects_result=False)
    run_dir: str = key(".", resume_safe=True, affects_result=False)  # set by Hydra in each job
    # The lab's shared pretrained weights, in the libraries' own layouts (models/pretrained.py):
    # looked in first; null: only TORCH_HOME's and HF_HOME's caches. Each run records the sha256
    # of the file it loaded, so where the cache sits does not change a result.
    weights_cache: str | None = key(None, path=True, resume_safe=True, affects_result=False)


@dataclass
class DistributedConfig:
    backend: str = key("auto", choices=("auto", "nccl", "gloo"))  # auto: nccl on CUDA, gloo on the CPU
    bucket_cap_mb: int = key(25, affects_result=False)  # DDP's gradient bucket size
    timeout_s: int = key(1800, affects_result=False)  # how long a collective waits for the other ranks


@dataclass
class MonitorConfig:
    """The run's Prometheus endpoint (monitoring/metrics_endpoint.py) and the thresholds `labrun
    status` judges a job's efficiency by. Watching a run changes nothing it computes."""

    enabled: bool = True  # serve /metrics while training (monitor/node-N.json says where)
    port: int = 0  # 0: a free port; a fixed port that is taken falls back to a free one
    bind: str = "127.0.0.1"  # an IP address of this machine, or node: its address towards the SLURM controller
    gpu_poll_s: float = 5.0  # how often NVML is read (perf/gpu_util, the GPU gauges)
    data_bound_wait_frac: float = 0.3  # data-wait fraction above which a job is data-bound
    gpu_idle_util: float = 0.3  # mean GPU utilisation below which a job's GPUs are idle
    gpu_good_util: float = 0.7  # mean GPU utilisation from which they are well used


@dataclass
class TrainConfig:
    new_keys: ClassVar[NewKeys] = NewKeys.OPEN  # `+tag=x`: tests and people label runs

    seed: int = 0
    dataset: Any = MISSING
    model: Any = MISSING
    optimizer: Any = MISSING
    schedule: Any = MISSING
    precision: Any = MISSING
    # Where and how a run is launched and logged, not what it computes.
    cluster: Any = key(MISSING, resume_safe=True, affects_result=False)
    logger: Any = key(MISSING, resume_safe=True, affects_result=False)
    paths: Any = key(MISSING, resume_safe=True, affects_result=False)
    task: Any = MISSING  # loss and metrics: conf/task/
    callbacks: Any = key(factory=dict)  # name -> a `_target_` node: conf/callbacks/
    trainer: TrainerConfig = key(factory=TrainerConfig)
    checkpoint: CheckpointConfig = key(factory=CheckpointConfig)
    distributed: DistributedConfig = key(factory=DistributedConfig)
    monitor: MonitorConfig = key(factory=MonitorConfig, resume_safe=True, affects_result=False)


# ---------------------------------------------------------------------------------------------
# optimizer/, schedule/ (model/: config/model_schema.py): `_target_` names what runs.


@dataclass
class OptimizerConfig:
    new_keys: ClassVar[NewKeys] = NewKeys.TARGET

    _target_: str = MISSING
    _partial_: bool = True
    lr: float = MISSING
    weight_decay: float = 0.0
    # Learning rates per parameter (train/fine_tuning.py), one of: groups by name pattern,
    # [{params: "fc.*", lr_mult: 10}]; or every parameter but the class head at lr x this.
    groups: list[Any] = field(default_factory=list)
    backbone_lr_mult: float | None = None


@dataclass
class SGDConfig(OptimizerConfig):
    momentum: float = 0.9
    nesterov: bool = False


@dataclass
class AdamWConfig(OptimizerConfig):
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8


@dataclass
class ScheduleConfig:
    new_keys: ClassVar[NewKeys] = NewKeys.TARGET

    _target_: str = MISSING
    _partial_: bool = True
    warmup_epochs: float = 0.0
    warmup_steps: int | None = None  # instead of warmup_epochs


@dataclass
class CosineScheduleConfig(ScheduleConfig):
    min_lr_ratio: float = 0.0


@dataclass
class StepScheduleConfig(ScheduleConfig):
    step_epochs: int = 30
    step_every_n_steps: int | None = None  # instead of step_epochs
    gamma: float = 0.1


# ---------------------------------------------------------------------------------------------
# precision/, cluster/, logger/


@dataclass
class PrecisionConfig:
    name: str = key("fp32", choices=("fp32", "bf16", "fp16"))
    init_scale: float = 65536.0  # fp16's first loss scale


@dataclass
class ClusterConfig:
    name: str = "local"
    env: dict[str, str] = field(default_factory=dict)  # environment variables for every job


@dataclass
class LocalClusterConfig(ClusterConfig):
    gpu_ids: list[int] | None = None  # default: every visible GPU
    max_parallel: int | None = None  # default: len(gpu_ids) // devices, 1 without GPUs
    devices: int = 1  # GPUs per job: trainer.devices


@dataclass
class StudyControllerConfig:
    """The SLURM job that runs a detached Optuna study (`hparams_search=optuna
    cluster.detach=true`): the sweeper, asking for trials and submitting them, in a CPU slot.
    Its keys have the `cluster` section's facts (resume-safe, no effect on any result)."""

    partition: str | None = None  # null: the cluster's default partition
    qos: str | None = None
    account: str | None = None  # null: cluster.account
    cpus_per_task: int = 1
    mem_gb: int | None = 2
    timeout_min: int = 4320  # three days; at the limit it requeues itself (max_num_timeout)


@dataclass
class ContainerConfig:
    """cluster.container: each task of a SLURM job runs its Python inside the lab's image
    (launch/container.py), with the code, the sweep folder and the data at the same paths."""

    runtime: str | None = key(None, choices=("apptainer", "pyxis", "podman"))  # null: the submitting venv's Python
    image: str | None = key(None, affects_result=True)  # a .sif, a squashfs/registry name, a tag
    mounts: list[str] = key(factory=list, path=True)  # more host folders, at the same paths
    gpus: bool = True  # --nv (Apptainer), enroot's hooks (Pyxis), the job's GRES (Podman)
    python: str = "python3"  # the image's interpreter
    # Podman: the device each of the task's GRES GPU indexes names; NVIDIA's CDI by default.
    gpu_device: str = "nvidia.com/gpu={index}"


@dataclass
class SlurmClusterConfig(ClusterConfig):
    partition: str | None = None
    qos: str | None = None  # the lab's "urgent" label
    account: str | None = None
    cpus_per_task: int = 4
    mem_gb: int | None = None
    timeout_min: int = 1440
    nodes: int = 1
    gpus_per_node: int | None = None  # GPUs per node: trainer.devices (null: no GRES)
    tasks_per_node: int = 1  # one process per GPU: trainer.devices
    array_parallelism: int = 16  # jobs of one sweep running at once
    max_num_timeout: int = 3  # requeues after a time-out (preemptions do not count)
    signal_delay_s: int = 120  # USR2 this long before the time limit: checkpoint, requeue
    extra_sbatch: dict[str, Any] = field(default_factory=dict)  # any other sbatch option
    detach: bool = False  # return after submission; `labrun status SWEEP_DIR` shows progress
    snapshot: bool = True  # jobs run the code as it was at submission
    controller: StudyControllerConfig = field(default_factory=StudyControllerConfig)
    container: ContainerConfig = field(default_factory=ContainerConfig)


@dataclass
class TaskConfig:
    new_keys: ClassVar[NewKeys] = NewKeys.TARGET

    _target_: str = MISSING  # a class that owns the batch (labrun.train.task's protocol)


@dataclass
class LoggerConfig:
    new_keys: ClassVar[NewKeys] = NewKeys.TARGET  # those its Tracker class takes

    _target_: str = MISSING  # the Tracker class (facts: the `logger` field's)
    name: str = "csv"  # wandb | tensorboard | csv | none
    project: str = "labrun"
    entity: str | None = None
    mode: str = key("auto", choices=("auto", "online", "offline", "disabled"))  # wandb's; auto: online when logged in
    group: str | None = None  # default: the sweep folder's name
    tags: list[str] = field(default_factory=list)


PLUGIN = "hydra_plugins.labrun_launcher.labrun_launcher."

SCHEMAS: dict[str, Any] = {
    "train": TrainConfig,
    "paths": PathsConfig,
    "dataset/digits": DigitsConfig,
    "dataset/synthetic": SyntheticConfig,
    "dataset/imagefolder": ImageFolderConfig,
    "dataset/hdf5": HDF5Config,
    "dataset/cifar10": CIFAR10Config,
    "dataset/shapes": ShapesConfig,
    "dataset/segfolder": SegFolderConfig,
    "dataset/seg_hdf5": SegHDF5Config,
    "dataset/shapes_boxes": ShapesBoxesConfig,
    "dataset/coco": COCOConfig,
    "dataset/yolo": YOLOConfig,
    "dataset/det_hdf5": DetHDF5Config,
    "dataset/tokens": TokensConfig,
    "dataset/python_docs": PythonDocsConfig,
    "dataset/text": TextConfig,
    "model/simple_cnn": SimpleCNNConfig,
    "model/torchvision": TorchvisionModelConfig,
    "model/timm": TimmModelConfig,
    "model/unet": UNetConfig,
    "model/torchvision_seg": TorchvisionSegModelConfig,
    "model/torchvision_det": TorchvisionDetModelConfig,
    "model/fcos": FCOSModelConfig,
    "model/gpt": GPTConfig,
    "model/hf": HFModelConfig,
    "optimizer/sgd": SGDConfig,
    "optimizer/adamw": AdamWConfig,
    "schedule/cosine": CosineScheduleConfig,
    "schedule/step": StepScheduleConfig,
    "schedule/constant": ScheduleConfig,
    "precision": PrecisionConfig,
    "cluster/local": LocalClusterConfig,
    "cluster/slurm": SlurmClusterConfig,
    "logger": LoggerConfig,
    "task": TaskConfig,
}


def register() -> None:
    """Put the schemas into Hydra's ConfigStore (idempotent); the resolvers: config/resolvers.py."""
    store = ConfigStore.instance()
    for path, node in SCHEMAS.items():
        group, _, name = path.rpartition("/")
        store.store(group=f"schema/{group}".rstrip("/"), name=name, node=node)
    # The launchers behind `cluster=`: their settings are read from the cluster config.
    store.store(group="hydra/launcher", name="labrun_local",
                node={"_target_": PLUGIN + "LabrunLocalLauncher"})
    store.store(group="hydra/launcher", name="labrun_slurm",
                node={"_target_": PLUGIN + "LabrunSlurmLauncher"})
