"""Layout search: every valid (dp, tp, pp, zero, micro-batch, accumulation, recompute, schedule, v) for a
world size, ranked by predicted step time; read by ``dtprobe plan`` and the dashboard's Planner page.

``plan(model, cluster, training, top_k=5) -> PlanResult``: ``layouts`` (fitting, best first, with memory,
breakdown and why each beats the next) and ``rejected`` (layouts that do not fit, with what overflows).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dtprobe.planner.memory import RECOMPUTE
from dtprobe.planner.specs import ClusterSpec, ModelSpec, TrainingSpec
from dtprobe.planner.step_time import MEMORY_COLUMNS, TIME_COLUMNS, Efficiency, evaluate
from dtprobe.store.errors import ConfigError

SCHEMA = "dtprobe.plan/1"
LAYOUT_COLUMNS = ["dp", "tp", "pp", "zero", "micro_batch", "grad_accum", "recompute", "schedule", "virtual_stages"]
"""The knobs of one layout."""
PP_SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4), ("zero-bubble", 1),
                ("zero-bubble", 2), ("zbv", 2))
"""(schedule, virtual stages) tried when pp > 1."""
MICRO_BATCHES = (1, 2, 4, 8)
"""Micro-batch sizes tried (sequences)."""
_MEM_LABELS = {"weights_gib": "weights", "grads_gib": "gradients", "optimizer_gib": "optimizer state",
               "activations_gib": "activations", "logits_gib": "logits", "zero3_buffer_gib": "ZeRO-3 buffers"}
_TIME_LABELS = {"compute_s": "compute", "recompute_s": "recompute", "tp_comm_s": "TP communication",
                "dp_sync_s": "DP gradient sync", "zero3_gather_s": "ZeRO-3 gathers", "pp_p2p_s": "PP send/recv",
                "bubble_s": "pipeline bubble", "optimizer_s": "optimizer step", "overhead_s": "host overhead"}


@dataclass(frozen=True)
class PlanResult:
    """The ranked search; DataFrames keep units in their column names."""

    layouts: pd.DataFrame
    """Top-k fitting layouts, best first: LAYOUT_COLUMNS, memory ``*_gib``, breakdown ``*_s``,
    ``step_time_s``, ``tokens_per_s``, ``mfu_frac``, ``rank`` (1 = best) and ``why`` (vs the next one)."""
    rejected: pd.DataFrame
    """Layouts that do not fit, smallest overflow first, with ``reason``."""
    num_candidates: int
    """Valid layouts evaluated."""
    num_fit: int
    """How many of them fit in memory."""
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    efficiency: Efficiency

    @property
    def best(self) -> pd.Series:
        """The fastest fitting layout; ConfigError when none fits."""
        if self.layouts.empty:
            raise ConfigError(f"no layout of {self.model.name} fits {self.cluster.world_size} x "
                              f"{self.cluster.device.name}; the closest needs {self.rejected['total_gib'].min():.1f} "
                              f"GiB per GPU. Add GPUs, lower --seq-len, or use a larger-memory --gpu.")
        return self.layouts.iloc[0]

    def to_json_dict(self) -> dict:
        """The ``dtprobe.plan/1`` document (see docs/planner.md)."""
        return {"schema": SCHEMA, "model": self.model.name, "device": self.cluster.device.name,
                "device_is_cpu": self.cluster.device.is_cpu, "world_size": self.cluster.world_size,
                "gpus_per_node": self.cluster.gpus_per_node, "global_batch": self.training.global_batch,
                "seq_len": self.training.seq_len, "precision": self.training.precision,
                "num_candidates": self.num_candidates, "num_fit": self.num_fit,
                "layouts": [_row_json(r, extra=("step_time_s", "tokens_per_s", "mfu_frac", "why"))
                            for r in self.layouts.itertuples(index=False)],
                "rejected": [_row_json(r, extra=("reason",)) for r in self.rejected.itertuples(index=False)]}


def _row_json(row, *, extra: tuple[str, ...]) -> dict:
    d = row._asdict()
    out = {k: (str(d[k]) if k in ("recompute", "schedule") else int(d[k])) for k in LAYOUT_COLUMNS}
    out["fits"] = bool(d["fits"])
    out["memory_gib"] = {k.removesuffix("_gib"): round(float(d[k]), 3) for k in MEMORY_COLUMNS}
    if "step_time_s" in extra:
        out["step_time_s"] = round(float(d["step_time_s"]), 6)
        out["breakdown"] = {k: round(float(d[k]), 6) for k in TIME_COLUMNS}
    for k in extra:
        if k not in out and k != "step_time_s":
            out[k] = float(d[k]) if isinstance(d[k], (float, np.floating)) else d[k]
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec) -> pd.DataFrame:
    """Every valid layout: tp divides the heads, pp * v divides the layers, dp * micro_batch divides the batch,
    pipelines get at least ``pp`` micro-batches (interleaved: a multiple of ``pp``), ZeRO only with dp > 1."""
    world = cluster.world_size
    rows = []
    for tp in _divisors(world):
        if model.num_heads % tp:
            continue
        for pp in _divisors(world // tp):
            if model.num_layers % pp:
                continue
            dp = world // (tp * pp)
            scheds = [("none", 1)] if pp == 1 else [
                (name, v) for name, v in PP_SCHEDULES if model.num_layers % (pp * v) == 0]
            for mb in MICRO_BATCHES:
                if training.global_batch % (dp * mb):
                    continue
                m = training.global_batch // (dp * mb)
                if pp > 1 and m < pp:
                    continue
                for zero in (range(4) if dp > 1 else (0,)):
                    for rec, (sched, v) in itertools.product(RECOMPUTE, scheds):
                        if sched == "interleaved-1f1b" and m % pp:
                            continue
                        rows.append((dp, tp, pp, zero, mb, m, rec, sched, v))
    if not rows:
        raise ConfigError(f"no valid layout for {model.name} on {world} GPUs with global batch "
                          f"{training.global_batch}: the batch must be divisible by dp x micro_batch for some "
                          f"dp dividing {world}. Pick --global-batch as a multiple of {world}.")
    return pd.DataFrame(rows, columns=LAYOUT_COLUMNS)


def plan(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, *, top_k: int = 5,
         efficiency: Efficiency | None = None) -> PlanResult:
    """Search all valid layouts; the top ``top_k`` fitting ones by predicted step time, and the rejected."""
    if top_k < 1:
        raise ConfigError(f"--top ({top_k}) must be >= 1")
    eff = efficiency or Efficiency()
    table = evaluate(candidates(model, cluster, training), model=model, cluster=cluster, training=training,
                     eff=eff, keep_all_times=False)
    fit = table[table["fits"]].sort_values(["step_time_s", "total_gib"], kind="stable")
    top = fit.head(top_k + 1).reset_index(drop=True)
    why = [_why(top.iloc[i], top.iloc[i + 1]) if i + 1 < len(top) else "the only layout that fits"
           for i in range(len(top))]
    top = top.assign(why=why, rank=np.arange(1, len(top) + 1)).head(top_k)
    rejected = table[~table["fits"]].sort_values("total_gib", kind="stable").reset_index(drop=True)
    rejected = rejected.assign(reason=_overflow_reasons(rejected))
    return PlanResult(layouts=top, rejected=rejected, num_candidates=len(table), num_fit=len(fit), model=model,
                      cluster=cluster, training=training, efficiency=eff)


def describe(row) -> str:
    """Short name of a layout: ``dp16 tp8 pp4 zero1 mb1x64 sel 1f1b``."""
    sched = "" if row["pp"] == 1 else f" {row['schedule']}" + (f"/v{row['virtual_stages']}"
                                                               if row["virtual_stages"] > 1 else "")
    return (f"dp{row['dp']} tp{row['tp']} pp{row['pp']} zero{row['zero']} mb{row['micro_batch']}x"
            f"{row['grad_accum']} {row['recompute']}{sched}")


def _why(this: pd.Series, nxt: pd.Series) -> str:
    """Which breakdown terms make ``this`` faster than ``nxt`` (largest savings first)."""
    gain = nxt["step_time_s"] - this["step_time_s"]
    diffs = sorted(((nxt[c] - this[c], c) for c in TIME_COLUMNS), reverse=True)
    parts = [f"{_TIME_LABELS[c]} {d * 1e3:.1f} ms less" for d, c in diffs[:2] if d >= 5e-5]
    costs = [f"{_TIME_LABELS[c]} {-d * 1e3:.1f} ms more" for d, c in diffs[-1:] if d <= -5e-5]
    if not parts:
        return (f"ties with {describe(nxt)} (predicted times within 0.1 ms; {this['total_gib']:.1f} vs "
                f"{nxt['total_gib']:.1f} GiB per GPU)")
    return (f"{gain * 1e3:.1f} ms faster than {describe(nxt)}: " + ", ".join(parts)
            + (f" (but {costs[0]})" if costs else ""))


def _overflow_reasons(rej: pd.DataFrame) -> list[str]:
    parts = list(_MEM_LABELS)
    values = rej[parts].to_numpy()
    largest = [_MEM_LABELS[parts[i]] for i in values.argmax(axis=1)] if len(rej) else []
    cols = [rej[c].to_numpy() for c in ("total_gib", "usable_gib", "weights_gib", "grads_gib", "optimizer_gib",
                                        "activations_gib")]
    return [f"needs {tot:.1f} GiB per GPU > {use:.1f} GiB usable; largest part: {name} {big:.1f} GiB "
            f"(weights {w:.1f}, gradients {g:.1f}, optimizer {o:.1f}, activations {a:.1f} GiB)"
            for name, big, tot, use, w, g, o, a in zip(largest, values.max(axis=1) if len(rej) else [], *cols)]
