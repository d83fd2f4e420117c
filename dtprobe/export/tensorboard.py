"""TensorBoard event files of a run: per-step scalars (step time per rank, tokens/s, loss, loss scale, exposed
communication and lateness per rank) and the findings as text; written by ``dtprobe export tensorboard``.

Written with ``torch.utils.tensorboard.SummaryWriter``, PyTorch's documented writer (scalars and text, kept with
each torch release); TensorBoard's own ``tensorboard.summary.Writer`` is marked experimental and writes scalars
only. Tags (one point per step; a step re-run after a restart keeps its last attempt):

- ``step_time_ms/rank<R>``: the rank's step, start to end (``steps`` table);
- ``tokens_per_s``: tokens of all ranks over the step's wall time (``RunAnalysis.throughput``);
- ``loss``: mean over the ranks that recorded a loss (``steps`` table);
- ``loss_scale``: AMP loss scale after the step (``RunAnalysis.amp_steps``);
- ``exposed_comm_frac/rank<R>``: exposed communication net of straggler wait, share of the step
  (``RunAnalysis.comm_exposure``);
- ``lateness_frac/<group>/rank<R>``: arrival after the median of its peers, share of the step
  (``RunAnalysis.rank_lateness``: analysed steps only);
- text ``findings``: the findings document in Markdown (``dtprobe analyze --format md``) at the last step.

Wall times are the step ends (Unix seconds on rank 0's clock).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from dtprobe.analysis.facade import RunAnalysis
from dtprobe.analysis.render import render_markdown
from dtprobe.export.extras import require
from dtprobe.store.errors import ConfigError

SERIES_COLUMNS = ["tag", "step", "value", "wall_time_s"]
"""Columns of ``scalar_series``."""
FINDINGS_TAG = "findings"
"""Tag of the findings text."""
EVENT_FILE_GLOB = "events.out.tfevents.*"
"""Names of TensorBoard event files."""


@dataclass(frozen=True, kw_only=True)
class TensorBoardExport:
    """What ``write_tensorboard`` wrote."""

    log_dir: Path
    """The directory holding the event file (point ``tensorboard --logdir`` at it or its parent)."""
    num_points: int
    """Scalar points written."""
    tags: tuple[str, ...]
    """Scalar tags written, sorted."""
    num_findings: int
    """Findings in the text."""


def last_attempt(steps: pd.DataFrame) -> pd.DataFrame:
    """The finished rows of ``steps`` with one row per (rank, step): the last attempt's after a restart."""
    s = steps.dropna(subset=["start_ns", "end_ns"])
    s = s.assign(_restart=s["restart"].fillna(0)).sort_values(["_restart", "end_ns"])
    return s.drop_duplicates(["rank", "step"], keep="last").drop(columns="_restart")


def _rank_tags(prefix: str, *, by_group: bool = False) -> Callable[[pd.DataFrame], pd.Series]:
    """Tags ``<prefix>/rank<R>`` (``<prefix>/<pg>/rank<R>`` with ``by_group``) of a frame's rows."""
    def tags(frame: pd.DataFrame) -> pd.Series:
        head = prefix + "/" + frame["pg"].astype(str) if by_group else prefix
        return head + "/rank" + frame["rank"].astype("int64").astype(str)
    return tags


def scalar_series(analysis: RunAnalysis) -> pd.DataFrame:
    """Every scalar point of the export (see the module docstring for the tags), sorted by step then tag, one per
    (tag, step). Columns: ``SERIES_COLUMNS``."""
    steps = last_attempt(analysis.table("steps"))
    step_end_s = steps.groupby("step")["end_ns"].max().astype("float64") / 1e9
    parts = []

    def add(tags: str | Callable[[pd.DataFrame], pd.Series], frame: pd.DataFrame, value: str) -> None:
        frame = frame.dropna(subset=[value])
        frame = frame[frame["step"].isin(step_end_s.index)]
        if not frame.empty:
            parts.append(pd.DataFrame({
                "tag": tags(frame).to_numpy() if callable(tags) else tags,
                "step": frame["step"].astype("int64").to_numpy(),
                "value": frame[value].astype("float64").to_numpy(),
                "wall_time_s": frame["step"].map(step_end_s).to_numpy(dtype="float64")}))

    add(_rank_tags("step_time_ms"), steps.assign(step_ms=(steps["end_ns"] - steps["start_ns"]) / 1e6), "step_ms")
    add("tokens_per_s", analysis.throughput(), "tokens_per_s")
    add("loss", steps.dropna(subset=["loss"]).groupby("step", as_index=False)["loss"].mean(), "loss")
    add("loss_scale", analysis.amp_steps(), "scale_after")
    add(_rank_tags("exposed_comm_frac"), analysis.comm_exposure(), "exposed_frac")
    add(_rank_tags("lateness_frac", by_group=True), analysis.rank_lateness(), "lateness_frac")
    if not parts:
        return pd.DataFrame({c: [] for c in SERIES_COLUMNS})
    out = pd.concat(parts, ignore_index=True)
    out = out.drop_duplicates(["tag", "step"], keep="last").sort_values(["step", "tag"], kind="stable")
    return out.reset_index(drop=True)[SERIES_COLUMNS]


def write_tensorboard(analysis: RunAnalysis, *, log_dir: str | Path) -> TensorBoardExport:
    """Write the run's scalars (``scalar_series``) and findings text as one TensorBoard event file in ``log_dir``
    (created). ConfigError when ``log_dir`` already holds event files (TensorBoard would show both) or is a file,
    or TensorBoard is not installed; TraceError (from the store) for an unusable run."""
    log_dir = Path(log_dir)
    if log_dir.exists() and not log_dir.is_dir():
        raise ConfigError(f"-o '{log_dir}' exists and is not a directory; pass a directory for the event file.")
    if log_dir.is_dir() and any(log_dir.glob(EVENT_FILE_GLOB)):
        raise ConfigError(f"-o '{log_dir}' already holds TensorBoard event files, so TensorBoard would draw both "
                          f"exports as one run. Pass a new directory (e.g. one per run under your --logdir) or "
                          f"remove the old files.")
    what = "dtprobe export tensorboard"
    require("tensorboard", extra="tensorboard", what=what)
    writer_module = require("torch.utils.tensorboard", extra="tensorboard", what=what)
    series = scalar_series(analysis)
    report = analysis.report()
    last_step = int(series["step"].max()) if not series.empty else 0
    writer = writer_module.SummaryWriter(log_dir=str(log_dir))
    try:
        for tag, step, value, wall in series.itertuples(index=False):
            writer.add_scalar(tag, value, int(step), walltime=wall)
        writer.add_text(FINDINGS_TAG, render_markdown(report), global_step=last_step)
    finally:
        writer.close()
    return TensorBoardExport(log_dir=log_dir, num_points=len(series), tags=tuple(sorted(series["tag"].unique())),
                             num_findings=len(report["findings"]))
