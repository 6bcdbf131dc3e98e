"""`labrun weights fetch OVERRIDES` and `labrun weights list`: the lab's pretrained weights cache
(labrun.models.pretrained).

    labrun weights fetch model=resnet18                      # on a login node, with internet
    labrun weights fetch model=timm model.name=convnext_tiny model.pretrained=fb_in1k
    labrun weights list

The overrides are train.py's, composed from conf/ as a run would be, so `paths.weights_cache`
is the one the lab's runs use (conf/paths/, conf/local/, LABRUN_WEIGHTS_CACHE).
"""

from __future__ import annotations

import argparse

from labrun.core.errors import LabrunError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("fetch", "list"),
                        help="fetch: download the weights the config names (machine with "
                             "internet); list: what the cache holds, with sizes and sha256")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="train.py's overrides: model=resnet18, model.pretrained=IMAGENET1K_V2,"
                             " paths.weights_cache=DIR")


def run(args) -> int:
    model_cfg, cache = compose(args.overrides)
    if args.action == "list":
        return list_cache(cache)
    return fetch(model_cfg, cache)


def compose(overrides: list[str]):
    """The model's config and paths.weights_cache, as train.py would compose them."""
    from hydra import compose as hydra_compose
    from omegaconf import OmegaConf

    from labrun.config.resolve import PRIMARY, hydra_context
    from labrun.core.errors import first_line
    from labrun.core.project import LABRUN_CONF

    try:
        with hydra_context(LABRUN_CONF, PRIMARY):
            cfg = hydra_compose(PRIMARY, overrides=overrides)
    except Exception as error:  # Hydra's own error for an unknown option or key: one line
        raise LabrunError(first_line(str(error))) from None
    model_cfg = OmegaConf.create(OmegaConf.to_container(cfg.model, resolve=True))
    return model_cfg, OmegaConf.select(cfg, "paths.weights_cache")


def fetch(model_cfg, cache: str | None) -> int:
    from huggingface_hub.utils import logging as hf_logging

    from labrun.models import pretrained

    hf_logging.set_verbosity_error()  # its retries would print a line each; the outcome is ours

    if not pretrained.asked_for(model_cfg):
        model_cfg.pretrained = True  # `fetch model=resnet18`: the default weights
    weights = pretrained.resolve(model_cfg, cache)
    found = weights.find()
    if found is not None:
        digest = pretrained.verify(weights, found)
        print(f"{weights.label}: already at {found} (sha256 {digest}, matches what was "
              f"published)")
        return 0
    print(f"{weights.label}: fetching {weights.url} into "
          f"{cache or 'the library cache (paths.weights_cache is null)'}")
    try:
        path = pretrained.download(weights, cache)
    except (OSError, ValueError) as error:  # no route, DNS, refused; torch.hub's hash check
        raise LabrunError(f"could not fetch {weights.url}: {reason(error)}; run `labrun weights "
                          f"fetch` on a machine with internet (a login node)") from None
    print(f"{weights.label}: {path} (sha256 {pretrained.verify(weights, path)})")
    return 0


def reason(error: BaseException) -> str:
    """The innermost cause, in one line (urllib and requests wrap the socket's error)."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    text = getattr(error, "reason", None) or error
    return str(text).strip().splitlines()[0][:200] if str(text).strip() else type(error).__name__


def list_cache(cache: str | None) -> int:
    """One tab-separated line per file (layout, name, size, sha256, path): for a person and
    for `cut`."""
    from rich.filesize import decimal

    from labrun.models import pretrained

    found = list(pretrained.cached_files(cache))
    for one in found:
        print("\t".join((one.library, one.name, decimal(one.size),
                         f"sha256:{pretrained.sha256(one.path)}", str(one.path))))
    print(f"{len(found)} file(s), {decimal(sum(one.size for one in found))} in "
          f"{cache or 'TORCH_HOME and HF_HOME'}")
    return 0
