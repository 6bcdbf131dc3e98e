"""A text classifier's life after training (labrun.train.text_task.TextClassification's deploy
hooks, labrun.deploy.hooks): what its export takes and returns, how it is served and predicted.

    export   export_plan     input_ids, attention_mask (and token_type_ids, for a model that
                             takes them: BERT's), int64 [batch, sequence], both axes dynamic, in;
                             class logits out; checked on a batch of the run's val texts and on
                             its shortest text alone (two batch sizes, two lengths)
             metadata        class names, the tokenizer (its JSON text), max_length, pairs,
                             pad_id, token_types, the transformers snapshot: what serving needs,
                             with nothing else
             EXTRA_FORMATS   hf: a folder that transformers' AutoModelForSequenceClassification
                             and AutoTokenizer load, id2label naming the classes
    serving  TextClassifier  the exported file in its runtime, with its tokenizer: texts in,
                             tokenized, truncated and padded as the run's val loader does, the
                             label and every class's probability out
             add_routes      POST /predict JSON {"text": "..."} -> {"label", "probs"}, or
                             {"texts": ["...", ...]} -> {"results": [...]}; a model of pairs
                             takes {"text", "text_pair"} or {"texts": [[a, b], ...]}
    predict  FILE [--csv OUT] [--text-column text] [--text-pair-column text_pair]: a .txt file
             (a text a line) or a .csv; `label (prob)` a line, or a CSV row per text

Concurrent requests share model calls (the server's batcher): their texts are padded to the
longest of the call with the attention mask saying which tokens are padding, so each answer is
its lone answer up to float rounding.

The package: export.py (the plan, the parity check, the metadata, the hf folder), inputs.py (a
request's texts and a predict file's, checked), serving.py (TextClassifier, the routes, labrun
predict).
"""

from __future__ import annotations

from labrun.tasks.text.export import EXTRA_FORMATS, INPUTS, TASK, export_plan
from labrun.tasks.text.inputs import MAX_TEXTS
from labrun.tasks.text.serving import (
    add_routes,
    describe,
    health,
    load,
    predict,
    predict_arguments,
)

__all__ = ["EXTRA_FORMATS", "INPUTS", "MAX_TEXTS", "REQUIRED_KEYS", "TASK", "USAGE", "add_routes",
           "describe", "export_plan", "health", "load", "predict", "predict_arguments"]

REQUIRED_KEYS = ("class_names", "tokenizer", "max_length", "pairs", "pad_id", "token_types")
EXAMPLE_REQUEST = '{"text": "..."} or {"texts": ["...", "..."]}'
USAGE = (f"POST /predict with a JSON body such as {EXAMPLE_REQUEST} (a model of text pairs: "
         f'{{"text": "...", "text_pair": "..."}} or {{"texts": [["...", "..."], ...]}})')
