"""The `_target_` seams of issue 12: callbacks (early stopping and a lab's own class), a lab's
own dataset format and logger backend, a timm model, and the typed checkpoint."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
import torch

from conftest import PROJECT, read_metrics, read_summary, run_train

# A lab's own code, outside labrun: written into a folder that goes on the path.
LAB_MODULE = textwrap.dedent('''
    import json

    import numpy as np

    from labrun.data.image.sources import ArraySource
    from labrun.train.callbacks import Callback


    class CountHooks(Callback):
        """Counts each hook's calls; writes them at fit end; keeps a count in checkpoints."""

        def __init__(self, out):
            self.out, self.calls, self.fits = out, {}, 0

        def _count(self, hook):
            self.calls[hook] = self.calls.get(hook, 0) + 1

        def on_fit_start(self, trainer):
            self._count("on_fit_start")
            self.fits += 1

        def on_step_end(self, trainer):
            self._count("on_step_end")

        def on_epoch_end(self, trainer, metrics):
            self._count("on_epoch_end")
            assert "val/acc" in metrics and trainer.epoch >= 1

        def on_fit_end(self, trainer, status):
            self._count("on_fit_end")
            with open(self.out, "w") as f:
                json.dump({"calls": self.calls, "fits": self.fits, "status": status}, f)

        def state_dict(self):
            return {"fits": self.fits}

        def load_state_dict(self, state):
            self.fits = state["fits"]


    def load_stripes(image_size, num_train=64):
        """A dataset format: two classes of striped images."""
        rng = np.random.default_rng(0)
        def split(n):
            labels = np.arange(n) % 2
            images = rng.integers(0, 60, (n, image_size, image_size, 3), dtype=np.uint8)
            images[labels == 1, ::2] += 150
            return ArraySource(images, labels, "stripes", ["plain", "striped"])
        return {"train": split(num_train), "val": split(32)}


    class ListTracker:
        """A logger backend: every logged point in a list."""

        run_id = None
        created = []

        def __init__(self, run_dir, project):
            self.run_dir, self.project, self.points = run_dir, project, []
            ListTracker.created.append(self)

        def log(self, metrics, step):
            self.points.append((step, metrics))

        def finish(self, status, summary):
            self.status = status
''')


@pytest.fixture
def lab_path(tmp_path, monkeypatch):
    """A folder holding the lab's module `labcode`, importable here and in train.py."""
    folder = tmp_path / "lab"
    folder.mkdir()
    (folder / "labcode.py").write_text(LAB_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop("labcode", None)
    return folder


def early_stopping_run(run_dir, *extra):
    # min_delta far above any gain: the second epoch cannot improve enough, so patience=1
    # stops the run after epoch 2 of 6.
    return run_train("trainer.max_epochs=6", "trainer.limit_train_batches=4",
                     "callbacks=early_stopping", "callbacks.early_stopping.patience=1",
                     "callbacks.early_stopping.min_delta=0.9", *extra, run_dir=run_dir)


def test_early_stopping_stops_completed_and_stays_stopped(tmp_path):
    run_dir = tmp_path / "run"
    result = early_stopping_run(run_dir)
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["epoch"] == 2, summary
    reason = summary["stopped_early"]
    assert reason.startswith("val/acc did not improve by 0.9 for 1 epoch (best "), reason
    assert reason.endswith(" at epoch 1)"), reason
    assert f"stopped early: {reason}" in result.stdout
    assert f"stopped early: {reason}" in (run_dir / "train.log").read_text()  # Hydra's log file
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert state["callbacks"]["early_stopping"]["reason"] == reason
    rows = len(read_metrics(run_dir))

    again = early_stopping_run(run_dir)  # checkpoint.resume=auto: the same folder again
    assert "resuming from" in again.stdout
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["epoch"] == 2
    assert summary["step"] == state["step"] and summary["stopped_early"] == reason
    assert len(read_metrics(run_dir)) == rows  # no step trained


def test_on_a_step_budget_early_stopping_counts_validations_mid_epoch(tmp_path):
    """A budget of 12 steps validated every 4, all inside digits' first epoch (22 steps): the
    validation at step 8 cannot improve by 0.9, so patience=1 stops the run there."""
    run_dir = tmp_path / "run"
    run_train("trainer.max_steps=12", "trainer.val_every_n_steps=4", "callbacks=early_stopping",
              "callbacks.early_stopping.patience=1", "callbacks.early_stopping.min_delta=0.9",
              run_dir=run_dir)
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and (summary["step"], summary["epoch"]) == (8, 0)
    reason = summary["stopped_early"]
    assert reason.startswith("val/acc did not improve by 0.9 for 1 validation (best "), reason
    assert reason.endswith(" at step 4)"), reason
    assert [row["step"] for row in read_metrics(run_dir) if "val/acc" in row] == [4, 8]


def test_a_labs_callback_gets_every_hook(tmp_path, lab_path):
    out = tmp_path / "calls.json"
    env = {"PYTHONPATH": os.pathsep.join([str(lab_path), os.environ.get("PYTHONPATH", "")])}
    common = ["trainer.limit_train_batches=3", "+callbacks.count._target_=labcode.CountHooks",
              f"+callbacks.count.out={out}"]
    run_train("trainer.max_epochs=2", *common, run_dir=tmp_path / "run", env=env)
    counted = json.loads(out.read_text())
    assert counted["status"] == "completed"
    assert counted["calls"] == {"on_fit_start": 1, "on_step_end": 6, "on_epoch_end": 2,
                                "on_fit_end": 1}
    # Its state went into the checkpoint and comes back on resume (one more epoch).
    run_train("trainer.max_epochs=3", *common, run_dir=tmp_path / "run", env=env)
    counted = json.loads(out.read_text())
    assert counted["fits"] == 2 and counted["calls"]["on_step_end"] == 3


def test_a_labs_dataset_format_and_logger_backend(composed, lab_path, tmp_path):
    from labrun import data
    from labrun.track import loggers

    cfg = composed("dataset=synthetic", "dataset._target_=labcode.load_stripes",
                   "dataset.num_train=64", "logger=csv", "logger._target_=labcode.ListTracker",
                   "logger.project=p1")
    built = data.build(cfg.dataset)
    assert built.class_names == ["plain", "striped"] and len(built.splits["train"]) == 64
    tracker = loggers.build(cfg, tmp_path, is_main=True)
    tracker.log({"x": 1.0}, step=3)
    assert type(tracker).__name__ == "ListTracker" and tracker.project == "p1"
    assert tracker.run_dir == tmp_path and tracker.points == [(3, {"x": 1.0})]
    assert type(loggers.build(cfg, tmp_path, is_main=False)).__name__ == "NoTracker"


def test_timm_model_through_the_config(composed):
    from labrun import models
    from labrun.config import validation

    cfg = composed("model=timm", "model.name=resnet10t", "model.drop_rate=0.1")
    validation.validate(cfg)
    model = models.build(cfg.model, num_classes=7).eval()
    assert type(model).__module__.startswith("timm.")
    with torch.no_grad():
        assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 7)


def test_unknown_timm_name_is_a_config_error(composed):
    from labrun import models
    from labrun.core.errors import ConfigError

    with pytest.raises(ConfigError, match="model.name=resnet_nope is not a timm model"):
        models.build(composed("model=timm", "model.name=resnet_nope").model, num_classes=2)


def test_checkpoint_holds_exactly_the_typed_keys(digits_run):
    from labrun.train.checkpoint import CheckpointState, load

    state = load(digits_run / "checkpoints" / "last.pt")
    only_with_ema = {"ema", "inference_weights"}  # trainer.ema's; digits_run trains without
    typed = CheckpointState.__required_keys__ | CheckpointState.__optional_keys__
    assert only_with_ema <= typed and set(state) == typed - only_with_ema


def docs_block(heading: str, language: str) -> str:
    """The first ```language block under `heading` in docs/plugins.md, as a reader copies it."""
    text = (PROJECT / "docs" / "plugins.md").read_text()
    section = text[text.index(heading):]
    body = section[section.index(f"```{language}\n") + len(language) + 4:]
    return textwrap.dedent(body[:body.index("```")])


def test_the_task_recipe_of_the_plugins_page_trains_as_written(tmp_path):
    """docs/plugins.md "Add a task": its class in the lab's package (mylab/tasks.py), its YAML
    in the lab's own config folder (on Hydra's search path), chosen with task=NAME."""
    (tmp_path / "mylab").mkdir()
    (tmp_path / "mylab" / "__init__.py").write_text("")
    (tmp_path / "mylab" / "tasks.py").write_text(docs_block("## Add a task", "python"))
    (tmp_path / "conf" / "task").mkdir(parents=True)
    (tmp_path / "conf" / "task" / "label_smoothing.yaml").write_text(
        docs_block("`conf/task/label_smoothing.yaml`", "yaml"))
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    short = ["trainer.max_epochs=1", "trainer.limit_train_batches=2",
             "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1"]
    run_train(f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "task=label_smoothing", *short,
              run_dir=tmp_path / "smoothed", env=env)
    run_train(*short, run_dir=tmp_path / "plain")
    assert read_summary(tmp_path / "smoothed")["status"] == "completed"
    # The same first batch and weights: only the loss differs, by the smoothing.
    first = [read_metrics(tmp_path / name)[0]["train/loss"] for name in ("smoothed", "plain")]
    assert first[0] != first[1], first
