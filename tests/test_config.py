"""Config composition and validation: every option composes, and each mistake a person makes
ends in one line naming the key and the fix (exit 2, no traceback)."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import OmegaConf

import text_fixtures
from conftest import PROJECT, PYTHON, run_train
from labrun.cli.hydra_app import user_error_message
from labrun.config import schema as config
from labrun.config import validation
from labrun.core.project import LABRUN_CONF

CONF = LABRUN_CONF
GROUPS = ["dataset", "model", "optimizer", "schedule", "precision", "cluster", "logger",
          "experiment"]
# Options that need a path or a name before they can validate.
REQUIRED = {"dataset/imagefolder": ["dataset.root={tmp}"], "dataset/hdf5": ["dataset.path={tmp}"],
            "dataset/tokens": ["dataset.path={tmp}"], "model/torchvision": ["model.name=resnet18"],
            # Datasets of masks train under task=segmentation, which refuses the rest.
            "dataset/shapes": ["task=segmentation"],
            "dataset/segfolder": ["dataset.root={tmp}", "task=segmentation"],
            "dataset/seg_hdf5": ["dataset.path={tmp}", "task=segmentation"],
            "dataset/coco": ["dataset.root={tmp}", "task=detection"],
            "dataset/yolo": ["dataset.data={tmp}", "task=detection"],
            "dataset/det_hdf5": ["dataset.path={tmp}", "task=detection"],
            "dataset/shapes_boxes": ["task=detection"],
            "model/torchvision_seg": ["model.name=lraspp_mobilenet_v3_large"],
            # Its weights are fetched by the run itself here: no cache holds them.
            "experiment/finetune_resnet18": ["dataset.root={tmp}", "model.download=true"],
            # Text trains a model=hf, found in the weights cache (a stub there: STUBBED).
            "dataset/text": ["dataset.path={tmp}", "task=text_classification", "model=hf",
                             "model.name=labrun/tiny-bert", "paths.weights_cache={tmp}"],
            "model/hf": ["model.name=labrun/tiny-bert", "paths.weights_cache={tmp}"],
            "experiment/text_tiny": ["dataset.path={tmp}", "paths.weights_cache={tmp}"]}
STUBBED = ("dataset/text", "model/hf", "experiment/text_tiny")


@pytest.fixture(autouse=True)
def hydra_conf():
    config.register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def compose_checked(overrides: list[str]):
    cfg = compose("train", overrides=["paths.run_dir=/tmp/x", *overrides])
    validation.validate(cfg)
    return cfg


@pytest.mark.parametrize("group_option", [f"{g}/{o}" for g in GROUPS for o in options(g)])
def test_every_option_composes_and_validates(group_option, tmp_path):
    group, option = group_option.split("/")
    extra = [e.format(tmp=tmp_path) for e in REQUIRED.get(group_option, [])]
    if group_option in STUBBED:
        text_fixtures.write_snapshot_stub(tmp_path)
    cfg = compose_checked([f"{group}={option}", *extra])
    if group != "experiment":
        assert cfg[group] is not None


def error_line(overrides: list[str], tmp_path: Path) -> str:
    overrides = [o.format(tmp=tmp_path) for o in overrides]
    with pytest.raises(Exception) as caught:
        compose_checked(overrides)
    message = user_error_message(caught.value)
    assert message is not None, f"{overrides} raised a non-user error: {caught.value!r}"
    assert "\n" not in message
    return message


MISTAKES = {
    "unknown group option": (["model=resnet5"], ["model=resnet5", "resnet50", "simple_cnn"]),
    "unknown precision": (["precision=fp8"], ["precision=fp8", "bf16, fp16, fp32"]),
    "misspelled key": (["optimizer.lrr=0.1"], ["optimizer.lrr", "did you mean optimizer.lr"]),
    "misspelled top-level key": (["trainer.max_epoch=3"], ["trainer.max_epoch", "max_epochs"]),
    "wrong type": (["optimizer.lr=abc"], ["optimizer.lr", "abc"]),
    "wrong int type": (["trainer.batch_size=big"], ["trainer.batch_size", "big"]),
    "negative lr": (["optimizer.lr=-0.1"], ["optimizer.lr=-0.1", "greater than 0"]),
    "zero epochs": (["trainer.max_epochs=0"], ["trainer.max_epochs=0"]),
    "zero steps": (["trainer.max_steps=0"], ["trainer.max_steps=0"]),
    "two budgets": (["trainer.max_steps=500", "trainer.max_epochs=3"],
                    ["trainer.max_epochs=3 and trainer.max_steps=500", "trainer.max_epochs=null"]),
    "two budgets, one from a preset": (["experiment=digits_fast", "trainer.max_steps=50"],
                                       ["trainer.max_epochs=3 and trainer.max_steps=50"]),
    "no budget": (["trainer.max_epochs=null"], ["neither trainer.max_epochs nor"]),
    "negative validation interval": (["trainer.val_every_n_steps=-1"],
                                     ["trainer.val_every_n_steps=-1", "0 or more"]),
    "negative warm-up steps": (["schedule.warmup_steps=-5"], ["schedule.warmup_steps=-5"]),
    "negative weight decay": (["optimizer.weight_decay=-1"], ["optimizer.weight_decay"]),
    "val fraction out of range": (["dataset.val_fraction=1.5"], ["dataset.val_fraction"]),
    "missing dataset folder": (["dataset=imagefolder", "dataset.root=/no/such/dir"],
                               ["dataset.root=/no/such/dir", "no such file"]),
    "dataset folder not given": (["dataset=imagefolder"], ["dataset.root", "required"]),
    "hdf5 file not given": (["dataset=hdf5"], ["dataset.path", "required"]),
    "missing hdf5 file": (["dataset=hdf5", "dataset.path={tmp}/none.h5"], ["dataset.path"]),
    "batch not divisible": (["trainer.batch_size=30", "trainer.micro_batch_size=8"],
                            ["trainer.batch_size=30", "multiple of 8"]),
    "batch not divisible by devices": (["trainer.batch_size=31", "trainer.devices=2"],
                                       ["trainer.batch_size=31", "world size"]),
    "micro batch not a number": (["trainer.micro_batch_size=many"],
                                 ["trainer.micro_batch_size=many"]),
    "unknown accelerator": (["trainer.accelerator=tpu"], ["trainer.accelerator=tpu", "cuda"]),
    "unknown checkpoint mode": (["checkpoint.mode=best"], ["checkpoint.mode=best", "max, min"]),
    "missing resume file": (["checkpoint.resume=/no/ckpt.pt"], ["checkpoint.resume"]),
    "missing init_from file": (["model.init_from=/no/ckpt.pt"], ["model.init_from"]),
    "unknown nan policy": (["trainer.nan_policy=ignore"], ["trainer.nan_policy"]),
    "unparsable override": (["optimizer.lr=[1,"],
                            ["cannot read the override 'optimizer.lr=[1,'", "key=value"]),
    # What sbatch would be handed: refused here, before a run or a sweep submits anything.
    **{f"cluster {override}": (["cluster=lab", override], [override, bound])
       for override, bound in (
           ("cluster.array_parallelism=0", "1 or more"), ("cluster.cpus_per_task=0", "1 or more"),
           ("cluster.timeout_min=0", "1 or more"), ("cluster.nodes=0", "1 or more"),
           ("cluster.tasks_per_node=0", "1 or more"), ("cluster.mem_gb=0", "or null"),
           ("cluster.controller.mem_gb=-2", "or null"),
           ("cluster.max_num_timeout=-1", "0 or more"),
           ("cluster.signal_delay_s=-5", "0 or more"))},
}


@pytest.mark.parametrize("mistake", MISTAKES, ids=list(MISTAKES))
def test_config_mistake_gives_one_clear_line(mistake, tmp_path):
    overrides, expected = MISTAKES[mistake]
    message = error_line(overrides, tmp_path)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_a_step_budget_replaces_the_default_epochs_and_the_task_names_the_monitor(
        python_docs_tokens):
    cfg = compose_checked(["trainer.max_steps=500"])
    assert cfg.trainer.max_steps == 500 and cfg.trainer.max_epochs is None
    assert compose_checked([]).trainer.max_epochs == 12  # the default budget: epochs
    assert (cfg.checkpoint.monitor, cfg.checkpoint.mode) == ("val/acc", "max")
    lm_data = ["task=lm", "dataset=tokens", f"dataset.path={python_docs_tokens}", "model=gpt"]
    lm = compose_checked(lm_data)
    assert (lm.checkpoint.monitor, lm.checkpoint.mode) == ("val/loss", "min")
    chosen = compose_checked([*lm_data, "checkpoint.monitor=val/ppl"])
    assert chosen.checkpoint.monitor == "val/ppl"  # the command line has the last word


# A language model's data and model that cannot work together, refused by the task
# (LanguageModelling.check_config) before any data loads. {good}: a token folder of bytes;
# {missing}, {cut}: copies of it without val.bin, with train.bin cut short; {ckpt_50}: a
# checkpoint of a vocabulary of 50; {ckpt_bpe}: one of another tokenizer; {tmp}: no token folder.
LM_MISTAKES = {
    "not a token folder": (["dataset.path={tmp}"], ["is not a token folder", "convert text"]),
    "missing .bin": (["dataset.path={missing}"], ["val.bin is missing", "convert again"]),
    "truncated .bin": (["dataset.path={cut}"], ["train.bin is ", "cut short"]),
    "window beyond the model's positions": (
        ["dataset.path={good}", "dataset.block_size=48", "model.block_size=32"],
        ["dataset.block_size=48 is beyond model.block_size=32", "dataset.block_size<=32"]),
    "vocabulary beyond the model's": (
        ["dataset.path={good}", "model.vocab_size=100"],
        ["model.vocab_size=100 is below the token folder's vocabulary of 256"]),
    "init_from of another vocabulary": (
        ["dataset.path={good}", "model.init_from={ckpt_50}"],
        ["model.init_from=", "token_embedding.weight is [50, 32] there, [256, 32] here"]),
    "init_from of another tokenizer": (
        ["dataset.path={good}", "model.init_from={ckpt_bpe}"],
        ["model.init_from=", "another tokenizer (bpe", "than the token folder's (bytes)"]),
}


@pytest.fixture(scope="module")
def lm_paths(python_docs_tokens, tmp_path_factory) -> dict[str, Path]:
    import shutil

    from labrun.models.gpt import GPT

    base = tmp_path_factory.mktemp("lm-mistakes")
    paths = {"good": python_docs_tokens}
    for name in ("missing", "cut"):
        paths[name] = base / name
        shutil.copytree(python_docs_tokens, paths[name])
    (paths["missing"] / "val.bin").unlink()
    train = paths["cut"] / "train.bin"
    train.write_bytes(train.read_bytes()[:-1000])
    for name, vocab, tokenizer in (("ckpt_50", 50, {"kind": "bytes", "sha256": None}),
                                   ("ckpt_bpe", 256, {"kind": "bpe", "sha256": "0" * 64})):
        model = GPT(vocab_size=vocab, block_size=32, n_layer=1, n_head=2, n_embd=32)
        paths[name] = base / f"{name}.pt"
        torch.save({"model": model.state_dict(), "class_names": [], "tokenizer": tokenizer},
                   paths[name])
    return paths


@pytest.mark.parametrize("mistake", LM_MISTAKES, ids=list(LM_MISTAKES))
def test_a_language_model_config_mistake_is_one_line_before_data_loads(mistake, lm_paths,
                                                                       tmp_path):
    from conftest import LM_TINY

    overrides, expected = LM_MISTAKES[mistake]
    overrides = [o.format(tmp=tmp_path, **lm_paths) for o in overrides]
    message = error_line([*LM_TINY, *overrides], tmp_path)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_a_language_models_own_sizes_take_a_smaller_window_and_a_padded_vocabulary(lm_paths):
    from conftest import LM_TINY
    from labrun.train.task import LanguageModelling

    cfg = compose_checked([*LM_TINY, f"dataset.path={lm_paths['good']}", "model.block_size=64",
                           "model.vocab_size=320"])
    model = LanguageModelling().build_model(cfg.model, {"vocab_size": 256, "block_size": 32})
    assert (model.vocab_size, model.block_size) == (320, 64)


def test_the_cluster_keys_bounds_themselves_pass(composed):
    validation.validate(composed(
        "cluster=lab", "cluster.array_parallelism=1", "cluster.cpus_per_task=1",
        "cluster.timeout_min=1", "cluster.mem_gb=null", "cluster.controller.mem_gb=null",
        "cluster.max_num_timeout=0", "cluster.signal_delay_s=0"))


@pytest.mark.parametrize("sweep", [False, True], ids=["run", "sweep"])
def test_an_unparsable_override_is_one_line_with_or_without_m(sweep, tmp_path):
    folder = f"hydra.sweep.dir={tmp_path}/sweep" if sweep else f"hydra.run.dir={tmp_path}/run"
    result = subprocess.run([PYTHON, "train.py", *(["-m"] if sweep else []), "optimizer.lr=1,,2",
                             folder], cwd=PROJECT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "error: cannot read the override 'optimizer.lr=1,,2' (extraneous input ','); write "
        "key=value, key=a,b,c to sweep (with -m), and quote a value that holds spaces, commas "
        "or brackets: 'key=\"a b\"'")


@pytest.mark.parametrize("overrides", [["optimizer.lr=abc"], ["model=resnet5"],
                                       ["optimizer.lr=-0.1"],
                                       ["dataset=imagefolder", "dataset.root=/no/such/dir"],
                                       ["+checkpoint.keep_lst=2"]])
def test_the_real_command_exits_2_with_one_line(overrides, tmp_path):
    result = run_train(*overrides, run_dir=tmp_path / "run", check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_hydra_full_error_shows_the_traceback(tmp_path):
    result = run_train("optimizer.lr=-0.1", run_dir=tmp_path / "run", check=False,
                       env={"HYDRA_FULL_ERROR": "1"})
    assert result.returncode != 0 and "Traceback" in result.stderr


# Keys added with `+`: Hydra adds them even to a typed section, where nothing would read them.
# Each section's schema says which new keys it takes (labrun.config.schema.NewKeys).
NEW_KEY_MISTAKES = {
    "typo in trainer": (["+trainer.max_epoch=3"], "trainer.max_epoch: no such key in trainer",
                        "did you mean trainer.max_epochs?"),
    "typo in checkpoint": (["+checkpoint.keep_lst=2"], "checkpoint.keep_lst: no such key in "
                           "checkpoint", "did you mean checkpoint.keep_last?"),
    "nothing close": (["+trainer.x=1"], "trainer.x: no such key in trainer", "max_epochs"),
    "nested section": (["+dataset.augment.hflp=false"], "dataset.augment.hflp: no such key in "
                       "dataset.augment", "did you mean dataset.augment.hflip?"),
    "group without a target": (["+paths.data_dri=/data"], "paths.data_dri: no such key in paths",
                               "did you mean paths.data_dir?"),
    "optimizer argument": (["+optimizer.lrr=0.1"], "torch.optim.AdamW takes no argument lrr",
                           "did you mean optimizer.lr?"),
    "model argument": (["+model.widht=64"], "labrun.models.SimpleCNN takes no argument widht",
                       "did you mean model.width?"),
    "schedule argument": (["schedule=step", "+schedule.gama=0.5"],
                          "labrun.train.schedules.step takes no argument gama",
                          "did you mean schedule.gamma?"),
    "argument of another model": (["model=resnet18", "+model.width=64"],
                                  "labrun.models.torchvision_model takes no argument width",
                                  "model.width"),
}


@pytest.mark.parametrize("mistake", NEW_KEY_MISTAKES, ids=list(NEW_KEY_MISTAKES))
def test_a_new_key_nothing_reads_is_refused(mistake, tmp_path):
    overrides, names_key_and_section, hint = NEW_KEY_MISTAKES[mistake]
    message = error_line(overrides, tmp_path)
    assert names_key_and_section in message and hint in message, message


def takes_anything(num_classes: int, **kwargs):
    """A model factory with **kwargs: its section takes any new key (see the test below)."""


@pytest.mark.parametrize("overrides, key", [
    (["+tag=x"], "tag"),  # the root is open: runs are tagged this way
    (["+wandb.api_key=abc"], "wandb.api_key"),  # and so is a section added at the root
    (["+cluster.env.OMP_NUM_THREADS=2"], "cluster.env.OMP_NUM_THREADS"),  # a mapping field
    (["+optimizer.amsgrad=true"], "optimizer.amsgrad"),  # an argument of torch.optim.AdamW
    (["optimizer=sgd", "+optimizer.dampening=0.1"], "optimizer.dampening"),
    (["model._target_=test_config.takes_anything", "+model.depth=3"], "model.depth"),
])
def test_a_new_key_something_reads_is_accepted(overrides, key):
    cfg = compose_checked(overrides)
    assert OmegaConf.select(cfg, key) is not None


def test_an_accepted_target_argument_reaches_the_target():
    from labrun.train import fine_tuning

    cfg = compose_checked(["+optimizer.amsgrad=true", "+optimizer.maximize=true"])
    # As the Trainer builds it: labrun's own keys (optimizer.groups...) taken out.
    optimizer = instantiate(fine_tuning.optimizer_factory(cfg.optimizer))(
        [torch.nn.Parameter(torch.zeros(1))])
    assert optimizer.defaults["amsgrad"] is True and optimizer.defaults["maximize"] is True


def test_every_target_schema_checks_new_keys_against_its_target():
    # "Any section chosen by _target_": a schema with a _target_ field must be marked TARGET,
    # or a misspelled argument would be refused (CLOSED) or pass unread (OPEN).
    with_target = [schema for schema in config.SCHEMAS.values()
                   if "_target_" in {f.name for f in dataclasses.fields(schema)}]
    assert with_target, "no schema has a _target_ field any more: update this test"
    for schema in with_target:
        assert schema.new_keys is config.NewKeys.TARGET, schema.__name__


@pytest.mark.parametrize("override, advises_plus", [
    ("trainer.max_epoch=3", False),  # trainer takes no new keys: `+` would be refused too
    ("optimizer.lrr=0.1", False),  # neither does AdamW take lrr
    ("optimizer.amsgrad=true", True),  # but it takes amsgrad: add it with `+`
    ("tag=x", True),  # and the root takes any key
])
def test_a_missing_plus_is_advised_only_where_the_key_would_be_taken(override, advises_plus,
                                                                    tmp_path):
    message = error_line([override], tmp_path)
    key = override.split("=")[0]
    assert ("add a new key with +" + key in message) is advises_plus, message
