"""User-facing error types shared by the store, the analysis and the CLI (exit code 2 on these)."""

from __future__ import annotations


class TraceError(ValueError):
    """A run directory or trace file is unusable; the message names the file, what is wrong and the fix."""


class ConfigError(ValueError):
    """A user-facing configuration problem; the message names the key, the numbers and the fix."""
