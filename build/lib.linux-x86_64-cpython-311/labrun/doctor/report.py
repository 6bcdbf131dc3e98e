"""A doctor check's result and the table `labrun doctor` prints."""

from __future__ import annotations

from dataclasses import dataclass

OK, WARNING, FAILED = "ok", "warning", "failed"
NO_GPU_FIX = "on a GPU node: check nvidia-smi, the driver and CUDA_VISIBLE_DEVICES"


@dataclass
class Check:
    check: str
    status: str
    detail: str
    fix: str = ""


def print_table(checks: list[Check]) -> None:
    from rich.console import Console
    from rich.table import Table

    colour = {OK: "green", WARNING: "yellow", FAILED: "red"}
    table = Table(title="labrun doctor", show_lines=False)
    for column in ("check", "status", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for c in checks:
        table.add_row(c.check, f"[{colour[c.status]}]{c.status}[/]", c.detail, c.fix)
    console = Console()
    console.print(table)
    counts = {s: sum(c.status == s for c in checks) for s in (OK, WARNING, FAILED)}
    console.print(f"{counts[OK]} ok, {counts[WARNING]} warnings, {counts[FAILED]} failed")

