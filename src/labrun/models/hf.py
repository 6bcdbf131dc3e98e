"""Hugging Face transformers for text classification (`model=hf model.name=ID`), found offline.

A run never reaches the hub. It reads the snapshot `labrun weights fetch model=hf
model.name=ID` left in the hub cache's own layout (labrun.core.hub_cache, first under the lab's
`paths.weights_cache`, then under the user's HF_HOME), and gives transformers the snapshot's
folder, a local path (`local_files_only=True` besides), so nothing is looked up by name.

What labrun loads is limited to what cannot run code: weights in safetensors (a pickled
`pytorch_model.bin` alone is refused), and no model whose config asks for its own code
(`auto_map`: transformers' trust_remote_code, which labrun never sets). The revision is
pinned: `model.revision` (a commit, a branch or a tag) or refs/main's commit, resolved once and
recorded in every checkpoint.

transformers is an optional extra (`pip install labrun[nlp]`): imported only here, and only
when a model is built; looking a snapshot up needs the file system alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from labrun.core.errors import ConfigError
from labrun.core.hub_cache import locate  # the snapshot's layout and checks: the cache's

if TYPE_CHECKING:
    from torch import nn

INSTALL = "pip install 'labrun[nlp]'"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"model=hf needs Hugging Face transformers, which this environment "
                          f"lacks: {INSTALL}") from None
    transformers.logging.set_verbosity_error()  # "newly initialized" heads: expected here
    transformers.logging.disable_progress_bar()  # a bar per load, in every job's log
    return transformers


def hf_model(num_classes: int, name: str, revision: str | None = None,
             weights_cache: str | None = None, dropout: float | None = None) -> nn.Module:
    """`name`'s pretrained body with a classification head for `num_classes` classes (newly
    initialised where the snapshot's head has another size, or none), loaded from its snapshot
    with nothing looked up on the hub."""
    transformers = _transformers()
    snapshot = locate(name, revision, weights_cache)
    # BERT's names (RoBERTa, ELECTRA... share them): the hidden layers' and the attention's.
    extra = ({} if dropout is None else
             {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout})
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(snapshot.folder), num_labels=num_classes, local_files_only=True,
        use_safetensors=True, trust_remote_code=False, ignore_mismatched_sizes=True, **extra)
    from huggingface_hub import constants

    # What the task records in its checkpoints: the snapshot, and that the hub was off while
    # this process loaded it (the job's switch, train/job.py, held whatever came first).
    model.labrun_snapshot = {**snapshot.record(), "offline": constants.HF_HUB_OFFLINE}
    return model


def from_config(config: dict[str, Any], num_classes: int) -> nn.Module:
    """The same model, randomly initialised, from its config alone (a checkpoint's: export and
    serving never need the cache; validation builds it on the meta device)."""
    transformers = _transformers()
    hf_config = transformers.AutoConfig.for_model(**{**config, "num_labels": num_classes})
    return transformers.AutoModelForSequenceClassification.from_config(hf_config)
