"""``dtprobe/export`` reads runs through the analysis facade and the store only: no Streamlit, no
torch.distributed, no collectors, runtime or dashboard (an AST walk, as ``test_import_boundaries`` does); and
importing the export commands does not import the exporters' libraries."""

from __future__ import annotations

import pytest
from test_import_boundaries import _banned_hits


@pytest.mark.parametrize("banned", ["streamlit", "torch.distributed", "dtprobe.collectors", "dtprobe.runtime",
                                    "dtprobe.dashboard"])
def test_export_package_does_not_import(banned):
    assert _banned_hits("dtprobe/export", banned) == []


@pytest.mark.parametrize("command", ["dtprobe/commands/serve_metrics.py", "dtprobe/commands/export.py"])
def test_export_commands_do_not_import_streamlit_or_torch_distributed(command):
    assert _banned_hits(command, "streamlit") == _banned_hits(command, "torch.distributed") == []


def test_export_command_modules_import_none_of_the_exporters_libraries(run_python):
    """``dtprobe --help`` imports every command module: these stay light (libraries load inside ``main``)."""
    res = run_python("import sys; import dtprobe.commands.export, dtprobe.commands.serve_metrics; "
                     "print(sorted(m for m in ('tensorboard', 'mlflow', 'prometheus_client', 'torch', 'pandas') "
                     "if m in sys.modules))")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
