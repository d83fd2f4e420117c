"""The job config's step and resilience tables ``[precision]``, ``[compression]``, ``[ckpt]`` and ``[hang]``:
torch-free dataclasses, fields of ``runtime.config.JobConfig``, read by their owners (``runtime.precision``,
``runtime.compression``, ``runtime.checkpoint``/``runtime.recovery``, ``runtime.hang``).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

from dtprobe.runtime.options import option
from dtprobe.store.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")
COMPRESSION_METHODS = ("none", "fp16", "bf16", "powersgd", "topk", "signsgd")
_COMPRESSION_PARAMS = {"powersgd": {"rank", "min_compression_rate", "seed"}, "topk": {"ratio"}}


@dataclass(kw_only=True, frozen=True)
class PrecisionConfig:
    """Numeric precision of the training step (``--precision``)."""

    dtype: str = option("fp32", flag="--precision")
    """Compute dtype under autocast: ``fp32`` (autocast off), ``bf16`` or ``fp16`` (adds dynamic loss scaling)."""
    init_scale: float = 2.0 ** 16
    """fp16 only: the loss scale at step 0."""
    growth_interval: int = 2000
    """fp16 only: consecutive overflow-free steps before the scale doubles."""
    backoff_factor: float = 0.5
    """fp16 only: the factor the scale is multiplied by after an overflow."""

    def __post_init__(self) -> None:
        if self.dtype not in PRECISIONS:
            raise ConfigError(f"precision = {self.dtype!r}; choose one of {', '.join(PRECISIONS)} "
                              f"(e.g. --precision bf16).")
        if not self.init_scale > 0:
            raise ConfigError(f"precision.init_scale = {self.init_scale}; it must be > 0 (2**16 = 65536 is usual).")
        if self.growth_interval < 1:
            raise ConfigError(f"precision.growth_interval = {self.growth_interval}; it must be >= 1 step.")
        if not 0 < self.backoff_factor < 1:
            raise ConfigError(f"precision.backoff_factor = {self.backoff_factor}; it must be in (0, 1), e.g. 0.5.")

    @property
    def uses_loss_scaling(self) -> bool:
        return self.dtype == "fp16"


def _compression_table(spec: str) -> dict[str, Any]:
    """``--compress topk:ratio=0.01`` -> the whole ``[compression]`` table."""
    return dataclasses.asdict(CompressionConfig.parse(spec))


@dataclass(kw_only=True, frozen=True)
class CompressionConfig:
    """Gradient compression of DDP's bucket all-reduces (``--compress METHOD[:key=value,...]``)."""

    method: str = option("none", flag="--compress", metavar="METHOD[:k=v]", parse=_compression_table,
                         fills_section=True)
    """One of none, fp16, bf16, powersgd, topk, signsgd; on the command line with its parameters, e.g.
    ``powersgd:rank=2`` or ``topk:ratio=0.01``."""
    rank: int = 2
    """powersgd: the approximation rank r."""
    min_compression_rate: float = 2.0
    """powersgd: a matrix is compressed only if n*m / (r*(n+m)) reaches this; otherwise it is sent raw."""
    seed: int = 0
    """powersgd: seed of the initial Q matrices (must be the same on every rank)."""
    ratio: float = 0.01
    """topk: fraction of each bucket's elements sent (k = ceil(ratio * n))."""

    def __post_init__(self) -> None:
        if self.method not in COMPRESSION_METHODS:
            raise ConfigError(f"compress = {self.method!r}; choose one of {', '.join(COMPRESSION_METHODS)} "
                              f"(e.g. --compress topk:ratio=0.01 or --compress powersgd:rank=2).")
        if self.rank < 1:
            raise ConfigError(f"compress powersgd rank = {self.rank}; it must be >= 1 (e.g. powersgd:rank=2).")
        if not 0 < self.ratio <= 1:
            raise ConfigError(f"compress topk ratio = {self.ratio}; it must be in (0, 1] (e.g. topk:ratio=0.01).")
        if not self.min_compression_rate >= 1:
            raise ConfigError(f"compress powersgd min_compression_rate = {self.min_compression_rate}; "
                              f"it must be >= 1.")

    @classmethod
    def parse(cls, spec: str) -> "CompressionConfig":
        """``"topk:ratio=0.01"`` -> ``CompressionConfig(method="topk", ratio=0.01)``."""
        method, _, rest = spec.strip().partition(":")
        method = method.strip()
        if method not in COMPRESSION_METHODS:
            raise ConfigError(f"--compress {spec!r}: unknown method {method!r}; choose one of "
                              f"{', '.join(COMPRESSION_METHODS)}.")
        kwargs: dict[str, Any] = {}
        allowed = _COMPRESSION_PARAMS.get(method, set())
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or key not in allowed:
                hint = f"it takes {', '.join(sorted(allowed))}" if allowed else "it takes no parameters"
                raise ConfigError(f"--compress {spec!r}: bad parameter {item!r} for {method}; {hint} "
                                  f"(e.g. powersgd:rank=2, topk:ratio=0.01).")
            try:
                kwargs[key] = int(value) if key in ("rank", "seed") else float(value)
            except ValueError:
                raise ConfigError(f"--compress {spec!r}: {key}={value!r} is not a number.") from None
        return cls(method=method, **kwargs)

    @property
    def spec(self) -> str:
        """The canonical ``--compress`` string."""
        if self.method == "powersgd":
            return f"powersgd:rank={self.rank}"
        if self.method == "topk":
            return f"topk:ratio={self.ratio:g}"
        return self.method


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """When and how the runtime checkpoints (``--ckpt-every``, ``--ckpt-async``, ``--ckpt-keep``)."""

    every: int = option(0, flag="--ckpt-every", metavar="K")
    """Checkpoint after every K-th completed step (K = ``every``); 0 turns checkpointing off."""
    async_save: bool = option(False, flag="--ckpt-async")
    """``dcp.async_save`` on a dedicated process group: training continues while the files are written."""
    keep: int = option(2, flag="--ckpt-keep", metavar="N")
    """Committed checkpoints kept (newest first); 0 keeps all."""
    resume: bool = True
    """Load the newest verified checkpoint at start when one exists (always the case after a restart)."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"ckpt.every = {self.every}; use 0 (off) or a step interval >= 1, e.g. --ckpt-every 5.")
        if self.keep < 0:
            raise ConfigError(f"ckpt.keep = {self.keep}; use 0 (keep all) or >= 1, e.g. --ckpt-keep 2.")
        if self.async_save and self.every == 0:
            warnings.warn("--ckpt-async has no effect without --ckpt-every K.", stacklevel=3)

    @property
    def enabled(self) -> bool:
        return self.every > 0


@dataclass(kw_only=True, frozen=True)
class HangConfig:
    """The collective watchdog (``--collective-timeout``)."""

    collective_timeout_s: float = option(0.0, flag="--collective-timeout", metavar="T")
    """Seconds a collective may stay incomplete before the watchdog reports a hang (a ``faults`` row ``hang``)
    and exits; 0 = off."""
    poll_interval_s: float = 1.0
    """Seconds between the watchdog's checks (and progress publications)."""

    def __post_init__(self) -> None:
        if self.collective_timeout_s < 0:
            raise ConfigError(f"hang.collective_timeout_s = {self.collective_timeout_s}; use 0 (off) or a number of "
                              f"seconds, e.g. --collective-timeout 30.")
        if not self.poll_interval_s > 0:
            raise ConfigError(f"hang.poll_interval_s = {self.poll_interval_s}; it must be > 0 (e.g. 1.0).")

    @property
    def enabled(self) -> bool:
        return self.collective_timeout_s > 0


__all__ = ["COMPRESSION_METHODS", "CheckpointConfig", "CompressionConfig", "HangConfig", "PRECISIONS",
           "PrecisionConfig"]
