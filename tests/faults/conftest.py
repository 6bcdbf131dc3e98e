"""The fault-injection suite: each test injects a fault into real processes and real files,
records what it injected and what it saw, and the session ends with the table
(fault, trials, survived, data lost)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

REPORT: dict[str, dict] = {}


@dataclass
class FaultRecord:
    fault: str
    trials: int = 0
    survived: int = 0
    data_lost: int = 0
    notes: list[str] = field(default_factory=list)

    def trial(self, survived: bool, lost: bool = False, note: str = "") -> None:
        self.trials += 1
        self.survived += bool(survived)
        self.data_lost += bool(lost)
        if note:
            self.notes.append(note)
            print(f"[{self.fault}] {note}")


@pytest.fixture
def fault(request):
    """fault("name") -> a FaultRecord that lands in the end-of-session table."""
    def make(name: str) -> FaultRecord:
        return REPORT.setdefault(name, FaultRecord(name))
    return make


def pytest_terminal_summary(terminalreporter):
    if not REPORT:
        return
    write = terminalreporter.write_line
    write("")
    write("fault injection: fault | trials | survived | data lost")
    for record in REPORT.values():
        write(f"  {record.fault} | {record.trials} | {record.survived} | {record.data_lost}")
