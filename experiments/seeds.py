"""--seeds of the experiment programs: comma-separated integers, distinct, at least one."""

from __future__ import annotations

from typing import Sequence


def parse_seeds(seeds: Sequence[str]) -> list[int]:
    """--seeds strings -> distinct ints (at least one); ValueError naming the flag."""
    try:
        out = [int(s) for s in seeds if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds: integers expected, got {','.join(seeds)}") from None
    if not out or len(set(out)) != len(out):
        raise ValueError(f"--seeds: give one or more distinct seeds, got {','.join(seeds)}")
    return out
