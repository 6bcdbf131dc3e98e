"""The dataset/ group's schemas: what a dataset section holds, by kind of data (images,
images with masks, images with boxes, tokens). Their own module for length; config/schema.py registers them with
the others (SCHEMAS), and the two read as one table of every key labrun takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import MISSING

from labrun.config.fields import NewKeys, key

# Which library decodes JPEG files (data/image/decode.py); every other format goes to Pillow.
DECODERS = ("turbojpeg", "pil", "torchvision")


def decoder_key() -> Any:
    return key("turbojpeg", choices=DECODERS)


@dataclass
class AugmentConfig:
    crop_scale: list[float] = field(default_factory=lambda: [0.08, 1.0])  # RandomResizedCrop
    crop_ratio: list[float] = field(default_factory=lambda: [3 / 4, 4 / 3])
    hflip: bool = True
    val_resize_ratio: float = 0.875  # val: resize to image_size / ratio, then center-crop


@dataclass
class ImageDatasetConfig:
    """What an image format's section holds (labrun.data.image): its loader's keys, and the
    size, decoding, augmentation and normalisation labrun applies to every image format. A
    dataset of another kind has a schema of its own (TokensConfig)."""
    new_keys: ClassVar[NewKeys] = NewKeys.TARGET  # those its loader takes

    _target_: str = MISSING  # the format's loader: a function returning {split: ImageSource}
    name: str = MISSING
    image_size: int = 224
    num_workers: int = key(2, resume_safe=True, affects_result=False)  # samples are seeded per index
    # Where JPEGs are decoded: in the workers, or (cpu, cuda) in whole batches in the main
    # process (data/image/batched.py). Same crops and flips; pixels differ slightly (DCT scaling,
    # nvJPEG's rounding): a result change, but a run may resume on a machine with another.
    decode: str = key("workers", resume_safe=True, choices=("workers", "cpu", "cuda"))
    val_fraction: float = 0.1  # held out of train when the data has no val split
    # k-fold cross-validation of a dataset without a val split of its own: train on K-1 folds,
    # validate on fold `fold` (data/image/sources.py, folds); val_fraction is then ignored.
    num_folds: int | None = None
    fold: int | None = None
    split_seed: int = 0  # seeds the held-out val split and the folds (0: as always)
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    augment: AugmentConfig = key(factory=AugmentConfig)


@dataclass
class DigitsConfig(ImageDatasetConfig):
    pass


@dataclass
class SyntheticConfig(ImageDatasetConfig):
    num_classes: int = 10
    num_train: int = 1024
    num_val: int = 256
    num_test: int = 0  # > 0 adds a test split


@dataclass
class ImageFolderConfig(ImageDatasetConfig):
    root: str = key(MISSING, must_exist=True, resume_safe=True)  # the folder may move
    decoder: str = decoder_key()


@dataclass
class HDF5Config(ImageDatasetConfig):
    path: str = key(MISSING, must_exist=True, resume_safe=True)  # the file may move
    decoder: str = decoder_key()


@dataclass
class CIFAR10Config(ImageDatasetConfig):
    root: str = key(MISSING, must_exist=True, resume_safe=True)
    download: bool = key(True, affects_result=False)


@dataclass
class SegmentationDatasetConfig(ImageDatasetConfig):
    """An image format whose labels are masks (labrun.data.segmentation): its images and masks
    are cropped, flipped and resized together (masks by nearest neighbour)."""
    ignore_index: int = 255  # a mask value not scored (Pascal VOC's void)
    # fixed: val and test images resized to image_size x image_size; full: at their own size
    # (one image per batch when sizes differ: trainer.batch_size must then be 1 for eval).
    eval_size: str = key("fixed", choices=("fixed", "full"))


@dataclass
class ShapesConfig(SegmentationDatasetConfig):
    num_train: int = 512
    num_val: int = 128
    num_test: int = 0


@dataclass
class SegFolderConfig(SegmentationDatasetConfig):
    root: str = key(MISSING, must_exist=True, resume_safe=True)  # the folder may move
    decoder: str = decoder_key()
    num_classes: int | None = None  # required without ROOT/classes.txt


@dataclass
class SegHDF5Config(SegmentationDatasetConfig):
    path: str = key(MISSING, must_exist=True, resume_safe=True)  # the file may move
    decoder: str = decoder_key()


# -- detection: dataset=det_hdf5 (data/detection/hdf5.py) ---------------------------------------
# Only what its loader and the pipeline read; to become a DetectionDatasetConfig (its augment
# keys) once that schema lands.


@dataclass
class DetectionAugmentConfig:
    """Training's augmentation of detection (data/detection/transforms.py); eval only
    letterboxes."""
    hflip: bool = True
    # The letterbox scale times a random factor of this range, then a random window of
    # image_size x image_size; also the zoom of a mosaic's four images.
    scale: list[float] = field(default_factory=lambda: [0.5, 1.5])
    min_visible: float = 0.4  # a box cut to less of its area than this is dropped
    # Colour jitter: random factors of [1 - x, 1 + x]; hue: a fraction of the colour wheel.
    # 0 turns one off.
    brightness: float = 0.3
    contrast: float = 0.3
    saturation: float = 0.5
    hue: float = 0.015
    mosaic: float = 1.0  # the probability of a mosaic of four images (0: never)
    # Mosaic off for the last close_mosaic epochs (as YOLO): the epoch is fixed when a run
    # starts and carried by its checkpoint (DetectionData.start, state_dict).
    close_mosaic: int = 10


@dataclass
class DetectionDatasetConfig:
    """A detection format's section (labrun.data.detection): images with boxes, letterboxed to
    image_size x image_size; its own keys, none of classification's crop or normalisation."""
    new_keys: ClassVar[NewKeys] = NewKeys.TARGET  # those its loader takes

    _target_: str = MISSING  # the format's loader: {split: source with boxes = True}
    name: str = MISSING
    image_size: int = 640  # the side of the square images a batch holds
    num_workers: int = key(2, resume_safe=True, affects_result=False)  # samples are seeded per index
    val_fraction: float = 0.1  # held out of train when the data has no val split
    split_seed: int = 0  # seeds the held-out val split
    augment: DetectionAugmentConfig = key(factory=DetectionAugmentConfig)


@dataclass
class ShapesBoxesConfig(DetectionDatasetConfig):
    image_size: int = 128
    num_train: int = 400
    num_val: int = 100
    num_test: int = 0


@dataclass
class COCOConfig(DetectionDatasetConfig):
    root: str = key(MISSING, must_exist=True, resume_safe=True)  # the folder may move
    decoder: str = decoder_key()


@dataclass
class YOLOConfig(DetectionDatasetConfig):
    data: str = key(MISSING, must_exist=True, resume_safe=True)  # data.yaml; it may move
    decoder: str = decoder_key()


@dataclass
class DetHDF5Config(DetectionDatasetConfig):
    """A det_hdf5 file of `labrun convert det` (data/detection/hdf5.py)."""

    path: str = key(MISSING, must_exist=True, resume_safe=True)  # the file may move
    decoder: str = decoder_key()


@dataclass
class TokensConfig:
    """A token folder of `labrun convert text` (data/tokens.py): its own keys, none of the
    image datasets'."""
    new_keys: ClassVar[NewKeys] = NewKeys.TARGET

    _target_: str = MISSING  # labrun.data.tokens.load
    name: str = MISSING
    path: str = key(MISSING, must_exist=True, resume_safe=True)  # the folder may move
    block_size: int = 256  # tokens per window: the model's positions
    num_workers: int = key(0, resume_safe=True, affects_result=False)  # windows are seeded per index


@dataclass
class PythonDocsConfig:
    """CPython's own documentation text as tokens, converted on first use into `folder`
    (tokens.python_docs), which need not exist yet."""
    new_keys: ClassVar[NewKeys] = NewKeys.TARGET

    _target_: str = MISSING  # labrun.data.tokens.python_docs
    name: str = MISSING
    folder: str = key(MISSING, path=True, resume_safe=True, affects_result=False)
    block_size: int = 256
    num_workers: int = key(0, resume_safe=True, affects_result=False)


@dataclass
class TextConfig:
    """Labelled text for task=text_classification (data/text/): CSV, JSONL or Parquet files,
    or a folder saved by Hugging Face `datasets`; tokenized once by the model's tokenizer into a
    token cache."""
    new_keys: ClassVar[NewKeys] = NewKeys.TARGET

    _target_: str = MISSING  # labrun.data.text.load
    name: str = MISSING
    # A file (the train split; val held out by val_fraction), or a folder of train/val/test
    # files (.csv, .jsonl, .parquet) or of `datasets.save_to_disk`.
    path: str = key(MISSING, must_exist=True, resume_safe=True)
    text_column: str = "text"
    text_pair_column: str | None = None  # a second text: sentence pairs (NLI, paraphrase)
    label_column: str = "label"
    # The label names in id order; null: the train split's labels, sorted.
    class_names: list[str] | None = None
    val_fraction: float = 0.1  # held out of train when there is no val split
    max_length: int = 128  # tokens, special ones included; longer texts are truncated
    # The tokenizer: the snapshot of this model in the weights cache (model=hf's: model.name).
    tokenizer: str | None = None
    revision: str | None = None
    weights_cache: str | None = key(None, path=True, resume_safe=True, affects_result=False)
    length_grouped: bool = True  # batches of texts of similar length: less padding
    pad_to_multiple_of: int = 1  # a batch's length rounded up to it (8 under AMP: text.yaml)
    cache_dir: str = key(MISSING, path=True, resume_safe=True, affects_result=False)
    num_workers: int = key(0, resume_safe=True, affects_result=False)
