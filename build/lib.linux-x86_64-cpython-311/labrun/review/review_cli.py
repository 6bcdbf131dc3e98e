"""`labrun configs review`'s one call: build the review, print it, write the files asked for."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from labrun.core.files import write_text_atomic
from labrun.review import review_render
from labrun.review.review import review
from labrun.review.sides import repo_root

log = logging.getLogger(__name__)


def run_review(repo: Path, base: str | None, head: str | None, config_name: str, *,
               markdown: Path | None = None, json_file: Path | None = None) -> int:
    started = time.monotonic()
    found = review(repo_root(repo), base, head, config_name)
    print(review_render.text(found), end="")
    if markdown is not None:
        write_text_atomic(markdown, review_render.markdown(found))
    if json_file is not None:
        write_text_atomic(json_file, found.to_json())
    log.info(f"configs review: {time.monotonic() - started:.1f} s")
    return found.exit_code
