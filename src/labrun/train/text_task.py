"""task=text_classification: a pretrained transformer (model=hf) fine-tuned on labelled text
(dataset=text), single texts or pairs.

A batch is (input_ids, attention_mask, token_type_ids, labels), padded to its longest text
(data/text/). The loss is cross-entropy summed over the examples: the Trainer divides by the
examples of the whole step, so accumulation and DDP weigh every example alike. Evaluation sums
the loss and a confusion matrix (true x predicted) over batches and ranks, exact in any order,
and reads off it val/acc, macro val/f1 (over the classes present in truth or prediction, as
mean IoU is) and val/f1/CLASS: two processes report one process's figures exactly.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig
    from torch import nn

DATASET = "labrun.data.text.load"
MODEL = "labrun.models.hf.hf_model"


class TextClassification:
    metric_names = ("loss", "acc", "f1")
    deploy = "labrun.tasks.text"  # export, serving and predict (labrun.deploy.hooks)

    def __init__(self) -> None:
        self.class_names: list[str] = []
        self.tokenizer: dict[str, Any] = {}
        self.text: dict[str, Any] = {}  # max_length, pairs, pad_id: what serving tokenizes by
        self.hf: dict[str, Any] = {}  # the snapshot (name, revision) and the model's config

    @property
    def num_sums(self) -> int:
        return 2 + len(self.class_names) ** 2  # summed loss, examples, confusion matrix

    def build_model(self, model_cfg: DictConfig, info: dict[str, Any]) -> nn.Module:
        from labrun import models

        model = models.build(model_cfg, len(info["class_names"]))
        config = model.config.to_dict()
        for key in ("id2label", "label2id"):  # the head's names are the run's class names
            config.pop(key, None)
        self.hf = {**getattr(model, "labrun_snapshot", {}), "config": config}
        return model

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """Refuse, before any data loads, a dataset or model this task cannot take, and a model
        missing from the weights cache (one line naming the command that fetches it)."""
        from labrun.core import hub_cache
        from labrun.core.errors import ConfigError
        from labrun.train import fine_tune_keys

        if cfg.dataset.get("_target_") != DATASET:
            raise ConfigError(f"task=text_classification reads labelled text (dataset=text); "
                              f"dataset {cfg.dataset.get('name')} is not text")
        if cfg.model.get("_target_") != MODEL:
            raise ConfigError(f"task=text_classification fine-tunes a pretrained transformer "
                              f"(model=hf model.name=ID); model {cfg.model.get('_target_')} is "
                              f"not one")
        snapshot = hub_cache.locate(cfg.model.name, cfg.model.get("revision"),
                                    cfg.model.get("weights_cache"))
        config = snapshot.config()
        positions = config.get("max_position_embeddings")
        if positions is not None and cfg.dataset.max_length > positions:
            raise ConfigError(f"dataset.max_length={cfg.dataset.max_length} is beyond the "
                              f"{positions} positions {cfg.model.name} knows; use "
                              f"dataset.max_length<={positions}")
        if cfg.dataset.get("tokenizer") not in (None, cfg.model.name):
            other = hub_cache.locate(cfg.dataset.tokenizer, cfg.dataset.get("revision"),
                                     cfg.dataset.get("weights_cache"))
            from tokenizers import Tokenizer

            vocab = Tokenizer.from_file(str(other.tokenizer_file)).get_vocab_size()
            if vocab > config.get("vocab_size", vocab):
                raise ConfigError(f"dataset.tokenizer={cfg.dataset.tokenizer}: its {vocab:,} "
                                  f"tokens are beyond {cfg.model.name}'s vocabulary of "
                                  f"{config['vocab_size']:,}; tokenize with the model's own "
                                  f"(dataset.tokenizer=null)")
        if fine_tune_keys.asked(cfg):
            from labrun.models import hf
            from labrun.train import fine_tuning

            classes = len(cfg.dataset.class_names or ["a", "b"])
            fine_tuning.check(cfg, lambda: hf.from_config(config, classes), classes)

    def setup(self, info: dict[str, Any], device: torch.device,
              memory_format: torch.memory_format) -> None:
        self.class_names = list(info["class_names"])
        self.tokenizer = dict(info["tokenizer"])
        self.text = {"max_length": int(info["max_length"]), "pairs": bool(info["pairs"]),
                     "pad_id": int(info["pad_id"])}

    def prepare(self, batch: tuple[torch.Tensor, ...], device: torch.device
                ) -> tuple[torch.Tensor, ...]:
        non_blocking = device.type == "cuda"
        return tuple(t.to(device, non_blocking=non_blocking) for t in batch)

    def count(self, batch: tuple[torch.Tensor, ...]) -> int:
        return len(batch[3])  # examples: every rank's micro-batches hold as many

    def tally(self, batch: tuple[torch.Tensor, ...]) -> dict[str, int]:
        """The batch's tokens and its padding, on the host (perf/tokens_per_s,
        perf/padding_frac)."""
        mask = batch[1]
        tokens = int(mask.sum())
        return {"tokens": tokens, "padding": mask.numel() - tokens}

    def logits(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        ids, mask, types, _ = batch
        extra = {"token_type_ids": types} if takes_token_types(model) else {}
        return model(input_ids=ids, attention_mask=mask, **extra).logits

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        import torch.nn.functional as F  # noqa: N812 - torch's own name for it

        return F.cross_entropy(self.logits(model, batch).float(), batch[3], reduction="sum")

    def eval_sums(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """[summed loss, examples, confusion matrix (true x predicted, flattened)], float64
        where the device has it (MPS has not)."""
        import torch
        import torch.nn.functional as F  # noqa: N812

        labels = batch[3]
        logits = self.logits(model, batch).float()
        classes = logits.shape[1]
        confusion = torch.bincount(labels * classes + logits.argmax(dim=1),
                                   minlength=classes * classes)
        dtype = torch.float32 if logits.device.type == "mps" else torch.float64
        loss = F.cross_entropy(logits, labels, reduction="sum")
        return torch.cat([torch.stack([loss.to(dtype), torch.tensor(float(len(labels)),
                                                                     dtype=dtype,
                                                                     device=logits.device)]),
                          confusion.to(dtype)])

    def eval_metrics(self, sums: torch.Tensor, split: str) -> dict[str, float]:
        loss, count = sums[:2].tolist()
        confusion = sums[2:].view(len(self.class_names), -1).double()
        hits = confusion.diagonal()
        # F1 = 2 TP / (2 TP + FP + FN): of each class present in truth or prediction.
        truth, predicted = confusion.sum(1), confusion.sum(0)
        present = (truth + predicted) > 0
        f1 = 2 * hits / (truth + predicted).clamp(min=1)
        macro = f1[present].mean().item() if present.any() else 0.0
        values = (loss / max(count, 1.0), hits.sum().item() / max(count, 1.0), macro)
        metrics = {f"{split}/{name}": value
                   for name, value in zip(self.metric_names, values, strict=True)}
        metrics.update({f"{split}/f1/{name}": value
                        for name, value in zip(self.class_names, f1.tolist(), strict=True)})
        return metrics

    def checkpoint_meta(self) -> dict[str, Any]:
        # Export and serving read these with the checkpoint alone: the tokenizer file's text,
        # how texts were cut and padded, and the model's config (no cache needed to rebuild it).
        return {"task": "text_classification", "class_names": self.class_names,
                "tokenizer": self.tokenizer, "text": self.text, "hf": self.hf}


@functools.lru_cache(maxsize=8)
def _forward_takes_token_types(model_class: type) -> bool:
    return "token_type_ids" in inspect.signature(model_class.forward).parameters


def takes_token_types(model: nn.Module) -> bool:
    """Whether the model's forward takes token types (BERT's do; DistilBERT's do not)."""
    from labrun.models import unwrap

    return _forward_takes_token_types(type(unwrap(model)))
