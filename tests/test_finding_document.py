"""The Finding record and the dtprobe.findings/1 JSON document shape."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from dtprobe.analysis.findings import CODES, Finding, PredictedGain, jsonable, sort_findings

REQUIRED_CODES = {"STRAGGLER", "EXPOSED_COMM", "PIPELINE_BUBBLE", "AMP_OVERFLOW", "CHECKPOINT_STALL",
                  "COMM_INEFFICIENT", "HANG", "DEVICE_THROTTLE", "COMPRESSION"}


def _finding(**kw):
    base = dict(code="STRAGGLER", severity="warning", ranks=(3, 1), group="dp", title="t",
                evidence={"x": np.float64(0.5), "n": np.int64(3), "nan": float("nan"), "na": pd.NA,
                          "nested": {"a": [np.int32(1), 2.0]}},
                recommendation="r", predicted_gain=PredictedGain(metric="step_time", frac=0.123456789))
    base.update(kw)
    return Finding(**base)


def test_finding_to_json_has_exactly_the_documented_keys_and_plain_values():
    doc = _finding().to_json()
    assert list(doc) == ["code", "severity", "ranks", "group", "title", "evidence", "recommendation",
                         "predicted_gain"]
    assert doc["ranks"] == [1, 3]
    assert doc["evidence"] == {"x": 0.5, "n": 3, "nan": None, "na": None, "nested": {"a": [1, 2.0]}}
    assert doc["predicted_gain"] == {"metric": "step_time", "frac": 0.1235}
    json.dumps(doc)                                    # plain JSON, no numpy


def test_finding_without_gain_serializes_null():
    assert _finding(predicted_gain=None).to_json()["predicted_gain"] is None


def test_every_required_code_exists():
    assert REQUIRED_CODES <= set(CODES)


@pytest.mark.parametrize("bad", [{"code": "NOPE"}, {"severity": "fatal"}])
def test_finding_rejects_unknown_code_or_severity(bad):
    with pytest.raises(AssertionError):
        _finding(**bad)


def test_sort_findings_puts_critical_first():
    fs = [_finding(severity="info", code="COMPRESSION"), _finding(severity="critical", code="HANG"), _finding()]
    assert [f.severity for f in sort_findings(fs)] == ["critical", "warning", "info"]


def test_jsonable_turns_frames_into_records():
    assert jsonable(pd.DataFrame({"a": [1, 2], "b": [0.5, np.nan]})) == [{"a": 1, "b": 0.5}, {"a": 2, "b": None}]
