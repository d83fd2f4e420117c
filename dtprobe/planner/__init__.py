"""dtprobe's layout planner: memory and step-time model, layout search, calibration from a measured run.

Entry points: ``plan(model, cluster, training, top_k=5) -> PlanResult`` (read by ``dtprobe plan`` and the
dashboard's Planner page) and ``calibrate(store) -> Calibration`` (``dtprobe plan --calibrate RUN``).
"""

from __future__ import annotations

from dtprobe.planner.search import LAYOUT_COLUMNS, SCHEMA, PlanResult, candidates, describe, plan
from dtprobe.planner.specs import (GPU_PRESETS, MODEL_PRESETS, ClusterSpec, DeviceSpec, ModelSpec, TrainingSpec,
                                   device_preset, make_cluster, model_preset)
from dtprobe.planner.step_time import Efficiency, evaluate

__all__ = ["GPU_PRESETS", "LAYOUT_COLUMNS", "MODEL_PRESETS", "SCHEMA", "ClusterSpec", "DeviceSpec", "Efficiency",
           "ModelSpec", "PlanResult", "TrainingSpec", "candidates", "describe", "device_preset", "evaluate",
           "make_cluster", "model_preset", "plan"]
