"""The words the dashboard shows for the clocks behind timing verdicts: how the ranks' clocks were aligned
(``metrics.run.clock_aligned``), which clock arrivals were read on (``metrics.run.arrival_clock``) and a finding's
``evidence.clock``; read by the Overview, the finding cards and the Stragglers page. Plain strings, no Streamlit.

The vocabulary is docs/findings.md's (*Clocks of the evidence*): ``host``, ``device``, ``mixed``; ``host`` or
``device_collectives`` or ``not aligned: <why>`` for the alignment. Each line keeps the raw value in backticks so a
user can find it in ``dtprobe analyze --format json``.
"""

from __future__ import annotations

CLOCK_WORDS = {"host": "host clock", "device": "device clock", "mixed": "mixed host and device clocks"}
"""``evidence.clock`` / ``arrival_clock`` value -> how a label names it."""

ARRIVAL_MEANING = {
    "host": "host enqueue times; on CUDA that is the kernel launch, not its execution",
    "device": "when each rank's device reached the collective",
    "mixed": "device arrivals in the groups that have them, host enqueues elsewhere",
}
"""What an arrival on each clock is."""


def clock_words(clock: str | None) -> str:
    """``device`` -> "device clock" (for axis and column labels); an unknown value is named as it is."""
    return CLOCK_WORDS.get(str(clock), f"{clock} clock")


def alignment_line(clock_aligned: str) -> str:
    """How the ranks' times were put on one clock, as one sentence."""
    if clock_aligned == "host":
        return "Ranks' clocks aligned by the host clock offsets dtprobe measured (`host`)."
    if clock_aligned == "device_collectives":
        return ("Ranks' clocks aligned from the collectives' ends on the device (`device_collectives`): a trace "
                "folder records no offsets.")
    why = clock_aligned.removeprefix("not aligned:").strip().rstrip(".")
    return f"Ranks' clocks not aligned: {why}." if why else "Ranks' clocks not aligned."


def arrival_line(arrival_clock: str | None, clock_aligned: str) -> str:
    """Which clock collectives' arrivals (the straggler verdicts) were read on, as one sentence; when the ranks'
    clocks are not aligned (``clock_aligned``), that their arrivals were not compared."""
    if arrival_clock is None:
        return "No collective arrivals: no straggler verdict."
    meaning = ARRIVAL_MEANING.get(arrival_clock)
    clock = f"the {clock_words(arrival_clock)} (`{arrival_clock}`" + (f": {meaning})" if meaning else ")")
    if clock_aligned.startswith("not aligned"):
        return f"Arrivals timed on {clock} were not compared across ranks: their clocks are not aligned."
    return f"Arrivals read on {clock}."


def run_clocks(clock_aligned: str, arrival_clock: str | None) -> str:
    """The run's clocks as two Markdown lines: the alignment, then the arrival clock."""
    return f"{alignment_line(clock_aligned)}  \n{arrival_line(arrival_clock, clock_aligned)}"


def evidence_line(clock: str | None) -> str | None:
    """A finding's evidence clock as one line; None for a finding judged on no timing."""
    if clock is None:
        return None
    return f"Timing evidence on the {clock_words(clock)} (`{clock}`)."
