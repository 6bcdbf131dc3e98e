"""Tasks: what a batch is, the model it needs, its loss and its metrics, chosen by conf/task/.

The Trainer never looks inside a batch; the task does (composer's `ComposerModel.loss(outputs,
batch)`, timm's `TrainingTask`). A task is a class with:

    num_sums, metric_names     class attributes (validation reads metric_names without torch)
    build_model(model_cfg, info) -> nn.Module     `info`: what the data declares (Data.info)
    setup(info, device, memory_format)            once, before the first batch
    prepare(batch, device) -> batch               on the device, ready for the model; no host
                                                  sync (image tasks normalise here)
    count(batch) -> int or 0-d tensor             the items the loss sums over (samples,
                                                  tokens, pixels), of the batch as the loader
                                                  gives it (before prepare): an int when every
                                                  rank's batches hold the same number (a
                                                  batch's length), a tensor when they may
                                                  differ (labels that are not ignored)
    loss(model, batch) -> loss_sum                summed over the batch's items, not averaged:
                                                  the Trainer divides by the items of the
                                                  whole optimizer step
    eval_sums(model, batch) -> 1-d tensor         per-batch sums, added up (and all-reduced)
    eval_metrics(sums, split) -> {SPLIT/NAME: value}
    gathers, eval_records(model, batch)           optional, for a metric that is no sum
                                                  (detection's mAP ranks the whole split):
                                                  gathers = True, and eval_records gives
                                                  [(key, record)] per batch, which every
                                                  rank's are gathered and sorted by key into
                                                  eval_metrics(records, split)
    loss_parts: dict[str, tensor]                 optional: the parts of the last loss(),
                                                  summed as it is (train/loss_NAME)
    checkpoint_meta() -> dict                     what a checkpoint must carry to be used
                                                  alone: class names; what its deploy module
                                                  reads (a tokenizer, the data's sizes)
    units: dict[str, int]                         optional: what a sample holds, for
                                                  throughput: perf/UNIT_per_s beside
                                                  perf/samples_per_s ({"tokens": 256})
    tally(batch) -> dict[str, number]             optional: what a batch of the loader holds
                                                  when samples differ ({"tokens": 3100,
                                                  "padding": 740}, on the host): perf/NAME_per_s
                                                  and each one's share (perf/padding_frac)

    deploy: str                                   optional: the dotted path of the task's
                                                  deploy module (below)

Export, serving and `labrun predict` read a checkpoint, never the task object: the trainer
records the task's `deploy` module in every checkpoint, and labrun.deploy imports it from there
(labrun.deploy.hooks lists its hooks: what the exported model takes and returns, its parity
check, its metadata, its HTTP routes, what `labrun predict` reads and writes). The built-in
tasks' deploy modules are labrun.tasks.classification, .lm and .segmentation: they sit above
labrun.deploy, which this module may not import (a served model has only its exported file and
metadata: no config, no task class, no training code). A task without `deploy` trains as any
other; `labrun export` refuses its runs in one line.

The task's config (conf/task/NAME.yaml) also sets checkpoint.monitor and checkpoint.mode: what
a run of it is judged by unless the command line says otherwise.

A lab adds one as a class like Classification and a conf/task/NAME.yaml naming it with
`_target_` (docs/plugins.md).

Why count() is a method of its own, asked of the loader's batch, and not a second value of
loss(): the divisor must be known before the first micro-batch's backward (the alternative,
rescaling the gradients after the step's backwards, would put summed losses through fp16's
loss scaling, where they overflow). Counting on the loader's batch costs no wait for the
device: a length, or a sum over a tensor still on the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig
    from torch import nn

# torch is imported where a method needs it, not here: config validation imports this module
# for metric_names alone (labrun.config.validation), in processes that never train (a sweep's
# launcher, `labrun configs check` and `review`), and torch's import costs them 3 s.


class Classification:
    """Images and integer labels: cross-entropy training; val/loss, val/acc (top-1) and
    val/acc5 (top-5). Batches arrive as uint8 NCHW images and int64 labels, and are turned
    into normalised floats (by the dataset's mean and std) on the device."""

    # The length of eval_sums' vector: a rank that gets no evaluation batch still all-reduces a
    # vector of this shape with the others (zeros), and an empty split still gives metrics.
    num_sums = 4
    # What eval_metrics reports for a split, each as SPLIT/NAME (val/acc). A class attribute:
    # labrun.config.validation checks checkpoint.monitor against it before any data loads,
    # without building the task.
    metric_names = ("loss", "acc", "acc5")
    units = {"images": 1}  # perf/images_per_s
    deploy = "labrun.tasks.classification"  # export, serving and predict (labrun.deploy.hooks)
    dense = False  # a label per image; Segmentation's are per pixel, its dataset's masks

    def __init__(self) -> None:
        self.class_names: list[str] = []
        self.normalize: Any = None
        self.memory_format: Any = None

    def build_model(self, model_cfg: DictConfig, info: dict[str, Any]) -> nn.Module:
        from labrun import models

        return models.build(model_cfg, len(info["class_names"]))

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """Refuse, before any data loads, folds of a dataset with a val split of its own, and
        fine-tuning keys that cannot work (starting weights missing or of another model,
        patterns that match no parameter: train/fine_tuning.py). The class count does not
        change a parameter's name, nor a tensor outside the head."""
        from labrun.core.errors import ConfigError
        from labrun.train import fine_tune_keys
        from labrun.train.detection_task import is_detection_dataset

        if is_detection_dataset(cfg.dataset):
            raise ConfigError(f"dataset {cfg.dataset.get('name')} holds boxes; train it with "
                              f"task=detection")
        if ("ignore_index" in cfg.dataset) != cls.dense:  # only datasets of masks have one
            raise ConfigError(
                f"task=segmentation needs a dataset of masks (dataset=shapes, segfolder, "
                f"seg_hdf5); dataset {cfg.dataset.get('name')} has a label per image"
                if cls.dense else
                f"dataset {cfg.dataset.get('name')} holds masks, a label per pixel; train it "
                f"with task=segmentation")
        # labrun.data and fine_tuning import torch, which a sweep's submitter (launch/sweep.plan
        # checks every job) loads only for a job that has folds or fine-tunes: 650 MB resident.
        if cfg.dataset.get("num_folds"):  # a format with a val split of its own takes no folds
            from labrun.data.image import check_folds

            check_folds(cfg.dataset)
        if fine_tune_keys.asked(cfg):
            from labrun.train import fine_tuning

            placeholder = {"class_names": ["a", "b"]}
            fine_tuning.check(cfg, lambda: cls().build_model(cfg.model, placeholder),
                              len(placeholder["class_names"]))

    def setup(self, info: dict[str, Any], device: torch.device,
              memory_format: torch.memory_format) -> None:
        import torch

        from labrun.data.image.transforms import BatchNormalizer

        self.class_names = list(info["class_names"])
        shape = (1, -1, 1, 1)
        # Each step is done with its batch before the next arrives: the buffer can be reused.
        self.normalize = BatchNormalizer(
            torch.tensor(list(info["mean"]), device=device).view(shape),
            torch.tensor(list(info["std"]), device=device).view(shape))
        self.memory_format = memory_format

    def prepare(self, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = batch
        non_blocking = device.type == "cuda"
        images = self.normalize(images.to(device, non_blocking=non_blocking))
        return (images.contiguous(memory_format=self.memory_format),
                labels.to(device, non_blocking=non_blocking))

    def count(self, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        return len(batch[1])  # a shape: known on the host, no wait for the device

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        import torch.nn.functional as F  # noqa: N812 - torch's own name for it

        images, labels = batch
        return F.cross_entropy(model(images), labels, reduction="sum")

    def eval_sums(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
                  ) -> torch.Tensor:
        """[summed loss, top-1 correct, top-5 correct, count] of one batch, as float32 (MPS
        has no float64); the caller adds them up in float64 on the CPU."""
        import torch
        import torch.nn.functional as F  # noqa: N812

        images, labels = batch
        logits = model(images).float()
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        hits = top.eq(labels[:, None])
        return torch.stack([
            F.cross_entropy(logits, labels, reduction="sum"),
            hits[:, 0].sum().float(),
            hits.any(dim=1).sum().float(),
            torch.tensor(float(len(labels)), device=logits.device),
        ])

    def eval_metrics(self, sums: torch.Tensor, split: str) -> dict[str, float]:
        loss, top1, top5, count = sums.tolist()
        count = max(count, 1.0)
        # Keyed by metric_names, so that what is declared is what is reported.
        values = (loss / count, top1 / count, top5 / count)
        return {f"{split}/{name}": value
                for name, value in zip(self.metric_names, values, strict=True)}

    def checkpoint_meta(self) -> dict[str, Any]:
        # Top-level in every checkpoint: export, serve and `labrun status` read it there.
        return {"class_names": self.class_names}


class Segmentation(Classification):
    """Images and masks (uint8 NCHW, uint8 NHW class indices): per-pixel cross-entropy, pixels
    of dataset.ignore_index not scored; val/loss (per scored pixel), val/miou (mean IoU over the
    classes present in the masks or the predictions) and val/pixel_acc. Mean IoU is not a
    per-batch average: eval_sums carries the confusion matrix, whose sums across batches and
    ranks are exact, and eval_metrics reads IoU off the total.

    The model gives logits N x classes x H x W, or torchvision's dict ({"out": ..., "aux": ...},
    the auxiliary head weighted 0.5 in the loss, as torchvision's reference recipe does)."""

    metric_names = ("loss", "miou", "pixel_acc")
    deploy = "labrun.tasks.segmentation"
    dense = True
    AUX_WEIGHT = 0.5

    def __init__(self) -> None:
        super().__init__()
        self.ignore_index = 255

    @property
    def num_sums(self) -> int:
        return 2 + len(self.class_names) ** 2  # summed loss, scored pixels, confusion matrix

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        from labrun.core.errors import ConfigError

        super().check_config(cfg)
        if not 0 <= cfg.dataset.ignore_index <= 255:
            raise ConfigError(f"dataset.ignore_index={cfg.dataset.ignore_index}: masks hold "
                              f"values 0..255; use one of them (255, Pascal VOC's void)")

    def setup(self, info: dict[str, Any], device: torch.device,
              memory_format: torch.memory_format) -> None:
        super().setup(info, device, memory_format)
        self.ignore_index = int(info["ignore_index"])

    def prepare(self, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
        images, masks = super().prepare(batch, device)
        return images, masks.long()  # uint8 on the way: an eighth of int64's bytes to copy

    def count(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return (batch[1] != self.ignore_index).sum()  # the scored pixels, on the host

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        import torch.nn.functional as F  # noqa: N812

        images, masks = batch
        outputs = model(images)
        if not isinstance(outputs, dict):
            return F.cross_entropy(outputs, masks, ignore_index=self.ignore_index,
                                   reduction="sum")
        loss = F.cross_entropy(outputs["out"], masks, ignore_index=self.ignore_index,
                               reduction="sum")
        if "aux" in outputs:
            loss = loss + self.AUX_WEIGHT * F.cross_entropy(
                outputs["aux"], masks, ignore_index=self.ignore_index, reduction="sum")
        return loss

    def eval_sums(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
                  ) -> torch.Tensor:
        """[summed loss, scored pixels, confusion matrix (true x predicted, flattened)]; float64
        where the device has it (counts stay exact beyond float32's 2**24)."""
        import torch
        import torch.nn.functional as F  # noqa: N812

        images, masks = batch
        logits = logits_of(model(images)).float()
        classes = logits.shape[1]
        scored = masks != self.ignore_index
        loss = F.cross_entropy(logits, masks, ignore_index=self.ignore_index, reduction="sum")
        pairs = masks[scored] * classes + logits.argmax(dim=1)[scored]
        confusion = torch.bincount(pairs, minlength=classes * classes)
        dtype = torch.float32 if logits.device.type == "mps" else torch.float64
        return torch.cat([torch.stack([loss.to(dtype), scored.sum().to(dtype)]),
                          confusion.to(dtype)])

    def eval_metrics(self, sums: torch.Tensor, split: str) -> dict[str, float]:
        loss, count = sums[:2].tolist()
        miou, pixel_acc = mean_iou(sums[2:].view(len(self.class_names), -1))
        values = (loss / max(count, 1.0), miou, pixel_acc)
        return {f"{split}/{name}": value
                for name, value in zip(self.metric_names, values, strict=True)}

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"task": "segmentation", "class_names": self.class_names,
                "ignore_index": self.ignore_index}


def logits_of(outputs: Any) -> torch.Tensor:
    """A segmentation model's logits: its output, or torchvision's dict's "out"."""
    return outputs["out"] if isinstance(outputs, dict) else outputs


def mean_iou(confusion: torch.Tensor) -> tuple[float, float]:
    """(mean IoU over the classes present in truth or prediction, pixel accuracy) of a
    confusion matrix, rows true and columns predicted (mmsegmentation's definition)."""
    confusion = confusion.double()
    hits = confusion.diagonal()
    union = confusion.sum(0) + confusion.sum(1) - hits
    present = union > 0
    miou = (hits[present] / union[present]).mean().item() if present.any() else 0.0
    return miou, (hits.sum() / confusion.sum().clamp(min=1)).item()


class LanguageModelling:
    """Next-token prediction on windows of token ids: a batch is (inputs, targets), both
    (batch, time) int64, the targets the inputs shifted by one; a target of IGNORE is not
    scored (padding). Cross-entropy summed over the scored tokens; val/loss (per token),
    val/ppl (exp of it: per byte with the bytes tokenizer) and val/acc (next token right)."""

    IGNORE = -1
    num_sums = 3  # summed loss, tokens predicted right, tokens scored
    metric_names = ("loss", "ppl", "acc")
    deploy = "labrun.tasks.lm"

    def __init__(self) -> None:
        self.tokenizer: dict[str, Any] = {}
        self.sizes: dict[str, int] = {}  # the data's vocab_size and block_size, once set up
        self.units: dict[str, int] = {}  # {"tokens": the window}, once set up

    def build_model(self, model_cfg: DictConfig, info: dict[str, Any]) -> nn.Module:
        """The model for the data's vocabulary and window (`info`: vocab_size, block_size)."""
        from labrun import models

        return models.build(model_cfg, vocab_size=info["vocab_size"],
                            block_size=info["block_size"])

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """Refuse, before any data loads, a token folder and model that cannot work together:
        the folder's tokens.json or .bin files missing or cut short, windows beyond the
        model's positions, a vocabulary beyond its embedding, and a model.init_from
        checkpoint of another tokenizer or other sizes (whose tensors would be left out)."""
        from labrun.core.errors import ConfigError, DataError
        from labrun.data import tokens
        from labrun.train import fine_tuning

        try:
            declared = tokens.declared(cfg.dataset)
        except DataError as error:
            raise ConfigError(str(error)) from None
        if declared is None:
            return  # not a token folder of labrun's: its own loader checks it
        window, vocab = cfg.dataset.block_size, declared["vocab_size"]
        positions, own_vocab = cfg.model.get("block_size"), cfg.model.get("vocab_size")
        if positions is not None and window > positions:
            raise ConfigError(f"dataset.block_size={window} is beyond model.block_size="
                              f"{positions}, the positions the model knows; use "
                              f"dataset.block_size<={positions} or a larger model.block_size")
        if own_vocab is not None and own_vocab < vocab:
            raise ConfigError(f"model.vocab_size={own_vocab} is below the token folder's "
                              f"vocabulary of {vocab:,}: its larger ids have no embedding; "
                              f"set model.vocab_size={vocab} (or more), or null")
        if cfg.model.get("init_from"):
            cls._check_init_from(cfg, declared)
        # The model this run would build, against the starting weights (a tensor of another
        # vocabulary, window or size would not load) and the fine-tuning patterns.
        sizes = {"vocab_size": vocab, "block_size": window}
        fine_tuning.check(cfg, lambda: cls().build_model(cfg.model, sizes), None)

    @classmethod
    def _check_init_from(cls, cfg: DictConfig, declared: dict[str, Any]) -> None:
        from labrun.core.errors import ConfigError
        from labrun.train.checkpoint import CheckpointError
        from labrun.train.checkpoint import load as load_checkpoint

        path = cfg.model.init_from
        try:
            state = load_checkpoint(path)
        except CheckpointError:
            return  # not a labrun checkpoint: a state dict has no tokenizer to compare
        theirs, ours = state.get("tokenizer") or {}, declared["tokenizer"]
        if theirs and (theirs.get("kind"), theirs.get("sha256")) != (ours.get("kind"),
                                                                     ours.get("sha256")):
            raise ConfigError(
                f"model.init_from={path} was trained with another tokenizer "
                f"({_tokenizer_name(theirs)}) than the token folder's ({_tokenizer_name(ours)})"
                f": its token ids mean other text; convert the text with its tokenizer")

    def setup(self, info: dict[str, Any], device: torch.device,
              memory_format: torch.memory_format) -> None:
        self.tokenizer = dict(info.get("tokenizer", {}))
        # The data's sizes, not the model's (a vocabulary padded with ids that stand for no
        # text, positions beyond the window it trained on): serving samples within them.
        self.sizes = {"vocab_size": int(info["vocab_size"]), "block_size": int(info["block_size"])}
        self.units = {"tokens": int(info["block_size"])}  # perf/tokens_per_s

    def prepare(self, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
        non_blocking = device.type == "cuda"
        return tuple(t.to(device, non_blocking=non_blocking) for t in batch)

    def count(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # The scored tokens differ between batches and ranks (padding): a tensor, summed by
        # the Trainer across ranks; on the loader's batch, still on the host.
        return (batch[1] != self.IGNORE).sum()

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        import torch.nn.functional as F  # noqa: N812

        inputs, targets = batch
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=self.IGNORE, reduction="sum")

    def eval_sums(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
                  ) -> torch.Tensor:
        import torch
        import torch.nn.functional as F  # noqa: N812

        inputs, targets = batch
        logits = model(inputs).float()
        scored = targets != self.IGNORE
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=self.IGNORE, reduction="sum")
        right = (logits.argmax(dim=-1).eq(targets) & scored).sum().float()
        return torch.stack([loss, right, scored.sum().float()])

    def eval_metrics(self, sums: torch.Tensor, split: str) -> dict[str, float]:
        import math

        loss, right, count = sums.tolist()
        count = max(count, 1.0)
        values = (loss / count, math.exp(min(loss / count, 700.0)), right / count)
        return {f"{split}/{name}": value
                for name, value in zip(self.metric_names, values, strict=True)}

    def checkpoint_meta(self) -> dict[str, Any]:
        # class_names stays (empty): status reads it at the top level. The rest is what export
        # and serving need with the checkpoint alone: the model's sizes (build_model's info)
        # and the tokenizer, a `tokenizers` file's JSON text included (data.tokens.tokenizer_info).
        return {"task": "lm", "class_names": [], **self.sizes, "tokenizer": self.tokenizer}


def _tokenizer_name(tokenizer: dict[str, Any]) -> str:
    digest = tokenizer.get("sha256")
    return f"{tokenizer.get('kind')}, sha256 {digest[:12]}" if digest else str(tokenizer.get("kind"))
