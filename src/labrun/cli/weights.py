"""`labrun weights fetch OVERRIDES` and `labrun weights list`: the lab's pretrained weights cache
(labrun.models.pretrained).

    labrun weights fetch model=resnet18                      # on a login node, with internet
    labrun weights fetch model=timm model.name=convnext_tiny model.pretrained=fb_in1k
    labrun weights fetch model=hf model.name=bert-base-uncased     # a transformer's snapshot
    labrun weights list

The overrides are train.py's, composed from conf/ as a run would be, so `paths.weights_cache`
is the one the lab's runs use (conf/paths/, conf/local/, LABRUN_WEIGHTS_CACHE).
"""

from __future__ import annotations

import argparse
import logging
import sys

from labrun.core.errors import ConfigError, LabrunError

HF = "labrun.models.hf.hf_model"


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
    from labrun.core.hub_cache import hub_offline

    hub_offline(False)  # timm's weights come through huggingface_hub too
    if model_cfg.get("_target_") == HF:
        return fetch_hf(model_cfg, cache)
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


def fetch_hf(model_cfg, cache: str | None) -> int:
    """`model=hf`: the model's snapshot, in the hub cache's own layout, by huggingface_hub's own
    downloader, with the files a run loads only (hub_cache.FETCHED: never pickled weights); then
    checked as a run checks it, and each file's sha256 printed."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError
    from huggingface_hub.utils import disable_progress_bars
    from huggingface_hub.utils import logging as hf_logging

    from labrun.core import hub_cache

    hf_logging.set_verbosity_error()  # its retries would print a line each; the outcome is ours
    # huggingface_hub's HTTP client (httpx2, not the httpx the CLI quiets) logs each request.
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    if not sys.stderr.isatty():  # progress bars for a person at a terminal, not for a log
        disable_progress_bars()
    name, revision = model_cfg.get("name"), model_cfg.get("revision")
    if not name or name == "???":
        raise ConfigError("labrun weights fetch model=hf needs model.name: the hub's id of the "
                          "model, as in model.name=bert-base-uncased")
    try:
        found = hub_cache.locate(name, revision, cache)
    except ConfigError:
        found = None  # not there, or not whole: fetched (again) below
    if found is not None and complete(found):
        print_files(found)
        print(f"hf:{name}@{found.revision}: already at {found.folder} (its files named by "
              f"sha256 on the hub match it)")
        return 0

    url = f"{constants.ENDPOINT}/{name}"
    hub = hub_cache.hub_caches(cache)[0]  # where locate looks first: WEIGHTS/hub, else HF_HOME's
    # Asked once first: snapshot_download retries an unreachable hub before it says so, and
    # this fails at once, before anything is written to the cache.
    try:
        info = HfApi().model_info(name, revision=revision or "main")
    except RevisionNotFoundError:
        raise ConfigError(f"model.revision={revision}: {url} has no such revision (a commit, a "
                          f"branch or a tag); see {url}/commits/main") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"model.name={name}: the hub has no model {url}, or it is private or "
                          f"gated (log in with `hf auth login`, or set HF_TOKEN)") from None
    except Exception as error:  # the HTTP client's: no route, no name, refused; a 5xx
        raise unreachable(url, error) from None
    print(f"hf:{name}@{info.sha}: fetching {url} ({revision or 'main'}) into {hub}")
    try:
        snapshot_download(repo_id=name, revision=revision or "main", cache_dir=hub,
                          allow_patterns=list(hub_cache.FETCHED))
    except Exception as error:  # the connection lost on the way: fetch again to complete it
        raise unreachable(url, error) from None
    snapshot = hub_cache.locate(name, revision, cache)  # refuses what a run could not load
    print_files(snapshot)
    print(f"hf:{name}@{snapshot.revision}: {snapshot.folder}")
    return 0


def complete(snapshot) -> bool:
    """Whether the snapshot holds every file of hub_cache.FETCHED that the repository has, as
    huggingface_hub tells from the listing of the commit it kept at the fetch
    (models--*/trees/COMMIT.json): a fetch cut short may leave the config, the weights and
    tokenizer.json, which a run checks, without their companions (tokenizer_config.json)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from labrun.core import hub_cache

    hub = snapshot.folder.parents[2]  # HUB/models--ORG--NAME/snapshots/COMMIT
    try:
        snapshot_download(repo_id=snapshot.name, revision=snapshot.revision, cache_dir=hub,
                          allow_patterns=list(hub_cache.FETCHED), local_files_only=True)
    except LocalEntryNotFoundError:  # IncompleteSnapshotError among them
        return False
    return True


def print_files(snapshot) -> None:
    """One line per file of the snapshot, with its sha256, checked against the blob it links
    to where that is named by its sha256 (the hub's large files; its small ones are named by
    their git hash)."""
    from labrun.models import pretrained

    label = f"hf:{snapshot.name}@{snapshot.revision}"
    for path in sorted(p for p in snapshot.folder.rglob("*") if p.is_file()):
        digest = pretrained.sha256(path)
        blob = path.resolve().name
        if path.is_symlink() and len(blob) == 64 and blob != digest:
            raise ConfigError(f"{path}: its sha256 {digest[:16]}... does not match the published "
                              f"{blob[:16]}: the file is damaged; remove {path.resolve()} and "
                              f"fetch again")
        print(f"{label} {path.relative_to(snapshot.folder)} sha256 {digest}")


def unreachable(url: str, error: BaseException) -> LabrunError:
    return LabrunError(f"could not fetch {url}: {reason(error)}; run `labrun weights fetch` on a "
                       f"machine with internet (a login node)")


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
