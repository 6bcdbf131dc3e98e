"""A config review (labrun.review.review) as text for a terminal and as markdown for a
pull-request comment: stable ordering and no times or temporary paths, so that a re-run of the
same revisions gives the same bytes (the workflow updates its one comment in place)."""

from __future__ import annotations

import json
from typing import Any

from labrun.review.review import Change, Experiment, Review

# The line that finds the review's comment again on a pull request
# (.github/workflows/config-review.yml): a push updates it instead of adding another.
MARKER = "<!-- labrun configs review -->"
LONGEST = 80  # characters of a value shown in a table cell


def show(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= LONGEST else text[:LONGEST - 3] + "..."


def _change_line(change: Change) -> str:
    if change.kind == "added":
        values = f"(not at BASE) -> {show(change.new)}"
    elif change.kind == "removed":
        values = f"{show(change.old)} -> (not at HEAD)"
    else:
        values = f"{show(change.old)} -> {show(change.new)}"
    tags = ["changes results" if change.affects_result else "no result change"]
    if change.blocks_resume:
        tags.append("running jobs refuse to resume")
    return f"{change.key}: {values}  [{', '.join(tags)}]"


def _title(experiment: Experiment) -> str:
    renamed = f" (renamed from experiment={experiment.renamed_from})" \
        if experiment.renamed_from else ""
    return f"{experiment.name}{renamed}"


def text(review: Review) -> str:
    lines = [f"review: {review.base} -> {review.head}"]
    for experiment in review.experiments:
        status = experiment.status
        if experiment.error:
            status += f": {experiment.error}"
        lines.append(f"{_title(experiment)}: {status}")
        lines += [f"  {_change_line(change)}" for change in experiment.changes]
    for kind, names in review.groups.items():
        lines.append(f"options {kind}: {', '.join(names)}")
    lines += [f"note: {note}" for note in review.notes]
    lines.append(review.summary())
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _keys(changes: list[Change]) -> str:
    if not changes:
        return ""
    names = [f"`{c.key}`" for c in changes[:6]]
    more = f" +{len(changes) - 6} more" if len(changes) > 6 else ""
    return ", ".join(names) + more


def markdown(review: Review) -> str:
    icon = ":x:" if review.exit_code else ":white_check_mark:"
    out = [MARKER, f"### Config review: `{review.base}` -> `{review.head}`", "",
           f"{icon} **{review.summary()}**", "",
           "| experiment | result-changing keys | other keys | status |",
           "|---|---|---|---|"]
    for e in review.experiments:
        out.append(f"| `{_cell(_title(e))}` | {_keys(e.result_keys)} | {_keys(e.other_keys)} "
                   f"| {_cell(e.status)} |")
    for e in review.experiments:
        if not (e.changes or e.error):
            continue
        out += ["", f"<details><summary><code>{_title(e)}</code>: {e.status}</summary>", ""]
        if e.overrides:
            out += [f"Overrides: `{' '.join(e.overrides)}`", ""]
        if e.error:
            out += ["```", e.error, "```", ""]
        if e.changes:
            out += ["| key | BASE | HEAD | changes results | running jobs resume |",
                    "|---|---|---|---|---|"]
            for c in e.changes:
                old = "(not at BASE)" if c.kind == "added" else f"`{_cell(show(c.old))}`"
                new = "(not at HEAD)" if c.kind == "removed" else f"`{_cell(show(c.new))}`"
                out.append(f"| `{c.key}` | {old} | {new} | {'yes' if c.affects_result else 'no'} "
                           f"| {'refuse' if c.blocks_resume else 'yes'} |")
            out.append("")
        out.append("</details>")
    if review.groups:
        out += ["", "**Config options**", ""]
        out += [f"- {kind}: {', '.join(f'`{n}`' for n in names)}"
                for kind, names in review.groups.items()]
    if review.notes:
        out += [""] + [f"> {note}" for note in review.notes]
    return "\n".join(out) + "\n"
