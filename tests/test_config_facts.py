"""Facts on the schema (issue 12, step 4): each field states whether it is a path, whether it may
change on resume and whether it changes the result; every key list the code uses is derived
from them, so a new field declares its facts once, where it is written."""

from __future__ import annotations

import dataclasses
import os

import pytest
from omegaconf import MISSING, OmegaConf

from labrun.config import dataset_schema, facts, schema, validation
from labrun.config.fields import key
from labrun.core.errors import ConfigError


@pytest.fixture
def fresh_facts():
    facts.all_facts.cache_clear()
    yield
    facts.all_facts.cache_clear()


def test_result_changing_keys_are_told_apart_from_bookkeeping():
    # The issue's own examples, plus a key that inherits from its section (logger.*).
    for dotted in ("trainer.max_epochs", "dataset.root", "optimizer.lr", "model.init_from",
                   "model.pretrained", "model.freeze", "optimizer.groups",
                   "optimizer.backbone_lr_mult"):
        assert facts.facts_of(dotted).affects_result, dotted
    # Where the weights sit, and whether a run may fetch them, change no result: each run
    # records the sha256 of the file it loaded.
    for dotted in ("trainer.progress", "checkpoint.keep_last", "logger.project", "paths.output_root",
                   "cluster.partition", "dataset.num_workers", "paths.weights_cache",
                   "model.download"):
        assert not facts.facts_of(dotted).affects_result, dotted


def test_resume_check_ignores_resume_safe_keys_and_names_the_others():
    old = {"optimizer": {"lr": 0.1}, "trainer": {"max_epochs": 3, "progress": "bar", "seed": 1},
           "logger": {"name": "wandb", "project": "a"}, "dataset": {"root": "/old", "image_size": 32}}
    new = {"optimizer": {"lr": 0.2}, "trainer": {"max_epochs": 9, "progress": "log", "seed": 1},
           "logger": {"name": "csv", "project": "b"}, "dataset": {"root": "/new", "image_size": 64}}
    assert facts.changed_keys(old, new, ignore_resume_safe=True) == ["dataset.image_size",
                                                                     "optimizer.lr"]
    assert "logger.name" in facts.changed_keys(old, new)


def test_a_new_field_states_its_facts_once(monkeypatch, fresh_facts, composed, tmp_path):
    """A schema field declared with key(must_exist=True) is checked by validate() and made
    absolute for SLURM jobs without touching any list elsewhere."""

    @dataclasses.dataclass
    class ShardedConfig(dataset_schema.ImageDatasetConfig):
        shard_dir: str = key(MISSING, must_exist=True, resume_safe=True)

    monkeypatch.setitem(schema.SCHEMAS, "dataset/sharded", ShardedConfig)
    assert "dataset.shard_dir" in facts.must_exist_keys()
    assert "dataset.shard_dir" in facts.path_keys()
    assert facts.facts_of("dataset.shard_dir").resume_safe

    # A plain copy: the composed digits option has no such field to set. Its loader, the
    # format's, reads it (keys no loader reads are refused: config/keys.py).
    cfg = OmegaConf.create(OmegaConf.to_container(composed(), resolve=True))
    monkeypatch.setenv("LABRUN_TRUSTED_MODULES", __name__)
    cfg.dataset._target_ = f"{__name__}.load_shards"
    cfg.dataset.shard_dir = str(tmp_path / "no-such-folder")
    with pytest.raises(ConfigError, match=r"dataset.shard_dir=.*no such file or folder"):
        validation.validate(cfg)
    cfg.dataset.shard_dir = str(tmp_path)
    validation.validate(cfg)


def load_shards(shard_dir: str) -> None:
    """The loader of test_a_new_field_states_its_facts_once's format."""


def test_slurm_jobs_get_every_path_key_absolute(composed, tmp_path, monkeypatch):
    from labrun.launch import slurm_job

    # The job runs in the code snapshot's folder: its paths are the submitting folder's.
    (tmp_path / "snapshot").mkdir()
    monkeypatch.chdir(tmp_path / "snapshot")
    (tmp_path / "data.h5").write_bytes(b"")
    cfg = composed("dataset=hdf5", "dataset.path=data.h5", "paths.data_dir=shared/data",
                   "paths.scratch_dir=scratch", "checkpoint.resume=auto")
    OmegaConf.set_struct(cfg, False)
    cfg.hydra = {"sweep": {"dir": "x"}}
    slurm_job.make_paths_absolute(cfg, tmp_path / "sweep", str(tmp_path))
    assert cfg.dataset.path == str(tmp_path / "data.h5")
    for dotted in ("dataset.path", "paths.data_dir", "paths.scratch_dir"):
        value = OmegaConf.select(cfg, dotted)
        assert os.path.isabs(value) and value.startswith(str(tmp_path)), (dotted, value)
    assert cfg.checkpoint.resume == "auto"  # a keyword, not a path


def test_a_checkpoint_of_an_older_labrun_still_resumes(composed):
    """Checkpoints written before the task/callbacks groups and the rooms existed lack those
    keys and name the schedule by its old module: they resume; a real change still refuses."""
    from labrun.train.job import with_newer_keys

    current = OmegaConf.to_container(composed(), resolve=True)
    saved = {k: v for k, v in current.items() if k not in ("task", "callbacks")}
    saved["dataset"] = {k: v for k, v in current["dataset"].items() if k != "_target_"}
    old_target = current["schedule"]["_target_"].replace("labrun.train.schedules.",
                                                          "labrun.schedules.")
    saved["schedule"] = {**current["schedule"], "_target_": old_target}
    assert facts.changed_keys(saved, current, ignore_resume_safe=True)  # without the upgrade
    assert facts.changed_keys(with_newer_keys(saved, current), current,
                              ignore_resume_safe=True) == []
    saved["optimizer"] = {**current["optimizer"], "lr": current["optimizer"]["lr"] * 2}
    assert facts.changed_keys(with_newer_keys(saved, current), current,
                              ignore_resume_safe=True) == ["optimizer.lr"]
