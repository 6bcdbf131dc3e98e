"""data/raw -> data/processed/{{package}}.npz (`make preprocess`, `python -m {{package}}.preprocess`).

data/raw is read-only by convention: this reads it and never writes there. It expects one folder
per class of images (data/raw/cat/1.jpg, data/raw/dog/2.png...). Until the project's data is
there, scikit-learn's bundled digits stand in for it, so that `make train` runs on day one."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image

RAW, PROCESSED = Path("data/raw"), Path("data/processed/{{package}}.npz")
SIZE = 32  # pixels a side: conf/dataset/{{package}}.yaml's image_size crops within it
SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp"}


def from_folders(raw: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    classes = sorted(p.name for p in raw.iterdir() if p.is_dir())
    images, labels = [], []
    for label, name in enumerate(classes):
        for path in sorted((raw / name).rglob("*")):
            if path.suffix.lower() in SUFFIXES:
                with Image.open(path) as image:
                    images.append(np.asarray(image.convert("RGB").resize((SIZE, SIZE))))
                labels.append(label)
    return np.stack(images), np.array(labels), classes


def stand_in() -> tuple[np.ndarray, np.ndarray, list[str]]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    gray = (digits.images * (255 / 16)).astype(np.uint8)
    images = [np.asarray(Image.fromarray(im).resize((SIZE, SIZE)).convert("RGB")) for im in gray]
    return np.stack(images), digits.target, [str(d) for d in range(10)]


def main() -> int:
    has_data = RAW.is_dir() and any(p.is_dir() for p in RAW.iterdir())
    if not has_data:
        print(f"{RAW} holds no class folders yet: scikit-learn's digits stand in for the data",
              file=sys.stderr)
    images, labels, classes = from_folders(RAW) if has_data else stand_in()
    PROCESSED.parent.mkdir(parents=True, exist_ok=True)
    np.savez(PROCESSED, images=images, labels=labels, class_names=np.array(classes))
    print(f"{len(labels)} images of {len(classes)} classes -> {PROCESSED}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
