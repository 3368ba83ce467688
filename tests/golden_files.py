"""Golden-file comparison shared by the printer, dump and bench-table tests.

Regenerate after a deliberate change with ``UPDATE_GOLDEN=1 pytest ...`` and review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

GOLDEN = Path(__file__).parent / "golden"


def check_golden(name: str, text: str) -> None:
    """``text`` must equal tests/golden/``name`` exactly; the first differing lines are shown."""
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing (hint: UPDATE_GOLDEN=1 python -m pytest)"
    want = path.read_text()
    if text != want:
        diff = [
            f"line {i + 1}:\n  want {a}\n  got  {b}"
            for i, (a, b) in enumerate(zip(want.splitlines(), text.splitlines()))
            if a != b
        ][:3]
        if not diff:
            diff = [f"{len(want.splitlines())} lines wanted, {len(text.splitlines())} got"]
        raise AssertionError(
            f"{name} differs from the golden file (hint: UPDATE_GOLDEN=1 if intended)\n" + "\n".join(diff)
        )
