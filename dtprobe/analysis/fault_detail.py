"""A ``faults`` row's JSON ``detail`` as a dict, for the analyzers that read fault rows (hangs, ckpt_corrupt)."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd


def fault_detail(raw: Any) -> dict:
    """The detail object: {} when missing, ``{"raw": text}`` when it is not JSON (a stack stays readable),
    ``{"value": v}`` when it is JSON but not an object."""
    if raw is None or raw is pd.NA:
        return {}
    try:
        value = json.loads(str(raw))
    except ValueError:
        return {"raw": str(raw)}
    return value if isinstance(value, dict) else {"value": value}
