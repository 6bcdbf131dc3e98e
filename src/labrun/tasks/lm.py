"""A language model's life after training (labrun.train.task.LanguageModelling's deploy hooks,
labrun.deploy.hooks): what its export takes and returns, and how it is served.

    export   export_plan     token ids in, next-token logits out; the batch and the sequence
                             (1 to block_size) dynamic
             parity_windows  windows of the run's val tokens (or seeded random ids)
             parity          exported vs eager logits at two batch sizes and two lengths
             metadata        vocab_size, block_size, the tokenizer (a `tokenizers` file's JSON
                             text included): what serving needs, with nothing else
    serving  parse_request   a POST /generate body -> Request, or RequestError (a 4xx)
             LanguageModel   the exported file in its runtime, with its tokenizer:
                             generate(Request) -> the answer
             add_routes      POST /generate
    predict  none: a continuation is asked of `labrun serve`

    POST /generate {"prompt": "def ", "max_tokens": 64, "temperature": 0.8, "seed": 1}
      -> {"text": "...", "tokens": 64, "token_ids": [...], "prompt_tokens": 4, "seed": 1}

Sampling is nanoGPT's `generate`: one token at a time from softmax(logits / temperature) at
the last position, the window cropped to the model's last block_size tokens; temperature 0
is greedy (argmax). Each request draws from its own generator, seeded by its `seed` (a
fresh one, returned in the answer, when it gives none), never from a global one: the same
request gives the same continuation, whatever other requests run meanwhile.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from fastapi import HTTPException
from fastapi import Request as HTTPRequest

from labrun.core.errors import LabrunError, one_line
from labrun.data import tokens
from labrun.deploy import runtime
from labrun.deploy.export import LogitsParity, Plan, Target, build_model
from labrun.deploy.requests import RequestError, json_object

log = logging.getLogger(__name__)

TASK = "lm"
REQUIRED_KEYS = ("vocab_size", "block_size", "tokenizer")
# Tokens one request may ask for: each costs one model call over the whole window, so this
# bounds the time a request holds a model call (1,024 x a 256-token window on a CPU: seconds).
MAX_TOKENS = 1024
DEFAULT_TEMPERATURE = 1.0
PARITY_WINDOWS = 16
EXAMPLE_REQUEST = '{"prompt": "Once upon a time", "max_tokens": 64, "temperature": 0.8, "seed": 1}'
USAGE = f"POST /generate with a JSON body such as {EXAMPLE_REQUEST}"


# ---------------------------------------------------------------------------------------------
# Export


def export_plan(state: dict[str, Any], checkpoint: Path, target: Target) -> Plan:
    """Token ids in, next-token logits out, batch and sequence dynamic; checked on windows of
    the run's val tokens."""
    model_sizes = sizes(state, checkpoint)
    model = build_model(state["config"], model_sizes, state["model"], checkpoint)
    check = None
    if target.check_data is not None:
        windows = parity_windows(state["config"].get("dataset", {}), model_sizes,
                                 target.check_data)

        def check(path: Path, reference: torch.nn.Module) -> dict[str, Any]:
            return parity(path, target, reference, windows)

    with torch.inference_mode():  # the model's own config may pad the vocabulary
        logits_size = model(example_input(model_sizes, "cpu")[:1, :1]).shape[-1]
    return Plan(model, example_input(model_sizes, target.device),
                input_axes(model_sizes["block_size"]), check, report_parity,
                metadata(state, logits_size))


def sizes(state: dict[str, Any], checkpoint: Path) -> dict[str, int]:
    """The model's vocab_size and block_size, from a checkpoint that must carry them."""
    missing = [key for key in ("vocab_size", "block_size", "tokenizer") if key not in state]
    if missing:
        raise LabrunError(f"{checkpoint}: a language model's checkpoint without "
                          f"{', '.join(missing)} (written before labrun exported language "
                          f"models); train the run again (labrun rerun RUN_DIR --exec)")
    return {"vocab_size": int(state["vocab_size"]), "block_size": int(state["block_size"])}


def input_axes(block_size: int) -> dict[int, tuple[str, int | None]]:
    """The input's dynamic axes, with their largest size: any batch, a sequence up to the
    window the position embedding knows (a longer one is the GPT's own error)."""
    return {0: ("batch", None), 1: ("sequence", block_size)}


def example_input(model_sizes: dict[str, int], device: str) -> torch.Tensor:
    """Token ids to trace with: 2 windows of block_size tokens (sizes other than 0 and 1, which
    torch.export would take for constants)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, model_sizes["vocab_size"], (2, model_sizes["block_size"]),
                         generator=generator).to(device)


def parity_windows(dataset: dict[str, Any], model_sizes: dict[str, int], data: str
                   ) -> tuple[torch.Tensor, str]:
    """PARITY_WINDOWS windows of block_size token ids, spread over the run's val tokens, or
    seeded random ids when those cannot be read; with where they came from."""
    block, reason = model_sizes["block_size"], "random input requested"
    if data == "val":
        # dataset=tokens names its folder `path`; dataset=python_docs, `folder`.
        folder = dataset.get("path") or dataset.get("folder")
        try:
            if not folder:
                raise LabrunError("the run's dataset names no token folder")
            ids = tokens.read_split(folder, "val")
            if len(ids) < block:
                raise LabrunError(f"{len(ids)} val tokens, fewer than block_size={block}")
            starts = np.unique(np.linspace(0, len(ids) - block, PARITY_WINDOWS).round()
                               .astype(int))
            windows = np.stack([ids[s:s + block] for s in starts]).astype(np.int64)
            return torch.from_numpy(windows), f"{len(starts)} windows of {folder} val"
        except Exception as error:  # noqa: BLE001 - any data problem falls back to random ids
            reason = f"validation tokens unavailable: {one_line(error)}"
    generator = torch.Generator().manual_seed(0)
    windows = torch.randint(0, model_sizes["vocab_size"], (PARITY_WINDOWS, block),
                            generator=generator)
    return windows, f"{PARITY_WINDOWS} random windows ({reason})"


def parity(path: Path, target: Target, reference: torch.nn.Module,
           windows: tuple[torch.Tensor, str]) -> dict[str, Any]:
    """The exported file in its own runtime against the eager fp32 model: every window whole,
    and the first one alone cut to half its length. Two batch sizes and two lengths prove
    both axes dynamic (a traced or exported constant would fail one of them).

    The tolerance is relative to the largest eager logit (at least 1); a next-token flip
    counts only where the eager top two are further apart than twice what it allows."""
    batch, windows_from = windows
    run = target.runtime(path)
    half = max(1, batch.shape[1] // 2)
    shapes = [tuple(batch.shape), (1, half)]
    logits = LogitsParity(target.tolerance)
    for ids in (batch, batch[:1, :half]):
        with torch.inference_mode():
            eager = reference(ids.to(target.device)).float().cpu()
        logits.add(torch.from_numpy(run(ids.numpy())), eager)
    return {"windows": len(batch), "windows_from": windows_from,
            "shapes": [list(shape) for shape in shapes], **logits.figures(),
            "failure": None if logits.passed else (
                f"parity check failed: max abs diff {logits.max_abs_diff:.2e} > "
                f"{logits.tolerance:.2e} or the next token differs at "
                f"{logits.top1_mismatches} token position(s)")}


def report_parity(check: dict[str, Any], exporter: str) -> None:
    verdict = "ok" if check["passed"] else "FAILED"
    shapes = " and ".join("x".join(map(str, shape)) for shape in check["shapes"])
    log.info(f"parity ({exporter}): {check['windows_from']}, token ids {shapes}: max abs diff "
             f"{check['max_abs_diff']:.2e} (tolerance {check['tolerance']:.2e}), next token "
             f"agrees at {check['top1_agree']}/{check['positions']} positions -> {verdict}")


def metadata(state: dict[str, Any], logits_size: int) -> dict[str, Any]:
    """What the export's metadata carries for serving, beside the keys every export has.

    vocab_size and block_size are the data's (the tokenizer's vocabulary, the window trained
    on); a model whose config fixes larger ones (model.vocab_size padded, model.block_size)
    gives `logits_size` logits, and positions never trained beyond the window."""
    vocab, block = int(state["vocab_size"]), int(state["block_size"])
    return {"input": {"name": "input", "shape": ["batch", "sequence"], "dtype": "int64",
                      "values": f"token ids; sequence from 1 to block_size ({block})"},
            "output": {"name": "logits", "shape": ["batch", "sequence", logits_size],
                       "values": "the next token's logits at each position"},
            "vocab_size": vocab, "block_size": block, "tokenizer": dict(state["tokenizer"])}


# ---------------------------------------------------------------------------------------------
# Serving: a request in


@dataclass(frozen=True)
class Request:
    prompt: str
    max_tokens: int
    temperature: float = DEFAULT_TEMPERATURE
    seed: int | None = None  # None: a fresh seed, returned in the answer


FIELDS = {"prompt": "a non-empty string",
          "max_tokens": f"an integer from 1 to {MAX_TOKENS}",
          "temperature": f"a number >= 0 (0: greedy; default {DEFAULT_TEMPERATURE:g})",
          "seed": "an integer >= 0 (default: a fresh one, returned in the answer)"}
REQUIRED = ("prompt", "max_tokens")


def parse_request(body: bytes) -> Request:
    """A POST /generate body -> its Request; RequestError names the first problem and the fix."""
    fields = json_object(body, EXAMPLE_REQUEST)
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise RequestError(f"unknown field {', '.join(map(repr, unknown))}: the fields are "
                           f"{', '.join(FIELDS)}")
    missing = [name for name in REQUIRED if name not in fields]
    if missing:
        raise RequestError(f"missing field {', '.join(map(repr, missing))}: send "
                           f"{', '.join(f'{name} ({FIELDS[name]})' for name in missing)}")
    prompt, max_tokens = fields["prompt"], fields["max_tokens"]
    temperature = fields.get("temperature", DEFAULT_TEMPERATURE)
    seed = fields.get("seed")
    if not isinstance(prompt, str) or not prompt:
        bad("prompt", prompt)
    if not is_int(max_tokens) or not 1 <= max_tokens <= MAX_TOKENS:
        bad("max_tokens", max_tokens)
    if (isinstance(temperature, bool) or not isinstance(temperature, int | float)
            or not math.isfinite(temperature) or temperature < 0):
        bad("temperature", temperature)
    if seed is not None and (not is_int(seed) or seed < 0):
        bad("seed", seed)
    return Request(prompt, max_tokens, float(temperature), seed)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is no count


def bad(name: str, value: Any) -> NoReturn:
    raise RequestError(f"{name}={json.dumps(value)[:60]}: give {FIELDS[name]}")


# ---------------------------------------------------------------------------------------------
# Serving: the model and an answer out


def next_token(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """A token drawn from softmax(logits / temperature); the most likely one at temperature 0."""
    if temperature == 0:
        return int(np.argmax(logits))
    # Shifted before the division: a tiny temperature makes the others -inf, never inf - inf.
    scaled = (logits.astype(np.float64) - logits.max()) / temperature
    cumulative = np.cumsum(np.exp(scaled))
    drawn = np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right")
    return int(min(drawn, len(cumulative) - 1))  # rounding may reach the very end


class LanguageModel:
    """An exported language model (labrun export of a task=lm run) with its tokenizer, from
    the metadata alone: a prompt in, a sampled continuation out."""

    def __init__(self, model_path: str | Path, threads: int | None = None):
        self.model_path = Path(model_path)
        self.threads = threads  # the runtime's intra-op threads (None: its own default)
        self.metadata = runtime.read_metadata(self.model_path, task=TASK)
        self.vocab_size = int(self.metadata["vocab_size"])
        self.block_size = int(self.metadata["block_size"])
        self.codec = tokens.codec(self.metadata["tokenizer"])
        self.runtime = runtime.open_runtime(self.model_path, self.metadata["format"], threads)
        # One real inference now: a model that cannot run fails at start-up, not per request.
        self.next_logits([0])

    @property
    def device(self) -> str:
        return self.runtime.device

    def next_logits(self, ids: list[int]) -> np.ndarray:
        """The next token's logits after `ids`, of which the model sees the last block_size,
        over the tokenizer's vocabulary: a padded vocabulary's extra ids (model.vocab_size)
        stand for no text, and are never drawn."""
        window = np.asarray([ids[-self.block_size:]], dtype=np.int64)
        return self.runtime(window)[0, -1, :self.vocab_size]

    def generate(self, request: Request) -> dict[str, Any]:
        prompt = self.codec.encode(request.prompt)
        if not prompt:
            raise RequestError(f"prompt={json.dumps(request.prompt)[:60]} encodes to no token "
                               f"with this model's tokenizer; send text it keeps")
        seed = secrets.randbits(63) if request.seed is None else request.seed
        rng = np.random.default_rng(seed)
        window, new = prompt[-self.block_size:], []
        for _ in range(request.max_tokens):
            token = next_token(self.next_logits(window), request.temperature, rng)
            new.append(token)
            window = [*window, token][-self.block_size:]  # nanoGPT's crop
        return {"text": self.codec.decode(new), "tokens": len(new), "token_ids": new,
                "prompt_tokens": len(prompt), "seed": seed}


def load(path: Path, threads: int | None = None) -> LanguageModel:
    return LanguageModel(path, threads)


def describe(model: LanguageModel) -> str:
    return (f"language model, vocabulary {model.vocab_size}, window {model.block_size} "
            f"tokens")


def health(model: LanguageModel) -> dict[str, Any]:
    return {"task": TASK, "vocab_size": model.vocab_size, "block_size": model.block_size}


def add_routes(app, model: LanguageModel, server) -> None:
    """POST /generate, one request's tokens after one another.

    No batching: each request's tokens depend on its previous ones, one model call each. A
    request generates in a thread of its own, off the event loop, and at most `model_calls`
    generate at once (each model call on the threads the server gave it); the others wait."""

    @app.post("/generate")
    async def generate(request: HTTPRequest) -> dict[str, Any]:
        # The body is read and checked here rather than by a pydantic model, so that each bad
        # body (not UTF-8, not JSON, a field missing or out of range) gets its own line.
        try:
            asked = parse_request(await request.body())
            return await server.call_model(model.generate, asked)
        except RequestError as error:
            raise HTTPException(error.status, str(error)) from None
        except Exception as error:  # noqa: BLE001 - the model failed on this request
            raise HTTPException(500, f"generation failed: {one_line(error)}") from None
