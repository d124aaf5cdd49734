"""What one check found, and how a list of findings is shown.

A finding names its check, a status and one line of what was seen; a
finding that is not OK also says what to change (``fix``), in the terms
the operator acts on: a flag, a mount option, a Kubernetes field.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass


class Status(enum.Enum):
    """OK: as configured. WARN: the daemon runs, but not as well as it could. FAIL: it will not
    start, or will not do what it is configured to do. SKIP: nothing to check here."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True)
class Finding:
    check: str
    status: Status
    summary: str
    fix: str = ""

    def as_dict(self) -> dict:
        return {**asdict(self), "status": self.status.value}


def ok(check: str, summary: str) -> Finding:
    return Finding(check, Status.OK, summary)


def warn(check: str, summary: str, fix: str) -> Finding:
    return Finding(check, Status.WARN, summary, fix)


def fail(check: str, summary: str, fix: str) -> Finding:
    return Finding(check, Status.FAIL, summary, fix)


def skip(check: str, summary: str) -> Finding:
    return Finding(check, Status.SKIP, summary)


def failed(findings: Iterable[Finding]) -> bool:
    return any(f.status is Status.FAIL for f in findings)


def render_text(findings: Sequence[Finding]) -> str:
    width = max((len(f.check) for f in findings), default=0)
    lines = []
    for f in findings:
        lines.append(f"{f.status.value.upper():4}  {f.check:{width}}  {f.summary}")
        if f.fix:
            lines.append(f"{'':4}  {'':{width}}  fix: {f.fix}")
    counts = {s: sum(1 for f in findings if f.status is s) for s in Status}
    lines.append(f"{counts[Status.FAIL]} failed, {counts[Status.WARN]} warnings, {counts[Status.OK]} ok, "
                 f"{counts[Status.SKIP]} skipped")
    return "\n".join(lines)


def render_json(findings: Sequence[Finding]) -> str:
    return json.dumps([f.as_dict() for f in findings])


def size(n: int) -> str:
    """Bytes as an operator writes them in a flag: 32GiB, 512MiB, 4096B."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            value = n / (1 << shift)
            return f"{value:.1f}{unit}".replace(".0" + unit, unit)
    return f"{n}B"
