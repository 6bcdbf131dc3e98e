"""A key that nothing reads is refused in every section a `_target_` builds: dataset, task,
model, logger and each callback, for labrun's targets and a lab's own alike (config/keys.py).
A section without a schema (a lab's own; labrun's callbacks) may hold the keys labrun reads
there and those its target's signature names; before, dataset and logger dropped any other
silently (labrun.data.call_target passes a target only what it names) and task, model and
callbacks failed late in the target's call. Checked in this process, before anything runs;
then once through the real command, before the lab's loader runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

from conftest import FAST, PROJECT, PYTHON
from labrun.cli.hydra_app import user_error_message
from labrun.config import validation
from labrun.core.errors import ConfigError

HERE = __name__  # this module: the lab's own code of these tests

# -- a lab's own targets -----------------------------------------------------------------------


def load_lab_data(path: str, decoder: str = "pil") -> dict:
    """A lab's image format: labrun reads the section's size, workers, augment and the rest."""
    raise AssertionError("validation never calls a loader")


def load_own_augment(path: str, augment: dict) -> dict:
    """A format that augments as it likes, from its own `augment` keys."""
    raise AssertionError("validation never calls a loader")


class LabTask:
    metric_names = ("loss", "acc")

    def __init__(self, smoothing: float = 0.1):
        self.smoothing = smoothing


def lab_net(num_classes: int, depth: int = 2, backbone: object = None) -> None:
    """A model factory (`_partial_: true`): num_classes comes from the data."""


class LabTracker:
    run_id = None

    def __init__(self, run_dir: Path, server: str):
        self.server = server


class LabCallback:
    def __init__(self, every: int = 50):
        self.every = every


def takes_anything(num_classes: int, **kwargs) -> None:
    """A factory with **kwargs: any key is its own."""


# -- sections without a schema, as a lab's experiment writes them ------------------------------

LAB_SECTIONS = {
    "dataset": {"_target_": f"{HERE}.load_lab_data", "name": "mine", "path": "/data/mine.h5",
                "decoder": "pil", "image_size": 32, "num_workers": 0, "val_fraction": 0.2,
                "mean": [0.5] * 3, "std": [0.5] * 3, "augment": {"hflip": False}},
    "task": {"_target_": f"{HERE}.LabTask", "smoothing": 0.2},
    # num_classes is left to the data; init_from, pretrained and freeze are labrun's.
    "model": {"_target_": f"{HERE}.lab_net", "_partial_": True, "depth": 3, "init_from": None,
              "pretrained": False, "freeze": []},
    "logger": {"_target_": f"{HERE}.LabTracker", "name": "lab", "server": "http://mlflow"},
    "callbacks": {"every_5": {"_target_": f"{HERE}.LabCallback", "every": 5}},
}
# labrun's own targets in sections without a schema (a copy of a composed config, or a lab's
# experiment naming them), and its callbacks, which have none.
LABRUN_SECTIONS = {
    "dataset": {"_target_": "labrun.data.image.digits.load", "name": "digits", "image_size": 32,
                "val_fraction": 0.2, "num_workers": 0},
    "task": {"_target_": "labrun.train.task.Classification"},
    "model": {"_target_": "labrun.models.SimpleCNN", "_partial_": True, "width": 8},
    "logger": {"_target_": "labrun.track.loggers.CSVTracker", "name": "csv"},
    "callbacks": {"early_stopping": {"_target_": "labrun.train.callbacks.EarlyStopping",
                                     "patience": 3, "min_delta": 0.0}},
}


@pytest.fixture(autouse=True)
def lab_code_trusted(monkeypatch):
    """This module is the lab's code, trusted as a lab's own package is (core/trust.py)."""
    monkeypatch.setenv("LABRUN_TRUSTED_MODULES", HERE)


def with_sections(cfg, **sections):
    """`cfg` with these sections replaced by plain ones (no schema), as an experiment that
    sets their groups to null and writes them itself composes."""
    with open_dict(cfg):
        for name, node in sections.items():
            cfg[name] = OmegaConf.create(node)
    return cfg


def refusal(cfg) -> str:
    with pytest.raises(ConfigError) as refused:
        validation.validate(cfg, read_data=False)
    message = user_error_message(refused.value)
    assert message is not None and "\n" not in message
    return message


@pytest.mark.parametrize("sections", [LAB_SECTIONS, LABRUN_SECTIONS], ids=["lab", "labrun"])
def test_sections_of_what_labrun_and_their_targets_read_pass(composed, sections):
    validation.validate(with_sections(composed(), **sections), read_data=False)


TYPOS = {
    "dataset": ("lab", "dataset.decodr", "pil",
                "dataset.decodr: no such key in dataset and test_unknown_keys.load_lab_data takes "
                "no argument decodr; did you mean dataset.decoder?"),
    "dataset labrun": ("labrun", "dataset.num_workres", 2,
                       "dataset.num_workres: no such key in dataset and "
                       "labrun.data.image.digits.load takes no argument num_workres; did you "
                       "mean dataset.num_workers?"),
    "dataset.augment": ("lab", "dataset.augment.hflp", True,
                        "dataset.augment.hflp: no such key in dataset.augment; did you mean "
                        "dataset.augment.hflip?"),
    "task": ("lab", "task.smoothnig", 0.3,
             "task.smoothnig: no such key in task and test_unknown_keys.LabTask takes no "
             "argument smoothnig; did you mean task.smoothing?"),
    "task labrun": ("labrun", "task.smoothing", 0.1,
                    "task.smoothing: no such key in task and labrun.train.task.Classification "
                    "takes no argument smoothing; it takes no key but _target_"),
    "model": ("lab", "model.dpeth", 4,
              "model.dpeth: no such key in model and test_unknown_keys.lab_net takes no "
              "argument dpeth; did you mean model.depth?"),
    "model labrun": ("labrun", "model.init_frm", "/w.pt",
                     "model.init_frm: no such key in model and labrun.models.SimpleCNN takes no "
                     "argument init_frm; did you mean model.init_from?"),
    "logger": ("lab", "logger.sever", "http://other",
               "logger.sever: no such key in logger and test_unknown_keys.LabTracker takes no "
               "argument sever; did you mean logger.server?"),
    "logger labrun": ("labrun", "logger.projcet", "vision",
                      "logger.projcet: no such key in logger and labrun.track.loggers.CSVTracker "
                      "takes no argument projcet; did you mean logger.project?"),
    "callback": ("lab", "callbacks.every_5.evrey", 10,
                 "callbacks.every_5.evrey: no such key in callbacks.every_5 and "
                 "test_unknown_keys.LabCallback takes no argument evrey; did you mean "
                 "callbacks.every_5.every?"),
    "callback labrun": ("labrun", "callbacks.early_stopping.pateince", 5,
                        "callbacks.early_stopping.pateince: no such key in "
                        "callbacks.early_stopping and labrun.train.callbacks.EarlyStopping "
                        "takes no argument pateince; did you mean "
                        "callbacks.early_stopping.patience?"),
}


@pytest.mark.parametrize("typo", TYPOS, ids=list(TYPOS))
def test_a_key_nothing_reads_is_one_line_naming_it_and_the_closest(composed, typo):
    whose, key, value, message = TYPOS[typo]
    cfg = with_sections(composed(), **(LAB_SECTIONS if whose == "lab" else LABRUN_SECTIONS))
    OmegaConf.update(cfg, key, value, force_add=True)
    assert refusal(cfg) == message


def test_a_callback_typo_on_the_command_line_names_the_closest_key(composed):
    # Without `+`, Hydra refuses the key itself; the line names what the callback takes,
    # and does not advise adding it with `+`.
    with pytest.raises(Exception) as refused:
        composed("callbacks=early_stopping", "callbacks.early_stopping.pateince=5")
    message = user_error_message(refused.value)
    assert message.startswith("callbacks.early_stopping.pateince: no such key"), message
    assert message.endswith("did you mean callbacks.early_stopping.patience?"), message
    # With `+`, the same line from validation.
    assert refusal(composed("callbacks=early_stopping",
                            "+callbacks.early_stopping.pateince=5")) == TYPOS[
        "callback labrun"][3]


def test_a_target_taking_any_keyword_takes_any_key(composed):
    model = {**LAB_SECTIONS["model"], "_target_": f"{HERE}.takes_anything", "anything": 1}
    validation.validate(with_sections(composed(), **{**LAB_SECTIONS, "model": model}),
                        read_data=False)


def test_a_target_taking_augment_itself_takes_any_key_in_it(composed):
    dataset = {**LAB_SECTIONS["dataset"], "_target_": f"{HERE}.load_own_augment",
               "augment": {"mixup": 0.2}}
    validation.validate(with_sections(composed(), **{**LAB_SECTIONS, "dataset": dataset}),
                        read_data=False)


def test_a_nested_target_is_checked_unless_handed_over_as_it_is(composed):
    backbone = {"_target_": "torch.nn.Linear", "in_feature": 8, "out_features": 4}
    model = {**LAB_SECTIONS["model"], "backbone": backbone}
    cfg = with_sections(composed(), **{**LAB_SECTIONS, "model": model})
    assert refusal(cfg).endswith("torch.nn.Linear takes no argument in_feature; did you mean "
                                 "model.backbone.in_features?")
    # _recursive_: false: instantiate hands the node to the factory, which reads it itself.
    with open_dict(cfg):
        cfg.model._recursive_ = False
    validation.validate(cfg, read_data=False)


def test_an_untrusted_target_is_not_imported_to_check_its_keys(composed, monkeypatch,
                                                                 tmp_path):
    # Importing a module runs its code: one nobody trusts is left alone, its keys unchecked.
    monkeypatch.delenv("LABRUN_TRUSTED_MODULES")
    (tmp_path / "stranger.py").write_text("raise SystemExit('imported')\n"
                                          "def load(path): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    dataset = {**LAB_SECTIONS["dataset"], "_target_": "stranger.load", "pth": "/x"}
    validation.validate(with_sections(composed(), dataset=dataset), read_data=False)
    assert "stranger" not in sys.modules


def test_a_sweeps_job_is_refused_before_any_is_submitted_and_each_shape_checked_once(
        tmp_path, monkeypatch):
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import HydraContext, RunMode

    from labrun.config import keys, schema
    from labrun.core.project import LABRUN_CONF
    from labrun.launch import sweep

    schema.register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(LABRUN_CONF), version_base="1.3"):
        hydra = GlobalHydra.instance().hydra
        master = hydra.compose_config("train", overrides=[
            "hydra.mode=MULTIRUN", f"hydra.sweep.dir={tmp_path}"],
            run_mode=RunMode.MULTIRUN, with_log_configuration=False)
        context = HydraContext(config_loader=hydra.config_loader, callbacks=None)
        checked = []
        check = keys.check_target_sections
        monkeypatch.setattr(keys, "check_target_sections",
                            lambda cfg: checked.append(1) or check(cfg))
        # Seeds and learning rates change no section's keys: one check for three jobs.
        stopping = "callbacks=early_stopping"
        jobs = sweep.plan(context, master, [[stopping, "seed=1", "optimizer.lr=0.1"],
                                            [stopping, "seed=2"], [stopping, "seed=3"]], 0)
        assert len(jobs) == 3 and len(checked) == 1
        with pytest.raises(ConfigError, match="did you mean callbacks.early_stopping.patience"):
            sweep.plan(context, master, [[stopping, "callbacks.early_stopping.patience=2"],
                                         [stopping, "+callbacks.early_stopping.pateince=5"]], 0)
        assert len(checked) == 3  # each job's own section overrides


def test_the_real_command_refuses_a_lab_datasets_typo_before_its_loader_runs(tmp_path):
    """Before, the lab's loader got the keys it names and the typo was dropped: the run
    trained without the setting."""
    (tmp_path / "mylab_data.py").write_text(
        "from pathlib import Path\n\n\n"
        "def load(marker: str, image_size: int):\n"
        "    Path(marker).write_text('loaded')\n"
        "    raise SystemExit(3)\n")
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /dataset: null\n"
        f"dataset:\n  _target_: mylab_data.load\n  name: mine\n  marker: {tmp_path}/loaded\n"
        "  image_size: 32\n  num_workers: 0\n  markr: twice\n")
    result = subprocess.run(
        [PYTHON, "train.py", f"hydra.searchpath=[file://{tmp_path}/conf]", "experiment=mine",
         *FAST, f"hydra.run.dir={tmp_path}/run"],
        cwd=PROJECT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "LABRUN_TRUSTED_MODULES": "mylab_data",
             "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        "error: dataset.markr: no such key in dataset and mylab_data.load takes no argument "
        "markr; did you mean dataset.marker?"]
    assert not (tmp_path / "loaded").exists()
