"""`labrun doctor [--json] [--partition P]`: the arguments; the checks are labrun.doctor."""

from __future__ import annotations

import json
from dataclasses import asdict


def configure(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.add_argument("--partition", default=None,
                        help="SLURM partition to look for (default: from conf/cluster/lab.yaml)")


def run(args) -> int:
    from labrun import doctor

    checks = doctor.run_checks(args.partition)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        doctor.print_table(checks)
    return 1 if any(c.status == doctor.FAILED for c in checks) else 0
