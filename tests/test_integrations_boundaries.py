"""``dtprobe/integrations`` records a framework's loop through ``dtprobe.attach`` only: no analysis, dashboard,
runtime or Streamlit, and each callback module imports its own framework, never the other's (an AST walk, as
``test_import_boundaries`` does; the rules are the integrations row of docs/architecture.md)."""

from __future__ import annotations

import pytest
from test_import_boundaries import _banned_hits


@pytest.mark.parametrize("banned", ["dtprobe.analysis", "dtprobe.dashboard", "dtprobe.runtime", "streamlit"])
def test_integrations_package_does_not_import(banned):
    assert _banned_hits("dtprobe/integrations", banned) == []


@pytest.mark.parametrize("module,framework,other", [("dtprobe/integrations/hf.py", "transformers", "lightning"),
                                                    ("dtprobe/integrations/lightning.py", "lightning", "transformers")])
def test_each_integration_imports_its_own_framework_and_not_the_other(module, framework, other):
    assert _banned_hits(module, framework) != []
    assert _banned_hits(module, other) == []
