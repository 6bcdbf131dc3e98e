"""`labrun configs review [BASE]`: what a change does to every experiment people run.

The primary config's defaults, every experiment preset and the override lists named in
conf/review.yaml are composed at BASE and at HEAD (or the work tree), each side with its own
conf/ and its own schemas (labrun.review.sides), and compared key by key. Each changed key is
classified by the schema's facts (config/facts.py): does it change results (`affects_result`),
would a running job refuse to resume with it (`resume_safe`). labrun.review.review_render
prints the result as text, markdown (a pull-request comment) and JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from labrun.config.resolve import PRIMARY
from labrun.core.errors import LabrunError, first_line
from labrun.core.secrets import REDACTED, is_secret_key, redact
from labrun.review.sides import Composed, Side, checkout, compose_sides, default_base

REVIEW_FILE = "review.yaml"  # conf/review.yaml: {reviews: {name: [override, ...]}}
DEFAULTS = "defaults"
# Hydra's own settings and the untracked per-user overrides are no options people review.
SKIPPED_GROUPS = ("hydra", "local")


@dataclass(frozen=True)
class Change:
    key: str
    old: Any  # absent when the key is added
    new: Any  # absent when the key is removed
    kind: str  # changed | added | removed
    affects_result: bool
    blocks_resume: bool


@dataclass
class Experiment:
    name: str
    overrides: list[str]
    status: str = "unchanged"
    error: str | None = None
    base_error: str | None = None
    renamed_from: str | None = None
    changes: list[Change] = field(default_factory=list)

    @property
    def result_keys(self) -> list[Change]:
        return [c for c in self.changes if c.affects_result]

    @property
    def other_keys(self) -> list[Change]:
        return [c for c in self.changes if not c.affects_result]

    @property
    def breaks(self) -> bool:
        """Fails at HEAD, and not with the same error at BASE: this change broke it."""
        return self.error is not None and self.error != self.base_error


@dataclass
class Review:
    base: str
    head: str
    experiments: list[Experiment] = field(default_factory=list)
    groups: dict[str, list[str]] = field(default_factory=dict)  # added/removed/renamed/changed
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if any(e.breaks for e in self.experiments) else 0

    def summary(self) -> str:
        reviewed = [e for e in self.experiments if e.status != "removed"]
        parts = [f"{sum(bool(e.result_keys) for e in reviewed)} of {len(reviewed)} "
                 f"experiments change results"]
        other = sum(bool(e.changes) and not e.result_keys for e in reviewed)
        if other:
            parts.append(f"{other} change only keys that leave results alone")
        counts = [(sum(e.breaks and e.status == "no longer composes" for e in reviewed),
                   "no longer composes", "no longer compose"),
                  (sum(e.breaks and e.status == "no longer validates" for e in reviewed),
                   "no longer validates", "no longer validate"),
                  (sum(e.breaks and e.status.startswith("added") for e in reviewed),
                   "new one fails", "new ones fail"),
                  (sum(e.status == "added" for e in reviewed), "added", "added"),
                  (sum(e.status == "removed" for e in self.experiments), "removed", "removed")]
        parts += [f"{n} {one if n == 1 else many}" for n, one, many in counts if n]
        return "; ".join(parts)

    def to_json(self) -> str:
        data = {"base": self.base, "head": self.head, "summary": self.summary(),
                "exit_code": self.exit_code, "groups": self.groups, "notes": self.notes,
                "experiments": [{**{k: v for k, v in vars(e).items() if k != "changes"},
                                 "changes": [vars(c) for c in e.changes]}
                                for e in self.experiments]}
        return json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"


def review(repo: Path, base: str | None, head: str | None = None,
           config_name: str = PRIMARY) -> Review:
    base = base or default_base(repo)
    with checkout(repo, base) as old, checkout(repo, head) as new:
        targets, renamed = _targets(old, new)
        at_base = targets_at(old, renamed, targets)
        # A renamed preset is composed under its old name at BASE, its new one at HEAD.
        base_targets = [{"name": t["name"], "overrides": _base_overrides(t, renamed)}
                        for t in targets if t["name"] in at_base]
        new_targets = [t for t in targets if t["name"] in targets_at(new, {}, targets)]
        composed_old, composed_new = compose_sides(
            [(old, base_targets), (new, new_targets)], config_name)
        result = Review(base=_label(old), head=_label(new))
        result.groups = _group_changes(old.conf, new.conf)
    for target in targets:
        result.experiments.append(_compare(target, composed_old, composed_new, renamed))
    for side, label, composed in (("BASE", result.base, composed_old),
                                  ("HEAD", result.head, composed_new)):
        if composed.facts is None:  # older than config/facts.py: nothing says otherwise
            result.notes.append(f"{side} {label} has no schema facts (config/facts.py): the "
                                f"keys read from it count as result-changing and as refusing "
                                f"a resume")
    return result


def _label(side: Side) -> str:
    return f"{side.rev} ({side.commit[:10]})" if side.rev and side.commit else side.label


def targets_at(side: Side, renamed: dict[str, str], targets: list[dict]) -> set[str]:
    """The targets that exist on `side`: every one but the presets it lacks."""
    presets = _presets(side.conf)
    names = set()
    for target in targets:
        preset = target.get("preset")
        if preset is None or preset in presets or renamed.get(target["name"]) in presets:
            names.add(target["name"])
    return names


def _base_overrides(target: dict, renamed: dict[str, str]) -> list[str]:
    old = renamed.get(target["name"])
    return [f"experiment={old}"] if old else target["overrides"]


def _presets(conf: Path) -> set[str]:
    folder = conf / "experiment"
    return {p.stem for p in folder.glob("*.yaml")} if folder.is_dir() else set()


def _targets(old: Side, new: Side) -> tuple[list[dict], dict[str, str]]:
    """Every config to compose, in a stable order, and renamed presets: new name -> old."""
    renamed = {f"experiment={new_name}": old_name for old_name, new_name in
               _renames(old.conf, new.conf, "experiment")}
    gone = set(renamed.values())
    targets: list[dict] = [{"name": DEFAULTS, "overrides": []}]
    for preset in sorted((_presets(old.conf) - gone) | _presets(new.conf)):
        targets.append({"name": f"experiment={preset}", "overrides": [f"experiment={preset}"],
                        "preset": preset})
    extras = {**_review_file(old.conf), **_review_file(new.conf)}  # HEAD's lists win
    targets += [{"name": name, "overrides": extras[name]} for name in sorted(extras)]
    return targets, renamed


def _review_file(conf: Path) -> dict[str, list[str]]:
    path = conf / REVIEW_FILE
    if not path.is_file():
        return {}
    try:
        lists = (yaml.safe_load(path.read_text()) or {}).get("reviews") or {}
    except (yaml.YAMLError, AttributeError) as error:
        raise LabrunError(f"{path}: {first_line(str(error))}; it holds `reviews:` with "
                          f"`name: [override, ...]` entries") from None
    if not isinstance(lists, dict) or not all(isinstance(v, list) for v in lists.values()):
        raise LabrunError(f"{path}: `reviews:` must map each name to a list of overrides, "
                          f"such as `lr_sweep: [experiment=resnet18_cifar10, optimizer.lr=0.05]`")
    return {str(name): [str(o) for o in overrides] for name, overrides in lists.items()}


def _compare(target: dict, old: Composed, new: Composed, renamed: dict[str, str]
             ) -> Experiment:
    name = target["name"]
    shown = [redact(o) for o in target["overrides"]]
    experiment = Experiment(name, shown, renamed_from=renamed.get(name))
    before, after = old.results.get(name), new.results.get(name)
    if after is None:
        experiment.status = "removed"
        return experiment
    experiment.base_error = before["error"] if before else None
    if after["error"]:
        experiment.error = after["error"]
        if before is None:
            experiment.status = "added, fails"
        elif not experiment.breaks:
            experiment.status = "fails at BASE too"
        else:
            experiment.status = ("no longer composes" if after["stage"] == "compose"
                                 else "no longer validates")
        return experiment
    if before is None:
        experiment.status = "added"
        return experiment
    if before["error"]:
        experiment.status = "fixed"
    experiment.changes = _changes(before["values"], after["values"], old.facts, new.facts)
    if not before["error"]:
        experiment.status = ("changes results" if experiment.result_keys else
                             "changes other keys" if experiment.changes else "unchanged")
    return experiment


def _changes(old: dict[str, Any], new: dict[str, Any], old_facts: dict | None,
             new_facts: dict | None) -> list[Change]:
    changes = []
    for key in sorted(set(old) | set(new)):
        if key in old and key in new and _same(old[key], new[key]):
            continue
        kind = "changed" if key in old and key in new else "added" if key in new else "removed"
        # A key is described by the side that has it (HEAD first); the resume check is HEAD's
        # code, and a key the saved config lacks takes today's value, so never refuses.
        affects, _ = _facts(new_facts if key in new else old_facts, key)
        _, safe = _facts(new_facts, key)
        secret = is_secret_key(key)
        changes.append(Change(key, REDACTED if secret else old.get(key),
                              REDACTED if secret else new.get(key), kind, affects,
                              kind != "added" and not safe))
    return changes


def _facts(table: dict[str, list[bool]] | None, key: str) -> tuple[bool, bool]:
    """(affects_result, resume_safe) of `key`; a side without facts: (True, False)."""
    if table is None:
        return True, False
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        found = table.get(".".join(parts[:end]))
        if found is not None:
            return found[0], found[1]
    return True, False


def _same(a: Any, b: Any) -> bool:
    # 1 and 1.0 are the same number; true and 1, or "1" and 1, are not the same value.
    return a == b and isinstance(a, bool) == isinstance(b, bool) and \
        isinstance(a, str) == isinstance(b, str)


def _options(conf: Path) -> dict[str, dict[str, Any]]:
    """group -> option -> its content (parsed, so that reformatting is no change)."""
    options: dict[str, dict[str, Any]] = {}
    for path in sorted(conf.rglob("*.yaml")):
        parts = path.relative_to(conf).parts
        if len(parts) < 2 or parts[0] in SKIPPED_GROUPS:
            continue
        text = path.read_text()
        try:
            content: Any = yaml.safe_load(text)
        except yaml.YAMLError:
            content = text
        options.setdefault("/".join(parts[:-1]), {})[path.stem] = content
    return options


def _renames(old_conf: Path, new_conf: Path, group: str) -> list[tuple[str, str]]:
    old = _options(old_conf).get(group, {})
    new = _options(new_conf).get(group, {})
    return _match_renames(old, new)


def _match_renames(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, str]]:
    pairs, taken = [], set()
    for gone in sorted(set(old) - set(new)):
        for came in sorted(set(new) - set(old)):
            if came not in taken and old[gone] == new[came]:
                pairs.append((gone, came))
                taken.add(came)
                break
    return pairs


def _group_changes(old_conf: Path, new_conf: Path) -> dict[str, list[str]]:
    old, new = _options(old_conf), _options(new_conf)
    found: dict[str, list[str]] = {"added": [], "removed": [], "renamed": [], "changed": []}
    for group in sorted(set(old) | set(new)):
        before, after = old.get(group, {}), new.get(group, {})
        pairs = _match_renames(before, after)
        found["renamed"] += [f"{group}/{a} -> {group}/{b}" for a, b in pairs]
        moved = {a for a, _ in pairs} | {b for _, b in pairs}
        found["added"] += [f"{group}/{o}" for o in sorted(set(after) - set(before) - moved)]
        found["removed"] += [f"{group}/{o}" for o in sorted(set(before) - set(after) - moved)]
        found["changed"] += [f"{group}/{o}" for o in sorted(set(before) & set(after))
                             if before[o] != after[o]]
    return {kind: names for kind, names in found.items() if names}
