"""Fine-tuning from pretrained weights with no network (issue 41): weights files placed in each
library's own cache layout (torchvision's hub/checkpoints/NAME-HASH.pth; the Hugging Face hub
cache for timm), holding known tensors (seeded random ones: the real files cannot be
downloaded here), found by `model.pretrained` offline; the head swap; frozen layers; learning
rates per group; the refusals before data loads and before a sweep submits; `labrun weights`.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import FAST, PROJECT, PYTHON, built_once, run_train
from labrun import cli

# Each test is a group of its own under xdist (conftest.py): what several tests read is built
# once per session with built_once, whichever worker asks first.
SPREAD_OVER_WORKERS = True

TORCHVISION_FILE = "hub/checkpoints/resnet18-f37072fd.pth"  # torchvision's own name for it
TIMM_REPO = "timm/test_resnet.r160_in1k"  # timm's tiny test model: its default weights
REVISION = "0123456789abcdef0123456789abcdef01234567"
FROZEN = ["conv1.*", "bn1.*", "layer1.*"]


def place_in_hf_cache(hub: Path, repo: str, filename: str, tensors: dict) -> Path:
    """A file as huggingface_hub's download leaves it: the bytes in blobs/ under their sha256,
    a snapshot link to them, and refs/main naming the snapshot."""
    from safetensors.torch import save_file

    folder = hub / f"models--{repo.replace('/', '--')}"
    (folder / "blobs").mkdir(parents=True)
    staging = folder / "blobs" / "incoming"
    save_file({name: t.contiguous() for name, t in tensors.items()}, staging)
    digest = hashlib.sha256(staging.read_bytes()).hexdigest()
    staging.rename(folder / "blobs" / digest)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(REVISION)
    snapshot = folder / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (snapshot / filename).symlink_to(f"../../blobs/{digest}")
    return snapshot / filename


def build_cache(folder: Path) -> None:
    import timm
    import torchvision

    torch.manual_seed(41)
    resnet = torchvision.models.resnet18(weights=None)  # 1000 classes, as the real file's
    for buffer in resnet.buffers():  # running statistics unlike a fresh model's
        if buffer.is_floating_point():
            buffer.uniform_(0.5, 1.5)
    (folder / TORCHVISION_FILE).parent.mkdir(parents=True)
    torch.save(resnet.state_dict(), folder / TORCHVISION_FILE)
    tiny = timm.create_model("test_resnet", pretrained=False)
    for tensor in tiny.state_dict().values():  # none left at a fresh model's 0 or 1
        if tensor.is_floating_point():
            tensor.uniform_(-1.0, 1.0)
    place_in_hf_cache(folder / "hub", TIMM_REPO, "model.safetensors", tiny.state_dict())


@pytest.fixture(scope="session")
def weights_cache(tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "weights_cache", build_cache)


@pytest.fixture
def no_user_caches(monkeypatch, tmp_path):
    """The libraries' own caches empty: only paths.weights_cache holds weights."""
    from huggingface_hub import constants

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
    return {"TORCH_HOME": str(tmp_path / "torch-home"), "HF_HOME": str(tmp_path / "hf-home")}


def write_image_folder(root: Path, classes: int = 3, per_class: int = 8) -> None:
    """Real JPEG files, one colour per class: ROOT/{train,val}/CLASS/N.jpg."""
    from PIL import Image

    for split, count in (("train", per_class), ("val", per_class // 2)):
        for label in range(classes):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True)
            for index in range(count):
                colour = tuple(int(c) for c in torch.randint(0, 256, (3,)))
                colour = tuple((c // 3) + 85 * (i == label) for i, c in enumerate(colour))
                Image.new("RGB", (40, 40), colour).save(folder / f"{index}.jpg", quality=90)


def optimizer_groups(checkpoint: Path) -> list[dict]:
    return torch.load(checkpoint, weights_only=True)["optimizer"]["param_groups"]


@pytest.fixture(scope="session")
def preset_run(weights_cache, tmp_path_factory) -> tuple[Path, str]:
    """experiment=finetune_resnet18 on a 3-class image folder, with the early layers frozen."""
    def build(base: Path) -> None:
        write_image_folder(base / "images")
        result = run_train("experiment=finetune_resnet18", f"dataset.root={base / 'images'}",
                           f"paths.weights_cache={weights_cache}", "dataset.image_size=32",
                           "trainer.batch_size=8", "trainer.max_epochs=null",
                           "trainer.max_steps=3", "schedule.warmup_epochs=0",
                           f"model.freeze=[{','.join(FROZEN)}]", run_dir=base / "run")
        (base / "output.txt").write_text(result.stdout + result.stderr)

    base = built_once(tmp_path_factory, "finetune_preset", build)
    return base / "run", (base / "output.txt").read_text()


def test_the_preset_starts_from_the_cached_file_with_a_new_head_and_frozen_layers_unchanged(
        preset_run, weights_cache):
    run_dir, output = preset_run
    published = torch.load(weights_cache / TORCHVISION_FILE, weights_only=True)
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    tuned = last["model"]
    frozen = [k for k in tuned if k.split(".")[0] in ("conv1", "bn1", "layer1")]
    assert len(frozen) == 30  # conv1, bn1, layer1's 4 convs and 4 batch norms (5 tensors each)
    for key in frozen:  # weights and running statistics: untouched by 3 steps of training
        assert torch.equal(tuned[key], published[key]), f"frozen {key} changed"
    trained = [k for k in tuned if k.startswith("layer4.") and k.endswith(".weight")]
    assert any(not torch.equal(tuned[k], published[k]) for k in trained)  # it did train
    assert tuned["fc.weight"].shape == (3, 512)  # the 1000-class head swapped for 3 classes
    assert ("re-initialised the head for 3 classes: fc.weight [3, 512], fc.bias [3]"
            in output), output[-2000:]

    # Frozen parameters are not in the optimizer; the head trains at optimizer.lr, every other
    # parameter at a tenth of it (backbone_lr_mult), as the optimizer itself records.
    groups = last["optimizer"]["param_groups"]
    assert [g["initial_lr"] for g in groups] == [0.01, pytest.approx(0.001)]
    trainable = sum(p.numel() > 0 for k, p in tuned.items()
                    if not k.endswith(("running_mean", "running_var", "num_batches_tracked")))
    assert sum(len(g["params"]) for g in groups) == trainable - 15  # 15 frozen parameters
    assert len(groups[0]["params"]) == 2  # fc.weight, fc.bias
    assert len(last["optimizer"]["state"]) == trainable - 15

    record = json.loads((run_dir / "provenance" / "weights.json").read_text())
    assert record["source"] == "torchvision:ResNet18_Weights.IMAGENET1K_V1"
    assert record["sha256"] == hashlib.sha256(
        (weights_cache / TORCHVISION_FILE).read_bytes()).hexdigest()


def test_compare_names_each_runs_starting_weights(preset_run, capsys):
    run_dir, _ = preset_run
    assert cli.main(["compare", str(run_dir)]) == 0
    table = capsys.readouterr().out
    assert "torchvision:ResNet18_Weights.IMAGENET1K_V1" in table, table
    digest = json.loads((run_dir / "provenance" / "weights.json").read_text())["sha256"]
    assert digest[:12] in table


def test_timm_weights_from_the_hugging_face_cache_with_lr_groups(weights_cache, tmp_path):
    """lr=1e-30 with AdamW: a step moves a weight by about lr, far below float32's resolution,
    so the last checkpoint holds the weights the run started from (running statistics aside,
    which training updates)."""
    snapshot = (weights_cache / "hub" / f"models--{TIMM_REPO.replace('/', '--')}" / "snapshots"
                / REVISION / "model.safetensors")
    from safetensors.torch import load_file

    published = load_file(snapshot)
    result = run_train("model=timm", "model.name=test_resnet", "model.pretrained=true",
                       f"paths.weights_cache={weights_cache}", "dataset=synthetic",
                       "dataset.num_train=64", "dataset.num_val=32", "optimizer.lr=1e-30",
                       "optimizer.weight_decay=0", "trainer.max_epochs=1",
                       "trainer.limit_train_batches=2", "trainer.batch_size=16",
                       "optimizer.groups=[{params: 'fc.*', lr_mult: 10}]",
                       run_dir=tmp_path / "run")
    last = torch.load(tmp_path / "run/checkpoints/last.pt", weights_only=True)
    tuned = last["model"]
    statistics = ("running_mean", "running_var", "num_batches_tracked")
    body = [k for k in tuned if not k.startswith("fc.") and not k.endswith(statistics)]
    assert len(body) > 20
    for key in body:
        assert torch.equal(tuned[key], published[key]), f"{key} is not the file's"
    assert tuned["fc.weight"].shape == (10, published["fc.weight"].shape[1])
    assert "re-initialised the head for 10 classes: fc.weight [10, 96], fc.bias [10]" in (
        result.stdout + result.stderr)
    groups = last["optimizer"]["param_groups"]
    assert [g["initial_lr"] for g in groups] == [1e-30, pytest.approx(1e-29)]
    assert len(groups[1]["params"]) == 2  # fc.weight, fc.bias at 10x
    record = json.loads((tmp_path / "run/provenance/weights.json").read_text())
    assert record["source"] == "timm:test_resnet.r160_in1k"
    assert Path(record["file"]) == snapshot.resolve()  # the blob the snapshot links to


# Refused in one line before any data loads: compose and validate in this process, as train.py
# does first (dataset._target_ names a loader that must never run).
REFUSALS = {
    "pretrained weights not in any cache": (
        ["model=torchvision", "model.name=resnet34", "model.pretrained=true"],
        ["model.pretrained=true: no torchvision:ResNet34_Weights.IMAGENET1K_V1 weights",
         "hub/checkpoints/resnet34-b627a593.pth",
         "labrun weights fetch model=torchvision model.name=resnet34 model.pretrained=true"]),
    "timm weights not in any cache": (
        ["model=timm", "model.name=test_vit", "model.pretrained=true"],
        ["no timm:test_vit.r160_in1k weights", "models--timm--test_vit.r160_in1k",
         "labrun weights fetch model=timm model.name=test_vit"]),
    "unknown torchvision weights": (
        ["model=resnet18", "model.pretrained=IMAGENET1K_V9"],
        ["model.pretrained=IMAGENET1K_V9: resnet18 has no such weights", "IMAGENET1K_V1"]),
    "unknown timm tag": (
        ["model=timm", "model.name=test_resnet", "model.pretrained=r160_in21k"],
        ["timm has no test_resnet.r160_in21k weights", "r160_in1k"]),
    "both starting weights": (
        ["model=resnet18", "model.pretrained=true", "model.init_from={file}"],
        ["model.pretrained=true and model.init_from=", "keep one"]),
    "init_from of another architecture": (
        ["model=resnet18", "model.init_from={resnet34}"],
        ["model.init_from=", "holds layer1.2.conv1.weight [64, 64, 3, 3], which this model has "
         "not (96 such tensors"]),
    "init_from of another width": (
        ["model=simple_cnn", "model.width=16", "model.init_from={simple32}"],
        ["its features.0.0.weight is [32, 3, 3, 3] there, [16, 3, 3, 3] here",
         "only the class head may differ"]),
    "init_from not a state dict": (
        ["model=simple_cnn", "model.init_from={not_weights}"],
        ["holds no state dict"]),
    "freeze pattern matching nothing": (
        ["model=resnet18", "model.freeze=[layer9.*]"],
        ["model.freeze: 'layer9.*' matches no parameter", "conv1.weight"]),
    "group pattern matching nothing": (
        ["model=simple_cnn", "optimizer.groups=[{{params: 'fc.*', lr_mult: 10}}]"],
        ["optimizer.groups: 'fc.*' matches no parameter", "features.0.0.weight"]),
    "groups and backbone multiplier both": (
        ["optimizer.groups=[{{params: 'head.*', lr_mult: 10}}]", "optimizer.backbone_lr_mult=0.1"],
        ["optimizer.groups and optimizer.backbone_lr_mult both set", "keep one"]),
    "a group that is not params and lr_mult": (
        ["optimizer.groups=[{{params: 'head.*', lr: 10}}]"],
        ["is not {params: PATTERN, lr_mult: X}"]),
}


@pytest.fixture(scope="session")
def refusal_files(tmp_path_factory) -> dict[str, Path]:
    import torchvision

    from labrun.models import SimpleCNN

    names = {"resnet34": "resnet34.pth", "simple32": "simple32.pt", "not_weights": "list.pt",
             "file": "simple32.pt"}

    def build(folder: Path) -> None:
        with torch.device("meta"):
            shapes = torchvision.models.resnet34(weights=None).state_dict()
        # Each tensor one zero broadcast to its shape: its shapes at a few bytes of storage.
        torch.save({k: torch.zeros(()).expand(v.shape) for k, v in shapes.items()},
                   folder / names["resnet34"])
        torch.save(SimpleCNN(10, width=32).state_dict(), folder / names["simple32"])
        torch.save([1, 2, 3], folder / names["not_weights"])

    folder = built_once(tmp_path_factory, "refusal_files", build)
    return {key: folder / name for key, name in names.items()}


@pytest.mark.parametrize("refusal", REFUSALS, ids=list(REFUSALS))
def test_a_fine_tuning_mistake_is_one_line_before_data_loads(refusal, refusal_files, composed,
                                                             no_user_caches, tmp_path):
    from labrun.config import validation
    from labrun.core.errors import ConfigError

    overrides, expected = REFUSALS[refusal]
    cfg = composed("dataset=synthetic", "dataset._target_=no.such.loader",
                   f"paths.weights_cache={tmp_path / 'empty-cache'}",
                   *[o.format(**refusal_files) for o in overrides])
    with pytest.raises(ConfigError) as caught:
        validation.validate(cfg)
    message = str(caught.value)
    assert "\n" not in message
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_a_sweep_checks_every_jobs_weights_before_it_submits(weights_cache, no_user_caches,
                                                             tmp_path):
    # resnet18's weights are in the cache, resnet34's are not: job 1 would fail after job 0.
    sweep_dir = tmp_path / "sweep"
    result = subprocess.run(
        [PYTHON, "train.py", "-m", *FAST, "model=torchvision", "model.name=resnet18,resnet34",
         "model.pretrained=true", f"paths.weights_cache={weights_cache}", "cluster=local",
         f"hydra.sweep.dir={sweep_dir}"], cwd=PROJECT, capture_output=True, text=True,
        timeout=300, env={**os.environ, **no_user_caches})
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no torchvision:ResNet34_Weights.IMAGENET1K_V1 weights" in lines[0]
    left = sorted(path.name for path in sweep_dir.iterdir()) if sweep_dir.exists() else []
    assert left in ([], ["multirun.yaml"]), left  # no job folder, no jobs.json


@pytest.mark.parametrize("kind", ["state dict", "safetensors"])  # labrun's: test_trainer_options
def test_init_from_takes_each_kind_of_file_and_swaps_the_head(kind, digits_run, tmp_path):
    """A 10-class digits model into a 5-class run: the body loads, the head is new. lr=1e-30
    (AdamW): the last checkpoint holds the starting weights."""
    from safetensors.torch import save_file

    checkpoint = digits_run / "checkpoints" / "best.pt"
    trained = torch.load(checkpoint, weights_only=True)["model"]
    source = {"labrun checkpoint": checkpoint, "state dict": tmp_path / "weights.pth",
              "safetensors": tmp_path / "weights.safetensors"}[kind]
    if kind == "state dict":
        torch.save(trained, source)
    elif kind == "safetensors":
        save_file(trained, source)
    result = run_train("dataset=synthetic", "dataset.num_classes=5", "dataset.num_train=64",
                       "dataset.num_val=32", "dataset.image_size=32", "optimizer.lr=1e-30",
                       "optimizer.weight_decay=0", "trainer.max_epochs=1",
                       "trainer.limit_train_batches=1", f"model.init_from={source}",
                       run_dir=tmp_path / "run")
    tuned = torch.load(tmp_path / "run/checkpoints/last.pt", weights_only=True)["model"]
    for key in (k for k in tuned if k.startswith("features.")):
        assert torch.equal(tuned[key], trained[key]), f"{key} was not loaded"
    assert tuned["head.1.weight"].shape == (5, trained["head.1.weight"].shape[1])
    assert "re-initialised the head for 5 classes: head.1.weight [5, 128], head.1.bias [5]" in (
        result.stdout + result.stderr)
    record = json.loads((tmp_path / "run/provenance/weights.json").read_text())
    assert record["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()


def test_weights_list_shows_both_layouts_with_sizes_and_hashes(weights_cache, capsys):
    assert cli.main(["weights", "list", f"paths.weights_cache={weights_cache}"]) == 0
    listed = capsys.readouterr().out
    torchvision_file = weights_cache / TORCHVISION_FILE
    assert "resnet18-f37072fd.pth" in listed and f"{TIMM_REPO}/model.safetensors" in listed
    assert hashlib.sha256(torchvision_file.read_bytes()).hexdigest() in listed.replace("\n", "")
    from rich.filesize import decimal

    total = sum(p.stat().st_size for p in weights_cache.rglob("*") if p.is_file()
                and not p.is_symlink() and p.parent.name != "refs")
    assert f"2 file(s), {decimal(total)} in {weights_cache}" in listed


def test_weights_fetch_targets_each_librarys_layout(no_user_caches, tmp_path):
    """Where `weights fetch` would download from and to: this machine has no network."""
    from omegaconf import OmegaConf

    from labrun.models import pretrained

    cache = tmp_path / "cache"
    tv = pretrained.resolve(OmegaConf.create({"_target_": "labrun.models.torchvision_model",
                                              "name": "resnet50", "pretrained": "IMAGENET1K_V1"}),
                            str(cache))
    assert tv.url == "https://download.pytorch.org/models/resnet50-0676ba61.pth"
    assert tv.candidates[0] == cache / "hub/checkpoints/resnet50-0676ba61.pth"
    assert tv.hash_prefix == "0676ba61"
    tm = pretrained.resolve(OmegaConf.create({"_target_": "labrun.models.timm_model",
                                              "name": "resnet18", "pretrained": True}), str(cache))
    assert (tm.hf_repo, tm.url) == ("timm/resnet18.a1_in1k",
                                    "https://huggingface.co/timm/resnet18.a1_in1k")
    assert tm.candidates[0].parts[-5:-2] == ("hub", "models--timm--resnet18.a1_in1k", "snapshots")


@pytest.mark.parametrize("model", [["model=resnet50"],
                                   ["model=timm", "model.name=resnet18"]],
                         ids=["torchvision", "timm"])
def test_weights_fetch_without_a_network_is_one_line(model, tmp_path):
    # In a network namespace of its own with no interface but a down loopback: no route
    # anywhere, and no name resolved through this machine's network.
    cache = tmp_path / "cache"
    result = subprocess.run(["unshare", "--net", PYTHON, "-m", "labrun.cli", "weights", "fetch",
                             *model, f"paths.weights_cache={cache}"],
                            cwd=PROJECT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: could not fetch https://"), lines
    assert "run `labrun weights fetch` on a machine with internet" in lines[0]
    left = [p for p in cache.rglob("*") if p.is_file()] if cache.exists() else []
    assert left == []  # nothing half-downloaded where a run would find it


def test_weights_fetch_verifies_a_cached_file_against_what_was_published(weights_cache,
                                                                          capsys):
    # The torchvision file here holds seeded tensors, not the published ones: its sha256 cannot
    # start with the published prefix. The Hugging Face blob is named by its own sha256.
    cache = f"paths.weights_cache={weights_cache}"
    assert cli.main(["weights", "fetch", "model=resnet18", cache]) == 2
    assert "does not match the published f37072fd" in capsys.readouterr().err
    assert cli.main(["weights", "fetch", "model=timm", "model.name=test_resnet", cache]) == 0
    right = capsys.readouterr().out
    assert "timm:test_resnet.r160_in1k: already at" in right
    assert "matches what was published" in right
