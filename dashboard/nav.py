"""The dashboard's pages (file, title, URL path): read by app.py to route and by pages to link to each other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PAGES_DIR = Path(__file__).resolve().parent / "pages"


@dataclass(kw_only=True, frozen=True)
class PageSpec:
    path: str
    """Page file, relative to dashboard/."""
    title: str
    icon: str
    url_path: str
    default: bool = False


PAGES = (
    PageSpec(path="pages/overview.py", title="Overview", icon=":material/dashboard:", url_path="overview",
             default=True),
    PageSpec(path="pages/timeline.py", title="Timeline", icon=":material/view_timeline:", url_path="timeline"),
    PageSpec(path="pages/stragglers.py", title="Stragglers", icon=":material/directions_walk:",
             url_path="stragglers"),
    PageSpec(path="pages/communication.py", title="Communication", icon=":material/swap_horiz:",
             url_path="communication"),
    PageSpec(path="pages/pipeline.py", title="Pipeline", icon=":material/stacked_bar_chart:", url_path="pipeline"),
    PageSpec(path="pages/precision.py", title="Precision", icon=":material/percent:", url_path="precision"),
    PageSpec(path="pages/checkpoints.py", title="Checkpoints", icon=":material/save:", url_path="checkpoints"),
    PageSpec(path="pages/devices.py", title="Devices", icon=":material/memory:", url_path="devices"),
    PageSpec(path="pages/kernels.py", title="Kernels", icon=":material/bar_chart:", url_path="kernels"),
    PageSpec(path="pages/compare.py", title="Compare", icon=":material/compare_arrows:", url_path="compare"),
    PageSpec(path="pages/planner.py", title="Planner", icon=":material/architecture:", url_path="planner"),
)

FINDING_PAGE = {
    "STRAGGLER": "pages/stragglers.py",
    "EXPOSED_COMM": "pages/communication.py",
    "COMM_INEFFICIENT": "pages/communication.py",
    "COMPRESSION": "pages/communication.py",
    "PIPELINE_BUBBLE": "pages/pipeline.py",
    "AMP_OVERFLOW": "pages/precision.py",
    "CHECKPOINT_STALL": "pages/checkpoints.py",
    "DEVICE_THROTTLE": "pages/devices.py",
    "DEVICE_XID": "pages/devices.py",
    "MEMORY_PRESSURE": "pages/devices.py",
    "HANG": "pages/timeline.py",
    "RANK_CRASH": "pages/timeline.py",
    "LOW_MFU": "pages/kernels.py",
}
"""Where each finding code's evidence is drawn; the Overview links every finding there."""
