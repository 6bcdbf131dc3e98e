"""A text classifier's export (labrun export of a task=text_classification run): the plan
(token ids, attention mask and token types in, logits out, batch and sequence dynamic), its
parity check on the run's val texts, the metadata serving reads; and `--format hf`, a folder
transformers loads."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from labrun.core.errors import LabrunError, one_line
from labrun.deploy.export import Exported, LogitsParity, Plan, Target, build_data

log = logging.getLogger(__name__)

TASK = "text_classification"
PARITY_TEXTS = 16
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# What transformers' save_pretrained and a tokenizer's save_pretrained write: an existing
# --out folder holding only these is an earlier export, replaced; any other is refused.
HF_FILES = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"}
# The special tokens of a transformers tokenizer, by role, as BERT's and RoBERTa's vocabularies
# spell them: the roles whose token the tokenizer has are set on the exported one.
SPECIAL_TOKENS = {"pad_token": ("[PAD]", "<pad>"), "unk_token": ("[UNK]", "<unk>"),
                  "cls_token": ("[CLS]", "<s>"), "sep_token": ("[SEP]", "</s>"),
                  "mask_token": ("[MASK]", "<mask>")}


class Logits(torch.nn.Module):
    """A transformers classifier as an exporter sees it: tensors in, logits out (its output is
    a ModelOutput, and a model without token types takes none)."""

    def __init__(self, model: torch.nn.Module, token_types: bool):
        super().__init__()
        self.model, self.token_types = model, token_types

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        extra = {"token_type_ids": token_type_ids} if self.token_types else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **extra).logits


def build_model(state: dict[str, Any], checkpoint: Path) -> torch.nn.Module:
    """The checkpoint's classifier in eager PyTorch, built from the transformers config it
    carries (never from the weights cache, which the run's config names and which need not
    exist where it is exported), with its inference weights."""
    from labrun.models import hf

    missing = [key for key in ("class_names", "tokenizer", "text", "hf") if key not in state]
    if missing or "config" not in state.get("hf", {}):
        raise LabrunError(f"{checkpoint}: a text classifier's checkpoint without "
                          f"{', '.join(missing) or 'hf.config'}; train the run again with this "
                          f"labrun (labrun rerun RUN_DIR --exec)")
    model = hf.from_config(dict(state["hf"]["config"]), len(state["class_names"]))
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as error:
        raise LabrunError(f"{checkpoint}: the weights do not fit the model its config builds "
                          f"({one_line(error)})") from None
    return model.eval()


def export_plan(state: dict[str, Any], checkpoint: Path, target: Target) -> Plan:
    """Token ids, attention mask (and token types) in, class logits out, batch and sequence
    dynamic; checked on the run's val texts."""
    from labrun.train.text_task import takes_token_types

    model = build_model(state, checkpoint)
    token_types = takes_token_types(model)
    config = state["hf"]["config"]
    # The longest sequence: what the position embedding knows (a longer one is the model's
    # own error); the tokenizer cuts texts at max_length, below it.
    longest = config.get("max_position_embeddings")
    check = None
    if target.check_data is not None:
        batches = parity_batches(state, target.check_data)

        def check(path: Path, reference: torch.nn.Module) -> dict[str, Any]:
            return parity(path, target, reference, batches)

    length = min(int(state["text"]["max_length"]), longest or 1 << 30)
    example = example_input(int(config.get("vocab_size", 2)), length,
                            int(state["text"]["pad_id"]), token_types)
    return Plan(Logits(model, token_types).eval(),
                tuple(t.to(target.device) for t in example),
                {0: ("batch", None), 1: ("sequence", longest)}, check, report_parity,
                metadata(state, token_types), inputs=INPUTS[:len(example)])


def example_input(vocab_size: int, length: int, pad_id: int, token_types: bool
                  ) -> tuple[torch.Tensor, ...]:
    """Two texts to trace with, of `length` tokens and of half as many padded to it (sizes
    other than 0 and 1, which torch.export would take for constants; padding, so that no
    exporter specialises the graph to a mask of ones)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (2, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, length // 2:] = 0
    ids[1, length // 2:] = pad_id
    return (ids, mask, torch.zeros_like(ids))[:3 if token_types else 2]


def parity_batches(state: dict[str, Any], data: str) -> tuple[tuple[torch.Tensor, ...], str]:
    """A batch of (input_ids, attention_mask, token_type_ids) as the run's val loader makes it,
    or of seeded random ids when the val texts cannot be read; with where they came from."""
    reason = "random input requested"
    if data == "val":
        try:
            dataset = state["config"].get("dataset", {})
            loader = build_data(dataset).loader("val", micro_batch_size=PARITY_TEXTS, seed=0)
            ids, mask, types, _ = next(iter(loader))
            return (ids, mask, types), f"{len(ids)} val texts of {dataset.get('path')}"
        except Exception as error:  # noqa: BLE001 - any data problem falls back to random ids
            reason = f"validation texts unavailable: {one_line(error)}"
    generator = torch.Generator().manual_seed(0)
    vocab = int(state["hf"]["config"].get("vocab_size", 2))
    lengths = torch.randint(2, int(state["text"]["max_length"]) + 1, (PARITY_TEXTS,),
                            generator=generator)
    width = int(lengths.max())
    mask = (torch.arange(width) < lengths[:, None]).long()
    ids = torch.randint(0, vocab, (PARITY_TEXTS, width), generator=generator)
    ids = ids.where(mask.bool(), int(state["text"]["pad_id"]))
    return (ids, mask, torch.zeros_like(ids)), f"{PARITY_TEXTS} random texts ({reason})"


def parity(path: Path, target: Target, reference: torch.nn.Module,
           batches: tuple[tuple[torch.Tensor, ...], str]) -> dict[str, Any]:
    """The exported file in its own runtime against the eager fp32 model: the whole batch,
    padded to its longest text, and its shortest text alone at its own length. Two batch sizes
    and two lengths prove both axes dynamic; the padded rows prove the mask is honoured.

    The tolerance is relative to the largest eager logit (at least 1); a top-1 flip counts
    only where the eager top two are further apart than twice what it allows."""
    (ids, mask, types), texts_from = batches
    shortest = int(mask.sum(1).argmin())
    own = int(mask[shortest].sum())
    inputs = 3 if reference.token_types else 2
    run = target.runtime(path)
    logits, shapes = LogitsParity(target.tolerance), []
    for batch in ((ids, mask, types), tuple(t[shortest:shortest + 1, :own]
                                            for t in (ids, mask, types))):
        batch = batch[:inputs]
        with torch.inference_mode():
            eager = reference(*(t.to(target.device) for t in batch)).float().cpu()
        logits.add(torch.from_numpy(run(*(t.numpy() for t in batch))), eager)
        shapes.append(list(batch[0].shape))
    return {"texts": len(ids), "texts_from": texts_from, "shapes": shapes, **logits.figures(),
            "failure": None if logits.passed else (
                f"parity check failed: max abs diff {logits.max_abs_diff:.2e} > "
                f"{logits.tolerance:.2e} or top-1 differs on {logits.top1_mismatches} "
                f"text(s)")}


def report_parity(check: dict[str, Any], exporter: str) -> None:
    verdict = "ok" if check["passed"] else "FAILED"
    shapes = " and ".join("x".join(map(str, shape)) for shape in check["shapes"])
    log.info(f"parity ({exporter}): {check['texts_from']}, token ids {shapes}: max abs diff "
             f"{check['max_abs_diff']:.2e} (tolerance {check['tolerance']:.2e}), top-1 agrees "
             f"on {check['top1_agree']}/{check['positions']} -> {verdict}")


def metadata(state: dict[str, Any], token_types: bool) -> dict[str, Any]:
    """What the export's metadata carries for serving, beside the keys every export has."""
    names, text = list(state["class_names"]), state["text"]
    inputs = INPUTS[:3 if token_types else 2]
    return {"inputs": [{"name": name, "shape": ["batch", "sequence"], "dtype": "int64"}
                       for name in inputs],
            "output": {"name": "logits", "shape": ["batch", len(names)]},
            "class_names": names, "num_classes": len(names),
            "tokenizer": dict(state["tokenizer"]), "max_length": int(text["max_length"]),
            "pairs": bool(text["pairs"]), "pad_id": int(text["pad_id"]),
            "token_types": token_types,
            "hf": {key: state["hf"].get(key) for key in ("name", "revision")}}


def export_hf(state: dict[str, Any], checkpoint: Path, out: Path) -> Exported:
    """The classifier and its tokenizer as transformers' save_pretrained writes them, the
    labels named: AutoModelForSequenceClassification.from_pretrained(out) and
    AutoTokenizer.from_pretrained(out) load them, with no labrun."""
    from labrun.train.text_task import takes_token_types

    if out.exists() and not (out.is_dir() and {p.name for p in out.iterdir()} <= HF_FILES):
        raise LabrunError(f"--out {out} exists and is not an earlier hf export; give a new "
                          f"folder")
    model = build_model(state, checkpoint)
    names = list(state["class_names"])
    model.config.id2label = dict(enumerate(names))
    model.config.label2id = {name: i for i, name in enumerate(names)}
    tokenizer = hf_tokenizer(state["tokenizer"]["json"], int(state["text"]["max_length"]),
                             takes_token_types(model))
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an export that was killed
    try:
        model.save_pretrained(tmp)  # safetensors: transformers' default since 4.35
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)  # the folder appears whole, or not at all
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Exported(out, {"format": "hf", "task": TASK, "class_names": names,
                          "hf": {key: state["hf"].get(key) for key in ("name", "revision")}})


def hf_tokenizer(tokenizer_json: str, max_length: int, token_types: bool) -> Any:
    """The run's tokenizer as transformers' fast tokenizer: its special tokens set by role, and
    model_max_length, so that `truncation=True` cuts where the run did."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.no_padding()
    tokenizer.no_truncation()  # transformers' call arguments decide, as for any model
    roles = {}
    for role, spellings in SPECIAL_TOKENS.items():
        found = [token for token in spellings if tokenizer.token_to_id(token) is not None]
        if found:
            roles[role] = found[0]
    model_inputs = list(INPUTS[:3 if token_types else 2])  # DistilBERT takes no token types
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=max_length,
                                   model_input_names=model_inputs, **roles)


EXTRA_FORMATS: dict[str, Callable[[dict[str, Any], Path, Path], Exported]] = {"hf": export_hf}
