"""An object detector's life after training (the deploy hooks, labrun.deploy.hooks, of
labrun.train.detection_task.Detection): what its export takes and returns, how it is served and
predicted.

    export   export_plan     images in, detections out, with the model's box decoding and
                             non-maximum suppression inside the graph (FCOSGraph)
             input           float32 B x 3 x S x S in [0, 1] (uint8 RGB / 255), each image
                             letterboxed as validation made it: scaled so that its long side is
                             S = image_size (aspect kept, antialiased bilinear) and centred on an
                             S x S canvas of gray pad_value (114); the batch B is dynamic
             output          "detections", float32 D x 7, a row per detection of the whole
                             batch: (image, x1, y1, x2, y2, score, label), image the row's index
                             in the batch, the box in the S x S input's pixels, label counting
                             from 1 (torchvision's 0 is the background), each image's rows by
                             score, highest first, at most detections_per_image of them
             parity          the exported file in its runtime against the eager detector (its
                             own forward, as evaluation runs it) on the run's val images, at the
                             whole batch and at a batch of one: each detection matched by a box
                             of IoU >= MIN_IOU, the same class and a score within
                             SCORE_TOLERANCE (module constants)
             metadata        class names, image_size, pad_value, score and NMS thresholds,
                             detections_per_image, the input's and output's description, decoder
    serving  Detector        the exported file in its runtime: image bytes in, letterboxed
                             exactly as validation does, boxes out in the image's OWN pixels
                             (the letterbox undone: its offsets taken off, its scale divided out)
             add_routes      POST /predict?score_threshold=&max_detections= (multipart field
                             `file`) -> {"boxes": [[x1, y1, x2, y2], ...], "labels": [names],
                             "label_ids": [class indices], "scores": [...]}; /predict/batch
                             (fields `files`): one such answer per file, with its filename
    predict  IMAGE_OR_DIR... --out DIR: DIR/<stem>.json (the answer, with the image's size) and
             DIR/<stem>_overlay.png (the boxes drawn with their class names and scores) of each
             image, and a line `path  N boxes: class score ...`

Why the whole batch goes through one graph: torchvision's own postprocessing loops over the
images in Python, which a trace unrolls into a graph of the example's batch size only. FCOSGraph
does the same steps as FCOS.postprocess_detections for the whole batch at once (per level: the
scores, the top candidates, decoding, clipping; then one NMS over every image and class, kept
apart by offsetting each (image, class)'s boxes, as torchvision's batched_nms offsets each class),
so the batch axis stays dynamic and `labrun serve`'s batcher gives concurrent requests one model
call. Only FCOS detectors export (model=fcos, or model=torchvision_det with name=
fcos_resnet50_fpn); the other torchvision detectors are refused with a message saying so.

ONNX goes through the legacy (TorchScript-based) exporter first, the path torchvision documents
for its detectors (opset >= 11: its NMS is registered as ONNX's NonMaxSuppression), and the
dynamo exporter when it fails: both pass the parity check exactly alike (experiment=det_shapes'
FCOS, 16 val images: every detection matched, scores within 6e-7), and the legacy one exports in
half the time (11 s against 22 s on a loaded 2-core machine). TorchScript traces the same graph
(loading it needs torchvision's ops, which Detector imports).

The package: graph.py (FCOSGraph and its output's rows), export.py (the plan, the metadata and
the parity check), serving.py (Detector, the routes, labrun predict).
"""

from __future__ import annotations

from labrun.tasks.detection.export import export_plan
from labrun.tasks.detection.graph import TASK
from labrun.tasks.detection.serving import (
           add_routes,
           describe,
           health,
           load,
           predict,
           predict_arguments,
)

__all__ = ["REQUIRED_KEYS", "TASK", "USAGE", "add_routes", "describe", "export_plan", "health",
           "load", "predict", "predict_arguments"]

REQUIRED_KEYS = ("class_names", "image_size", "pad_value", "score_threshold",
                 "detections_per_image")
USAGE = ("POST /predict?score_threshold=&max_detections= with multipart field 'file' "
         "(POST /predict/batch: fields 'files'), for boxes")
