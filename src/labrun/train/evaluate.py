"""`labrun eval`: a run's checkpoint evaluated on any split of its own dataset or of another
one, with the task's metrics, as the Trainer evaluates (on the CPU or a GPU; in N processes
with trainer.devices=N).

    config (the run's own overrides + the command line's) -> data -> the task's model with the
    checkpoint's weights -> evaluation_sums (the Trainer's loop) over the whole split -> the task's
    eval_metrics: {SPLIT/NAME: value}, with the number of processes whose sums were added

What it writes is the CLI's (RunDir.write_eval): nothing here touches the run folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from labrun import data
from labrun.core.errors import ConfigError, DataError, LabrunError, one_line
from labrun.train import distributed
from labrun.train.checkpoint import inference_weights
from labrun.train.checkpoint import load as load_checkpoint
from labrun.train.evaluation import evaluation_sums
from labrun.train.precision import Precision


def evaluate(cfg: DictConfig, checkpoint: Path, split: str) -> dict[str, Any]:
    """{"metrics": the checkpoint's metrics on `split`, "world_size": the processes that
    evaluated it}; trainer.devices=N starts N processes."""
    resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    if distributed.launched_as_one_process(cfg.trainer):
        outcome = distributed.run_processes(cfg.trainer.devices, _worker, resolved,
                                            str(checkpoint), split)
        if "error" in outcome:
            raise LabrunError(outcome["error"])
        return outcome
    return _evaluate(resolved, checkpoint, split)


def _worker(cfg: DictConfig, checkpoint: str, split: str) -> dict[str, Any]:
    try:
        return _evaluate(cfg, Path(checkpoint), split)
    except LabrunError as error:
        return {"error": one_line(error)}


def _evaluate(cfg: DictConfig, checkpoint: Path, split: str) -> dict[str, Any]:
    state = load_checkpoint(checkpoint)
    dist = distributed.setup(cfg.trainer, cfg.distributed)
    try:
        dataset = data.build(cfg.dataset)
        splits = getattr(dataset, "splits", None)
        if splits is not None and split not in splits:
            raise DataError(f"dataset {cfg.dataset.name} has no {split} split; its splits: "
                            f"{', '.join(splits)}")
        check_fits(state, dataset.info, checkpoint, cfg.dataset.name)
        task = instantiate(cfg.task)
        model = task.build_model(cfg.model, dataset.info)
        model.load_state_dict(inference_weights(state))  # the EMA's, when the run kept one
        trainer = cfg.trainer
        memory_format = (torch.channels_last if trainer.channels_last
                         else torch.contiguous_format)
        model = model.to(dist.device).to(memory_format=memory_format)
        task.setup(dataset.info, dist.device, memory_format)
        micro = trainer.batch_size // dist.world_size
        if trainer.micro_batch_size != "auto":
            micro = int(trainer.micro_batch_size)
        loader = dataset.loader(split, micro_batch_size=micro, seed=cfg.seed, rank=dist.rank,
                                world_size=dist.world_size,
                                pin_memory=dist.device.type == "cuda")
        precision = Precision(cfg.precision.name, dist.device, cfg.precision.init_scale)
        sums = evaluation_sums(model, task, loader, dist.device, precision.autocast,
                               distributed=dist.enabled)
        # Counted by an all-reduce, as the sums were, rather than read from the config: the
        # record says how many processes' shards the metrics add up.
        ranks = distributed.all_reduce_sum(torch.ones(1, device=dist.device))
        return {"metrics": task.eval_metrics(sums, split), "world_size": int(ranks.item())}
    finally:
        distributed.cleanup()


def check_fits(state: dict[str, Any], info: dict[str, Any], checkpoint: Path,
               dataset: str) -> None:
    """Refuse, in one line naming both, a checkpoint of other classes or another vocabulary
    than the data's: its outputs would mean other things."""
    theirs, ours = list(state.get("class_names") or []), list(info.get("class_names") or [])
    if theirs != ours and (theirs or ours):
        raise ConfigError(f"{checkpoint} was trained on {len(theirs)} classes "
                          f"({_names(theirs)}), dataset {dataset} has {len(ours)} "
                          f"({_names(ours)}): its outputs mean other classes")
    vocab = state.get("vocab_size")
    if vocab is not None and info.get("vocab_size") not in (None, vocab):
        raise ConfigError(f"{checkpoint} was trained on a vocabulary of {vocab}, dataset "
                          f"{dataset} has {info['vocab_size']}: its token ids mean other text")


def _names(names: list[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
