"""`dtprobe analyze` on Kineto trace folders: exit 2 naming the file for malformed traces, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtprobe.cli import main

TRACES = Path(__file__).parent / "data" / "traces"


@pytest.mark.parametrize("name", ["rank_not_found.json.gz", "distributed_info_not_found.json.gz",
                                  "rank_non_gpu.json.gz"])
def test_analyze_exits_2_naming_each_malformed_trace(name, capsys):
    assert main(["analyze", str(TRACES / "malformed" / name)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtprobe analyze: error: ") and name in err and "Traceback" not in err


def test_analyze_exits_2_on_the_malformed_folder(capsys):
    assert main(["analyze", str(TRACES / "malformed")]) == 2
    assert "malformed/" in capsys.readouterr().err


@pytest.mark.parametrize("folder", ["gloo_cpu_1rank", "amd_mi250_1rank"])
def test_analyze_accepts_gloo_and_rocm_traces(folder, capsys):
    assert main(["analyze", str(TRACES / folder)]) in (0, 1)   # 1 = critical findings, still analysed
    assert "error" not in capsys.readouterr().err
