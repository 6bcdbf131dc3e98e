"""task=detection (train/task.py's protocol, its own module for length): images and a
varying number of boxes each, a detector's own losses, and COCO's mAP of the whole split."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig
    from torch import nn


class Detection:
    """Images and their boxes: a detector that computes its own losses in training mode
    (torchvision's answer a dict of them) and answers boxes, labels and scores in eval mode.
    Batches arrive as uint8 NCHW images, all of dataset.image_size, and a list of targets, one
    dict per image: boxes (float32 [N, 4] x1 y1 x2 y2 in the batch's pixels), labels (class
    indices), crowd (bool: COCO's crowd regions, in eval targets only) and image_id (the
    image's index in its split).

    The model normalises its input itself (torchvision's detectors carry their mean and std):
    prepare() only scales to [0, 1]. Class indices are shifted by one on the way in and out:
    torchvision's detectors keep label 0 for the background.

    The loss is the sum of the model's losses, each a mean over the micro-batch, times the
    micro-batch's images: the Trainer divides by the step's images, so accumulation weighs each
    micro-batch by its images. Each loss is logged on its own (train/loss_classifier, ...).

    mAP is no per-batch sum: validation keeps every image's detections (eval_records), the
    Trainer gathers them from every rank in image order, and eval_metrics scores the whole
    split with COCOeval's rules (train/coco_map.py): val/map (mAP@[.5:.95], the monitor),
    val/map_50 and val/ap/CLASS."""

    gathers = True  # eval_records, not eval_sums (train/evaluation.py)
    num_sums = 0
    metric_names = ("map", "map_50")
    units = {"images": 1}
    deploy = "labrun.tasks.detection"  # export, serving and predict (labrun.deploy.hooks)

    def __init__(self) -> None:
        self.class_names: list[str] = []
        self.memory_format: Any = None
        self.loss_parts: dict[str, torch.Tensor] = {}  # the last loss()'s parts, as it sums them
        self.evaluator = ""  # "faster-coco-eval 1.8.0": which scored the last evaluation

    def build_model(self, model_cfg: DictConfig, info: dict[str, Any]) -> nn.Module:
        from labrun import models

        return models.build(model_cfg, len(info["class_names"]), image_size=info["image_size"])

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        from labrun.core.errors import ConfigError
        from labrun.models import detection
        from labrun.train import fine_tune_keys

        detection.check(cfg.model)
        if not is_detection_dataset(cfg.dataset):
            raise ConfigError(f"task=detection needs a dataset of boxes (dataset=coco, yolo, "
                              f"shapes_boxes, det_hdf5); dataset {cfg.dataset.get('name')} has "
                              f"{'masks' if 'ignore_index' in cfg.dataset else 'a label per image'}")
        if fine_tune_keys.asked(cfg):  # as Classification checks them: fine_tuning.py
            from labrun.train import fine_tuning

            info = {"class_names": ["a", "b"], "image_size": cfg.dataset.image_size}
            fine_tuning.check(cfg, lambda: cls().build_model(cfg.model, info),
                              len(info["class_names"]))

    def setup(self, info: dict[str, Any], device: torch.device,
              memory_format: torch.memory_format) -> None:
        self.class_names = list(info["class_names"])
        self.memory_format = memory_format

    def prepare(self, batch: tuple[torch.Tensor, list[dict[str, Any]]], device: torch.device
                ) -> tuple[torch.Tensor, list[dict[str, Any]]]:
        images, targets = batch
        non_blocking = device.type == "cuda"
        images = images.to(device, non_blocking=non_blocking).float().div_(255)
        moved = [{"boxes": target["boxes"].to(device, non_blocking=non_blocking),
                  "labels": target["labels"].to(device, non_blocking=non_blocking) + 1,
                  "crowd": target["crowd"], "image_id": target["image_id"]}
                 for target in targets]
        return images.contiguous(memory_format=self.memory_format), moved

    def count(self, batch: tuple[torch.Tensor, list[dict[str, Any]]]) -> int:
        return len(batch[1])  # images

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, list[dict[str, Any]]]
             ) -> torch.Tensor:
        images, targets = batch
        losses = model(images, [{"boxes": t["boxes"], "labels": t["labels"]} for t in targets])
        scale = float(len(targets))
        self.loss_parts = {name: value.detach() * scale for name, value in losses.items()}
        return sum(losses.values()) * scale

    def eval_records(self, model: nn.Module, batch: tuple[torch.Tensor, list[dict[str, Any]]]
                     ) -> list[tuple[int, dict[str, Any]]]:
        """(image_id, {truth and detections as numpy}) of each image: on the host, where
        COCOeval ranks them (a wait for the device per batch, as every detector's evaluation)."""
        images, targets = batch
        found = model(images)
        records = []
        for target, answer in zip(targets, found, strict=True):
            records.append((int(target["image_id"]), {
                "boxes": target["boxes"].cpu().numpy(),
                "labels": target["labels"].cpu().numpy() - 1,
                "crowd": target["crowd"].cpu().numpy(),
                "found_boxes": answer["boxes"].float().cpu().numpy(),
                "found_labels": answer["labels"].cpu().numpy() - 1,
                "found_scores": answer["scores"].float().cpu().numpy(),
                "size": tuple(images.shape[-2:])}))
        return records

    def eval_metrics(self, records: list[tuple[int, dict[str, Any]]], split: str
                     ) -> dict[str, float]:
        from labrun.data.detection import DetectionItem
        from labrun.data.detection.boxes import Objects
        from labrun.train.coco_map import Detections, coco_map

        items, detections = [], []
        for image_id, record in records:
            height, width = record["size"]
            items.append(DetectionItem(path=None, width=width, height=height, image_id=image_id,
                                       objects=Objects(record["boxes"], record["labels"],
                                                       record["crowd"])))
            detections.append(Detections(record["found_boxes"], record["found_labels"],
                                         record["found_scores"]))
        figures = coco_map(items, detections, self.class_names)
        self.evaluator = f"{figures.pop('evaluator')} {figures.pop('evaluator_version')}"
        return {f"{split}/{name}": float(value) for name, value in figures.items()}

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"task": "detection", "class_names": self.class_names,
                "map_evaluator": self.evaluator}


def is_detection_dataset(dataset: DictConfig) -> bool:
    """Whether a dataset section holds boxes: the detection formats' schema has close_mosaic."""
    augment = dataset.get("augment") or {}
    return "close_mosaic" in augment
