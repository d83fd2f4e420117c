"""``--stage-sleep fwd_ms=F,bwd_ms=B``: its parsed form (torch-free, so job parsing stays light); the sleep stages
themselves are in ``parallel.pp``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtprobe.store.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class StageSleep:
    """``--stage-sleep fwd_ms=F,bwd_ms=B``: each stage's compute is replaced by a fixed sleep per micro-batch,
    so pipeline timing tests do not depend on a noisy CPU. The loss is then meaningless (mean activation)."""

    fwd_ms: float
    """Sleep of every forward (F) of one stage and micro-batch, in milliseconds."""
    bwd_ms: float
    """Sleep of every backward (B; I for split-backward schedules) of one stage and micro-batch."""

    def __post_init__(self) -> None:
        if not (self.fwd_ms >= 0 and self.bwd_ms >= 0):
            raise ConfigError(f"stage_sleep = fwd_ms={self.fwd_ms},bwd_ms={self.bwd_ms}; both must be >= 0 ms.")


def parse_stage_sleep(text: str | None) -> StageSleep | None:
    """Parse ``"fwd_ms=10,bwd_ms=20"`` (``--stage-sleep``); None or empty -> None."""
    if not text:
        return None
    values: dict[str, float] = {}
    for part in str(text).split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in ("fwd_ms", "bwd_ms"):
            raise ConfigError(f"--stage-sleep {text!r}: expected 'fwd_ms=F,bwd_ms=B' (milliseconds), e.g. "
                              f"'fwd_ms=10,bwd_ms=20'; got the part {part!r}.")
        try:
            values[key] = float(value)
        except ValueError:
            raise ConfigError(f"--stage-sleep {text!r}: {key} = {value!r} is not a number of milliseconds.") from None
    if set(values) != {"fwd_ms", "bwd_ms"}:
        raise ConfigError(f"--stage-sleep {text!r}: give both fwd_ms and bwd_ms, e.g. 'fwd_ms=10,bwd_ms=20'.")
    return StageSleep(**values)
