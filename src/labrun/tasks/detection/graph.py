"""What an exported detector computes and answers: FCOSGraph (the detector with its box
decoding and non-maximum suppression, for a whole batch) and its D x 7 output's rows, read back
as each image's detections (Found)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

from labrun.core.errors import LabrunError

TASK = "detection"
OUTPUT = "detections"
COLUMNS = ("image", "x1", "y1", "x2", "y2", "score", "label")


class FCOSGraph(torch.nn.Module):
    """torchvision's FCOS in eval mode, for a batch of S x S images in [0, 1], as one graph:
    its normalisation, padding to its size_divisible, backbone and head, then its
    postprocess_detections for the whole batch at once (module docstring), answering the
    D x 7 detections (COLUMNS). Its anchors depend on S alone: made once, here."""

    def __init__(self, model: torch.nn.Module, image_size: int):
        super().__init__()
        from torchvision.models.detection.image_list import ImageList

        transform = model.transform
        if (transform.fixed_size is not None or tuple(transform.min_size) != (image_size,)
                or transform.max_size != image_size):
            raise LabrunError(f"the detector resizes its input (min_size {transform.min_size}, "
                              f"max_size {transform.max_size}) where the data's images are "
                              f"{image_size} px: export takes detectors built at "
                              f"dataset.image_size, as model=fcos is")
        self.model = model
        self.size = image_size
        divisible = int(transform.size_divisible)
        padded = -(-image_size // divisible) * divisible
        self.pad = padded - image_size  # bottom and right, as torchvision's batch_images pads
        self.register_buffer("mean", torch.tensor(transform.image_mean).view(1, -1, 1, 1),
                             persistent=False)
        self.register_buffer("std", torch.tensor(transform.image_std).view(1, -1, 1, 1),
                             persistent=False)
        with torch.no_grad():
            blank = torch.zeros(1, 3, padded, padded)
            features = list(model.backbone(blank).values())
            anchors = model.anchor_generator(ImageList(blank, [(image_size, image_size)]),
                                             features)[0]
        self.register_buffer("anchors", anchors, persistent=False)
        self.level_sizes = [f.shape[2] * f.shape[3] for f in features]  # one anchor a place
        self.num_classes = int(model.head.classification_head.num_classes)  # with background
        self.score_threshold = float(model.score_thresh)
        self.nms_threshold = float(model.nms_thresh)
        self.detections_per_image = int(model.detections_per_img)
        self.candidates = int(model.topk_candidates)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        import torchvision
        from torchvision.ops import boxes as box_ops

        model, classes = self.model, self.num_classes
        x = (images - self.mean) / self.std
        if self.pad:
            x = F.pad(x, (0, self.pad, 0, self.pad))
        head = model.head(list(model.backbone(x).values()))
        logits, regression, centerness = (head["cls_logits"], head["bbox_regression"],
                                          head["bbox_ctrness"])
        boxes, scores, labels = [], [], []
        start = 0
        for places in self.level_sizes:
            end = start + places
            # As postprocess_detections: each (place, class)'s score, flattened place-major.
            level = torch.sqrt(torch.sigmoid(logits[:, start:end])
                               * torch.sigmoid(centerness[:, start:end])).flatten(1)
            # Its top candidates, then those above the threshold (below): the same set as
            # torchvision's top candidates among those above it.
            top, index = level.topk(min(self.candidates, places * classes), dim=1)
            place = torch.div(index, classes, rounding_mode="floor")
            codes = regression[:, start:end].gather(1, place.unsqueeze(-1).expand(-1, -1, 4))
            decoded = model.box_coder.decode(codes, self.anchors[start:end][place])
            boxes.append(box_ops.clip_boxes_to_image(decoded, (self.size, self.size)))
            scores.append(top)
            labels.append(index % classes)
            start = end
        boxes, scores, labels = torch.cat(boxes, 1), torch.cat(scores, 1), torch.cat(labels, 1)
        image = torch.ones_like(labels).cumsum(0) - 1  # each candidate's image in the batch
        boxes, scores = boxes.reshape(-1, 4), scores.reshape(-1)
        labels, image = labels.reshape(-1), image.reshape(-1)
        keep = torch.where(scores > self.score_threshold)[0]
        boxes, scores, labels, image = boxes[keep], scores[keep], labels[keep], image[keep]
        # One NMS for every image and class: each (image, class) apart from the others by an
        # offset larger than any box (boxes lie within 0..S), as batched_nms keeps classes apart.
        offsets = (image * classes + labels).to(boxes.dtype) * (self.size + 1)
        kept = torchvision.ops.nms(boxes + offsets[:, None], scores, self.nms_threshold)
        # Kept by score, highest first: each image's first detections_per_image of them.
        image = image[kept]
        batch = torch.ones_like(images[:, 0, 0, 0], dtype=torch.int64).cumsum(0) - 1
        mine = (image[:, None] == batch[None, :]).to(torch.int64)  # D x B
        rank = (mine.cumsum(0) * mine).sum(1) - 1  # the row's place among its image's rows
        within = torch.where(rank < self.detections_per_image)[0]
        kept, image = kept[within], image[within]
        return torch.cat([image.to(boxes.dtype)[:, None], boxes[kept], scores[kept][:, None],
                          labels[kept].to(boxes.dtype)[:, None]], 1)

    def eager(self, images: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """The detector's own eager answer for the batch: what evaluation scores."""
        return self.model(images)


def graph_of(model: torch.nn.Module, image_size: int, name: str) -> FCOSGraph:
    from torchvision.models.detection import FCOS

    if not isinstance(model, FCOS):
        raise LabrunError(f"{name} ({type(model).__name__}) has no export with its decoding "
                          f"and NMS in the graph yet: FCOS detectors export (model=fcos, or "
                          f"model=torchvision_det model.name=fcos_resnet50_fpn)")
    return FCOSGraph(model, image_size)


class Found(NamedTuple):
    """One image's detections: boxes N x 4, scores N, labels N (1-based), by score."""

    boxes: torch.Tensor
    scores: torch.Tensor
    labels: torch.Tensor


def split_rows(rows: np.ndarray | torch.Tensor, count: int) -> list[Found]:
    """The output's rows (COLUMNS) as each of `count` images' detections, in order."""
    rows = torch.as_tensor(np.asarray(rows, dtype=np.float32)).reshape(-1, len(COLUMNS))
    image = rows[:, 0].round().long()
    return [Found(rows[image == i, 1:5], rows[image == i, 5], rows[image == i, 6].round().long())
            for i in range(count)]
