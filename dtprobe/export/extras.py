"""``require(module, extra=...)``: import an optional library or raise a ``ConfigError`` naming the pip extra that
installs it; read by every exporter in ``dtprobe.export``."""

from __future__ import annotations

import importlib
from types import ModuleType

from dtprobe.store.errors import ConfigError

EXTRAS = {"tensorboard": "TensorBoard", "mlflow": "MLflow (mlflow-skinny)", "prometheus": "prometheus_client"}
"""pip extra of dtprobe -> the library it installs (pyproject.toml ``[project.optional-dependencies]``)."""


def require(module: str, *, extra: str, what: str) -> ModuleType:
    """``module`` imported; ConfigError telling to ``pip install dtprobe[extra]`` when it (or a library it needs)
    is missing. ``what`` names the command that needs it, for the message."""
    assert extra in EXTRAS, extra
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"{what} needs {EXTRAS[extra]}, which is not installed (import {module!r} failed: {exc}). "
            f"Install it with: pip install dtprobe[{extra}] (or dtprobe[export] for every exporter; quote the "
            f"argument in zsh).") from None
