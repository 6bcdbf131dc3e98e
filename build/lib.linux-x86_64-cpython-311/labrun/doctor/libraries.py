"""Python, the frameworks and the libraries the data pipeline needs, each doing real work."""

from __future__ import annotations

import importlib.metadata
import platform
import sys
import tempfile
from pathlib import Path

from labrun.core.errors import one_line
from labrun.doctor.report import FAILED, OK, WARNING, Check


def check_python() -> Check:
    from packaging.specifiers import SpecifierSet

    try:
        needed = importlib.metadata.metadata("labrun")["Requires-Python"] or ">=3.10"
    except importlib.metadata.PackageNotFoundError:
        needed = ">=3.10"
    version = platform.python_version()
    detail = f"{version} ({sys.executable})"
    if version in SpecifierSet(needed):
        return Check("python", OK, detail)
    return Check("python", FAILED, f"{detail}; labrun needs {needed}",
                 f"create the .venv with a Python {needed}")


def check_torch() -> Check:
    import torch

    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    a, b = torch.randn(256, 256, dtype=torch.float64), torch.randn(256, 256, dtype=torch.float64)
    torch.testing.assert_close((a.float() @ b.float()).double(), a @ b, rtol=1e-4, atol=1e-4)
    return Check("torch", OK, f"{torch.__version__} ({build}), CPU matmul ok, "
                              f"{torch.get_num_threads()} threads")


def check_torchvision() -> Check:
    import torch
    import torchvision

    # The compiled operators fail here when torchvision was built for another torch.
    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 10.0, 10.0]])
    kept = torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8]), 0.5)
    if kept.tolist() != [0]:
        return Check("torchvision", FAILED, f"{torchvision.__version__}: nms gave {kept}",
                     "reinstall the pinned torch/torchvision pair: pip install -e .")
    return Check("torchvision", OK, f"{torchvision.__version__}, compiled ops ok")


def check_turbojpeg() -> Check:
    import numpy as np

    fix = "apt install libturbojpeg0 (Debian/Ubuntu); until then the data pipeline uses Pillow"
    try:
        from turbojpeg import TurboJPEG
        jpeg = TurboJPEG()
    except Exception as error:  # noqa: BLE001 - import or library load, both mean "missing"
        return Check("turbojpeg", WARNING, f"libturbojpeg does not load: {one_line(error)}",
                     fix)
    image = np.tile(np.arange(64, dtype=np.uint8)[:, None, None] * 4, (1, 64, 3))
    decoded = jpeg.decode(jpeg.encode(image, quality=95))
    if decoded.shape != image.shape or np.abs(decoded.astype(int) - image).max() > 16:
        return Check("turbojpeg", FAILED, "encode/decode round trip is wrong", fix)
    return Check("turbojpeg", OK, "libturbojpeg loads, JPEG round trip ok")


def check_jpeg_regions() -> Check:
    """The compiled decoder that decodes only a training crop (labrun/data/image/_jpeg_region.c)."""
    import numpy as np

    from labrun.data.image import decode

    if decode._decode_region is None:
        return Check("jpeg regions", WARNING, "labrun's JPEG region decoder is not compiled: "
                     "training decodes whole images (slower)",
                     "apt install libjpeg62-turbo-dev gcc, then pip install -e . again")
    if decode.turbojpeg_error() is not None:
        return Check("jpeg regions", WARNING, "compiled, unused without libturbojpeg",
                     "apt install libturbojpeg0")
    image = np.tile(np.arange(96, dtype=np.uint8)[:, None, None] * 2, (1, 80, 3))
    data = decode.encode_jpeg(image, quality=95)
    full = decode.decode(data, "turbojpeg")
    if not np.array_equal(decode.decode_region(data, 30, 20, 40, 50), full[30:70, 20:70]):
        return Check("jpeg regions", FAILED, "a decoded region differs from the full decode",
                     "pip install -e . again, against this machine's libjpeg-turbo")
    return Check("jpeg regions", OK, "compiled; a decoded region equals the full decode")


def check_mask_rows() -> Check:
    """The compiled decoder of a mask's top rows (labrun/data/segmentation/_png_rows.c)."""
    import numpy as np

    from labrun.data.segmentation import masks

    if masks._decode_rows is None:
        return Check("mask rows", WARNING, "labrun's mask row decoder is not compiled: "
                     "segmentation decodes whole masks with Pillow (slower)",
                     "apt install libpng-dev gcc, then pip install -e . again")
    mask = (np.arange(40 * 30).reshape(40, 30) % 7).astype(np.uint8)
    opened = masks.open_mask(masks.encode_mask(mask), "check.png")
    if not (isinstance(opened, masks.PngMask)
            and np.array_equal(opened.crop(5, 3, 20, 10), mask[5:25, 3:13])):
        return Check("mask rows", FAILED, "a decoded crop differs from the mask",
                     "pip install -e . again, against this machine's libpng")
    return Check("mask rows", OK, "compiled; a decoded crop equals the mask")


def check_h5py() -> Check:
    try:
        import h5py
        import numpy as np
    except ImportError as error:
        return Check("h5py", FAILED, f"{error}", "pip install -e .")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "check.h5"
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=np.arange(100, dtype=np.uint8))
        with h5py.File(path, "r") as f:
            ok = f["x"][10:20].tolist() == list(range(10, 20))
    if not ok:
        return Check("h5py", FAILED, "HDF5 write/read round trip is wrong", "pip install -e .")
    return Check("h5py", OK, f"h5py {h5py.__version__}, HDF5 {h5py.version.hdf5_version}, "
                             f"write/read ok")


def check_requirements() -> Check:
    """labrun's declared dependencies against what is installed, without running pip."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    try:
        declared = importlib.metadata.requires("labrun") or []
    except importlib.metadata.PackageNotFoundError:
        return Check("requirements", FAILED, "labrun is not installed in this environment",
                     "pip install -e . (in the project's .venv)")
    problems, count = [], 0
    for line in declared:
        requirement = Requirement(line)
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue  # an optional extra
        count += 1
        try:
            installed = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{requirement.name} missing")
            continue
        if not requirement.specifier.contains(Version(installed), prereleases=True):
            problems.append(f"{requirement.name} {installed} (needs {requirement.specifier})")
    if problems:
        return Check("requirements", FAILED, "; ".join(problems),
                     "pip install -e . (in the project's .venv)")
    return Check("requirements", OK, f"all {count} requirements of labrun satisfied")
