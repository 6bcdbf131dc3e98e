"""launch/compose.JobComposer gives each job of a sweep the config Hydra's own load_sweep_config
composes for it, while composing each distinct config-group choice once (a 1,500-job sweep
would otherwise spend minutes composing). Both ways, in this process, for a sweep over a group
(model=simple_cnn,resnet18), a value, a dict merged into a group's node and an interpolation
of the job's number."""

from __future__ import annotations

import itertools

import pytest
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

from conftest import sweep_in_process
from labrun.launch.compose import JobComposer

JOBS = [["model=" + model, f"optimizer.lr={lr}", "seed=${hydra:job.num}",
         "+optimizer.extra={betas:[0.8,0.9]}" if lr == 0.1 else "dataset.num_workers=1"]
        for model, lr in itertools.product(["simple_cnn", "resnet18"], [0.1, 0.01])]


@pytest.fixture
def hydra_parts(tmp_path):
    with sweep_in_process(tmp_path, "cluster=slurm_dev") as parts:
        yield parts


def resolved(cfg, num: int) -> dict:
    """The job's own keys (all but hydra's) resolved, with hydra.job.num set as plan() sets it
    and the output folder as run_job sets it."""
    with open_dict(cfg.hydra):
        cfg.hydra.job.num = num
        cfg.hydra.runtime.output_dir = f"{cfg.hydra.sweep.dir}/{num}"
    HydraConfig.instance().set_config(cfg)
    return OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]),
                                  resolve=True)


def test_each_job_is_composed_as_hydra_composes_it(hydra_parts):
    context, master = hydra_parts
    composer = JobComposer(context, master)
    for num, overrides in enumerate(JOBS):
        ours = composer(overrides)
        hydras = context.config_loader.load_sweep_config(master, overrides)
        assert OmegaConf.to_container(ours) == OmegaConf.to_container(hydras), overrides
        # And resolved, as the job resolves it once hydra.job.num is set.
        mine = resolved(ours, num)
        assert mine == resolved(hydras, num) and mine["seed"] == num
    # One composition per model: the jobs of each share it.
    assert len(composer.composed) == 2


def test_value_overrides_every_job_shares_are_applied_once_with_the_same_result(hydra_parts):
    # A grid's fixed overrides come first: composed with the group choice, once per model.
    context, master = hydra_parts
    composer = JobComposer(context, master)
    jobs = [["trainer.max_epochs=2", "+cluster.extra_sbatch.hold=true", *overrides]
            for overrides in JOBS]
    shared = composer.shared_values(jobs)
    assert shared == 2
    for num, overrides in enumerate(jobs):
        ours = composer(overrides, shared)
        hydras = context.config_loader.load_sweep_config(master, overrides)
        assert OmegaConf.to_container(ours) == OmegaConf.to_container(hydras), overrides
        assert resolved(ours, num) == resolved(hydras, num)
    assert sorted(composer.composed) == [
        (("model=" + model,), ("trainer.max_epochs=2", "+cluster.extra_sbatch.hold=true"))
        for model in ("resnet18", "simple_cnn")]
    assert composer.shared_values(jobs[:1]) == 0  # one job: nothing to share


def test_a_bad_value_override_fails_as_hydra_fails(hydra_parts):
    from hydra.errors import ConfigCompositionException

    context, master = hydra_parts
    composer = JobComposer(context, master)
    for compose in (composer, lambda o: context.config_loader.load_sweep_config(master, o)):
        with pytest.raises(ConfigCompositionException, match="optimizer.lrr"):
            compose(["model=resnet18", "optimizer.lrr=0.1"])
