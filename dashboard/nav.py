"""The dashboard's pages (file, title, URL path): read by app.py to route and by pages to link to each other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PAGES_DIR = Path(__file__).resolve().parent / "views"


@dataclass(kw_only=True, frozen=True)
class PageSpec:
    path: str
    """Page file, relative to dashboard/ (not "pages/": Streamlit would also serve that folder as v1 pages)."""
    title: str
    icon: str
    url_path: str
    default: bool = False


PAGES = (
    PageSpec(path="views/overview.py", title="Overview", icon=":material/dashboard:", url_path="overview",
             default=True),
    PageSpec(path="views/timeline.py", title="Timeline", icon=":material/view_timeline:", url_path="timeline"),
    PageSpec(path="views/stragglers.py", title="Stragglers", icon=":material/directions_walk:",
             url_path="stragglers"),
    PageSpec(path="views/communication.py", title="Communication", icon=":material/swap_horiz:",
             url_path="communication"),
    PageSpec(path="views/pipeline.py", title="Pipeline", icon=":material/stacked_bar_chart:", url_path="pipeline"),
    PageSpec(path="views/precision.py", title="Precision", icon=":material/percent:", url_path="precision"),
    PageSpec(path="views/checkpoints.py", title="Checkpoints", icon=":material/save:", url_path="checkpoints"),
    PageSpec(path="views/devices.py", title="Devices", icon=":material/memory:", url_path="devices"),
    PageSpec(path="views/kernels.py", title="Kernels", icon=":material/bar_chart:", url_path="kernels"),
    PageSpec(path="views/compare.py", title="Compare", icon=":material/compare_arrows:", url_path="compare"),
    PageSpec(path="views/planner.py", title="Planner", icon=":material/architecture:", url_path="planner"),
)

FINDING_PAGE = {
    "STRAGGLER": "views/stragglers.py",
    "RANK_STALL": "views/stragglers.py",
    "EXPOSED_COMM": "views/communication.py",
    "COMM_INEFFICIENT": "views/communication.py",
    "COMPRESSION": "views/communication.py",
    "PIPELINE_BUBBLE": "views/pipeline.py",
    "AMP_OVERFLOW": "views/precision.py",
    "CHECKPOINT_STALL": "views/checkpoints.py",
    "DEVICE_THROTTLE": "views/devices.py",
    "DEVICE_XID": "views/devices.py",
    "MEMORY_PRESSURE": "views/devices.py",
    "HANG": "views/timeline.py",
    "RANK_CRASH": "views/timeline.py",
    "LOW_MFU": "views/kernels.py",
}
"""Where each finding code's evidence is drawn; the Overview links every finding there."""
