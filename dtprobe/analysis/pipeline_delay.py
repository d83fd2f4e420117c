"""Pipeline own delay: time a pipeline rank is neither running an action nor waiting for its input, and its own
time on its stage against the same stage of the other pipelines; read by the straggler detector (which rank of a
late pipeline is the origin) and the facade."""

from __future__ import annotations

from typing import Iterable

import numpy as np
import pandas as pd

from dtprobe.analysis.arrivals import median_of_others_in_groups
from dtprobe.analysis.bubble import whole_rounds
from dtprobe.analysis.tables import P2P_OPS, axis_of, group_members, step_durations
from dtprobe.intervals import merge_intervals_by_group
from dtprobe.store.columns import require_columns

OWN_DELAY_COLUMNS = ["rank", "step", "own_delay_ns", "num_actions"]
STAGE_EXCESS_COLUMNS = ["rank", "step", "pipeline", "stage", "run_ns", "own_ns", "own_excess_frac",
                        "own_excess_rel"]


def pipeline_groups(collectives: pd.DataFrame) -> dict[int, tuple[int, ...]]:
    """rank -> the ranks of its pipeline: the members of its ``pp`` process group, else the connected p2p peers."""
    groups: dict[int, tuple[int, ...]] = {}
    if collectives.empty:
        return groups
    names = collectives["pg"].fillna("").unique()
    pp_names = [pg for pg in names if axis_of(pg) == "pp"]      # per group name, not per row
    if pp_names:
        pp = collectives.loc[collectives["pg"].isin(pp_names), "pg_ranks"]
        for pg_ranks in pp.dropna().unique():
            members = group_members(pg_ranks)
            groups.update({r: members for r in members})
    p2p = collectives[collectives["op"].isin(P2P_OPS) & collectives["peer"].notna()]
    comps: dict[int, list[int]] = {}
    for r, root in _components((int(a), int(b)) for a, b in
                               p2p[["rank", "peer"]].drop_duplicates().itertuples(index=False)).items():
        comps.setdefault(root, []).append(r)
    for members in comps.values():
        for r in members:
            groups.setdefault(r, tuple(sorted(members)))
    return groups


def _components(pairs: Iterable[tuple[int, int]]) -> dict[int, int]:
    """node -> the smallest node of its connected component, over the undirected edges ``pairs``."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x
    for a, b in pairs:
        ra, rb = find(a), find(b)
        parent[max(ra, rb)] = min(ra, rb)
    return {x: find(x) for x in list(parent)}


def pipeline_ids(groups: dict[int, tuple[int, ...]]) -> dict[int, int]:
    """rank -> its pipeline's id, the smallest rank of it (``groups`` from ``pipeline_groups``)."""
    return {r: min(g) for r, g in groups.items()}


def pipeline_replicas(groups: dict[int, tuple[int, ...]], group_rows: pd.DataFrame, *,
                      axis_of_pg=axis_of) -> dict[int, int]:
    """rank -> its model replica's id (the smallest rank of it): its pipeline and the pipelines of its
    tensor-parallel peers (members of its ``tp`` groups in ``group_rows``: pg, pg_ranks), which run each stage in
    lockstep with it, so one stage of a replica is never measured against another pipeline of the same replica.
    Without tensor parallelism every pipeline is its own replica (``pipeline_ids``)."""
    links = [(r, pipeline) for r, pipeline in pipeline_ids(groups).items()]
    if not group_rows.empty:
        tp = group_rows.loc[group_rows["pg"].map(lambda pg: axis_of_pg(pg) == "tp").astype(bool), "pg_ranks"]
        for pg_ranks in tp.dropna().unique():
            members = [m for m in group_members(pg_ranks) if m in groups]
            links += [(members[0], m) for m in members[1:]]
    return {r: root for r, root in _components(links).items() if r in groups}


def pipeline_own_delay(pipeline: pd.DataFrame, steps: pd.DataFrame, groups: dict[int, tuple[int, ...]], *,
                       collectives: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per (rank, step) of a pipelined run: time the rank was neither running a pipeline action nor waiting for
    its input (``own_delay_ns``): for each action, start - max(end of its previous action (the step start for
    the first), end of the action producing its input on the neighbouring stage of the same pipeline: F after
    F of stage-1, B/I after B/I of stage+1), less the time in that gap the rank was in a collective of its other
    groups (``collectives``: the rank's host-timed group collectives, e.g. the data-parallel all-reduce a
    zero-bubble schedule issues between its stages' actions, where it waits for the other replicas; host-clocked
    actions only). A rank that sleeps or is slow outside its actions accumulates it; its pipeline peers, which only
    wait, do not, nor do the ranks that wait for it in another group. Columns: ``OWN_DELAY_COLUMNS``."""
    require_columns(pipeline, ["rank", "stage", "step", "microbatch", "action", "start_ns", "end_ns"], table="pipeline")
    p = pipeline.dropna(subset=["start_ns", "end_ns", "stage", "step"])
    if p.empty or not groups:
        return pd.DataFrame({col: [] for col in OWN_DELAY_COLUMNS})
    gid = pipeline_ids(groups)
    d = pd.DataFrame({
        "rank": p["rank"].astype("int64"), "stage": p["stage"].astype("int64"), "step": p["step"].astype("int64"),
        "mb": p["microbatch"].fillna(-1).astype("int64"), "action": p["action"].astype(str),
        "start": p["start_ns"].astype("int64"), "end": p["end_ns"].astype("int64"),
    })
    base = int(d["start"].min())          # relative times: float64 cannot hold Unix nanoseconds exactly
    d["start"] -= base
    d["end"] -= base
    d["g"] = d["rank"].map(gid).fillna(-1).astype("int64")
    d = d[d["g"] >= 0]
    produced = d[d["action"].isin(["F", "B", "I"])].assign(kind=lambda x: x["action"].replace({"I": "B"}))
    produced = produced.groupby(["g", "step", "stage", "kind", "mb"])["end"].max().rename("dep_end")
    d["dep_stage"] = np.where(d["action"] == "F", d["stage"] - 1, d["stage"] + 1)
    d["kind"] = np.where(d["action"] == "F", "F", np.where(d["action"].isin(["B", "I"]), "B", "W"))
    keys = pd.MultiIndex.from_arrays([d["g"], d["step"], d["dep_stage"], d["kind"], d["mb"]])
    d["dep_end"] = produced.reindex(keys).to_numpy()
    d = d.sort_values(["rank", "step", "start"], kind="stable")
    d["prev_end"] = d.groupby(["rank", "step"])["end"].shift()
    starts = step_durations(steps).merge(steps[["rank", "step", "start_ns"]].astype({"rank": "int64", "step": "int64"}),
                                         on=["rank", "step"]) if not steps.empty else None
    if starts is not None:
        # a step recomputed after a torchrun restart has a row per attempt: the newest start serves (one per key,
        # so the merge keeps d's length; the older attempt's actions only lose their first action's delay)
        starts = starts.sort_values("start_ns", kind="stable").drop_duplicates(["rank", "step"], keep="last")
        first = (d.merge(starts[["rank", "step", "start_ns"]], on=["rank", "step"], how="left")["start_ns"]
                 - base).to_numpy(dtype="float64")
        d["prev_end"] = d["prev_end"].fillna(pd.Series(first, index=d.index).astype("float64"))
    d["prev_end"] = d["prev_end"].fillna(d["start"])
    ready = np.fmax(d["prev_end"].to_numpy(dtype="float64"), d["dep_end"].to_numpy(dtype="float64"))
    gap = np.clip(d["start"].to_numpy(dtype="float64") - ready, 0, None)
    host = (p.loc[d.index, "clock"].fillna("host").astype(str).to_numpy() == "host") if "clock" in p else \
        np.ones(len(d), dtype=bool)
    if collectives is not None and gap.any() and host.any():
        gap = gap - np.where(host, _in_collectives(d, ready, collectives, base), 0.0)
    d["delay"] = np.clip(gap, 0, None)
    out = d.groupby(["rank", "step"]).agg(own_delay_ns=("delay", "sum"), num_actions=("delay", "size")).reset_index()
    return out[OWN_DELAY_COLUMNS]


def _in_collectives(d: pd.DataFrame, ready: np.ndarray, collectives: pd.DataFrame, base: int) -> np.ndarray:
    """Per action row of ``d`` (rank, step, start; ``ready``: when its input and the rank were ready, relative to
    ``base``): how long the rank was in one of its host-timed group collectives (not a send/recv) of the same step
    between ``ready`` and the action's start (each instant once)."""
    require_columns(collectives, ["rank", "op", "step", "enqueue_ns", "end_ns", "timing"], table="collectives")
    c = collectives[~collectives["op"].isin(P2P_OPS) & collectives["enqueue_ns"].notna()
                    & collectives["end_ns"].notna() & collectives["step"].notna()
                    & (collectives["timing"].fillna("host") == "host")]
    out = np.zeros(len(d))
    if c.empty:
        return out
    keys = pd.MultiIndex.from_arrays([c["rank"].to_numpy(dtype="int64"), c["step"].to_numpy(dtype="int64")])
    code, pairs = pd.factorize(keys)
    g, s, e = merge_intervals_by_group(code, c["enqueue_ns"].to_numpy(dtype="int64") - base,
                                       c["end_ns"].to_numpy(dtype="int64") - base)
    merged = pd.DataFrame({"rank": pairs.get_level_values(0)[g], "step": pairs.get_level_values(1)[g], "s": s,
                           "e": e})
    acts = pd.DataFrame({"row": np.arange(len(d)), "rank": d["rank"].to_numpy(), "step": d["step"].to_numpy(),
                         "lo": ready, "hi": d["start"].to_numpy(dtype="float64")})
    m = acts[acts["hi"] > acts["lo"]].merge(merged, on=["rank", "step"])
    if m.empty:
        return out
    overlap = np.clip(np.fmin(m["hi"], m["e"]) - np.fmax(m["lo"], m["s"]), 0, None)
    np.add.at(out, m["row"].to_numpy(), overlap.to_numpy(dtype="float64"))
    return out


def schedule_gain_ns(pipeline: pd.DataFrame, own_delay: pd.DataFrame, shape, groups: dict[int, tuple[int, ...]],
                     rank: int, first_step: int, last_step: int, *,
                     replicas: dict[int, int] | None = None) -> float | None:
    """How much shorter, per step over steps ``first_step``..``last_step``, the job's step would be if ``rank`` took
    as long as the same stage's ranks of the other pipelines: the schedule simulator (``schedule_sim.simulate``,
    with ``shape``'s schedule, pipeline ranks, stages per rank and micro-batches: ``bubble.PipelineShape``) replays
    each pipeline with its own mean action costs of those steps; the gain is the longest pipeline's makespan now
    minus the longest with ``rank``'s costs replaced by the other pipelines' at its stages (a stage with slack gives
    back only its share of the fill and drain; a pipeline other than the rank's that takes longer leaves nothing),
    plus the rank's mean own delay (``pipeline_own_delay``: time outside its actions, not waiting for input) over
    the median of those ranks'. None when ``shape`` is None or one the simulator does not take (a schedule named
    in the config that the measured stages contradict), the rank has no actions there, or no other pipeline runs
    its stages. Interleaved 1F1B's micro-batches are rounded up to whole rounds of proportionally cheaper
    micro-batches (the same global batch), as for the ideal bubble. ``replicas`` (``pipeline_replicas``): the other
    pipelines are those of the other model replicas (a tensor-parallel peer's pipeline runs in lockstep with the
    rank's)."""
    from dtprobe.schedule_sim import simulate

    p = pipeline.dropna(subset=["start_ns", "end_ns", "stage", "step"])
    p = p[p["step"].between(first_step, last_step)]
    if shape is None or p.empty or rank not in groups:
        return None
    pipe_of = pipeline_ids(groups)
    d = pd.DataFrame({"pipeline": p["rank"].map(pipe_of).to_numpy(), "rank": p["rank"].to_numpy(dtype="int64"),
                      "stage": p["stage"].to_numpy(dtype="int64"), "action": p["action"].astype(str).to_numpy(),
                      "ns": (p["end_ns"].to_numpy(dtype="int64") - p["start_ns"].to_numpy(dtype="int64"))})
    d = d.dropna(subset=["pipeline"])
    mine = pipe_of[rank]
    replica_of = replicas or pipe_of
    d["replica"] = d["rank"].map(replica_of).fillna(d["pipeline"])
    stages_of = d.groupby("rank")["stage"].agg(frozenset)        # rank -> the stages it runs, read once
    stages = stages_of.get(rank, frozenset())
    others = d[(d["replica"] != replica_of.get(rank, mine)) & d["stage"].isin(stages)]
    if not stages or others.empty:
        return None

    m = whole_rounds(shape, shape.num_microbatches)

    def makespan(rows: pd.DataFrame) -> float:
        costs = rows.groupby(["stage", "action"])["ns"].mean()
        return simulate(shape.schedule, num_ranks=shape.num_ranks, num_microbatches=m,
                        virtual_stages=shape.virtual_stages,
                        costs={(int(s), str(a)): float(c) for (s, a), c in costs.items()}).makespan

    try:
        now = {pl: makespan(rows) for pl, rows in d.groupby("pipeline")}
        fixed = makespan(pd.concat([d[(d["pipeline"] == mine) & ~d["stage"].isin(stages)], others]))
    except ValueError:              # the simulator refuses the shape: no schedule figure, the wait stands
        return None
    rest = [span for pl, span in now.items() if pl != mine]
    # the makespans of m whole rounds at the measured costs: scaled to the real micro-batches' share of them, the
    # same global batch in m (``bubble.ideal_bubble`` scales the costs alike; a makespan is linear in them)
    gain = (max(now.values()) - max([fixed, *rest])) * shape.num_microbatches / m
    o = own_delay[own_delay["step"].between(first_step, last_step)]
    per_rank = o.groupby("rank")["own_delay_ns"].mean()
    peers = [r for r in per_rank.index if replica_of.get(int(r), mine) != replica_of.get(rank, mine)
             and stages_of.get(r) == stages]
    if rank in per_rank.index and peers:
        gain += max(0.0, float(per_rank[rank]) - float(per_rank[peers].median()))
    return max(0.0, float(gain))


def median_own_delay(own_delay: pd.DataFrame) -> dict[int, float]:
    """rank -> median ``own_delay_ns`` over its steps (``pipeline_own_delay`` rows); {} without any."""
    if own_delay.empty:
        return {}
    return {int(r): float(v) for r, v in own_delay.groupby("rank")["own_delay_ns"].median().items()}


def stage_excess(pipeline: pd.DataFrame, steps: pd.DataFrame, own_delay: pd.DataFrame,
                 groups: dict[int, tuple[int, ...]], *, replicas: dict[int, int] | None = None) -> pd.DataFrame:
    """Per (rank, step) of a pipelined run: its actions' run time (``run_ns``), its own time on its stage (``own_ns``:
    ``run_ns`` plus its ``own_delay_ns`` from ``pipeline_own_delay``; neither holds a wait for its input) and how
    much longer that is
    than the median of the same stage in the other model replicas at that step, as a share of the step's median
    duration (``own_excess_frac``) and of that median (``own_excess_rel``: how much slower it is on its stage; both
    NaN where no other replica has the stage). A rank that computes slower or idles outside its actions has a
    positive excess; its pipeline peers, which only wait for it, do not.
    ``pipeline``: the smallest rank of its pipeline (``groups``, from ``pipeline_groups``). A rank's stage is the
    smallest it runs (with several stages per rank, ranks at the same position of their pipelines share it).
    ``replicas`` (``pipeline_replicas``; None: every pipeline its own): a stage of a replica with tensor
    parallelism is its tp ranks, which wait for each other inside every action, so it is measured as one (their
    mean time) against the other replicas, never one tp rank against another. Columns: ``STAGE_EXCESS_COLUMNS``."""
    require_columns(pipeline, ["rank", "stage", "step", "start_ns", "end_ns"], table="pipeline")
    require_columns(own_delay, OWN_DELAY_COLUMNS, table="pipeline_own_delay")
    p = pipeline.dropna(subset=["start_ns", "end_ns", "stage", "step"])
    if p.empty or own_delay.empty or steps.empty or not groups:
        return pd.DataFrame({col: [] for col in STAGE_EXCESS_COLUMNS})
    acts = pd.DataFrame({
        "rank": p["rank"].to_numpy(dtype="int64"), "step": p["step"].to_numpy(dtype="int64"),
        "stage": p["stage"].to_numpy(dtype="int64"),
        "run_ns": (p["end_ns"].to_numpy(dtype="int64") - p["start_ns"].to_numpy(dtype="int64")).astype("float64"),
    }).groupby(["rank", "step"]).agg(stage=("stage", "min"), run_ns=("run_ns", "sum")).reset_index()
    d = acts.merge(own_delay[["rank", "step", "own_delay_ns"]].astype({"rank": "int64", "step": "int64"}),
                   on=["rank", "step"])
    d["pipeline"] = d["rank"].map(pipeline_ids(groups))
    d = d.dropna(subset=["pipeline"]).astype({"pipeline": "int64"})
    step_ns = step_durations(steps).groupby("step")["step_ns"].median()
    d["own_ns"] = d["run_ns"] + d["own_delay_ns"].astype("float64")
    d["replica"] = d["rank"].map(replicas).fillna(d["pipeline"]).astype("int64") if replicas else d["pipeline"]
    keys = ["step", "stage", "replica"]
    unit = d.groupby(keys, sort=False)["own_ns"].mean()     # one rank per stage and replica without tp
    same_stage = unit.index.droplevel("replica").to_frame(index=False).groupby(["step", "stage"], sort=False)
    others = pd.Series(median_of_others_in_groups(unit.to_numpy(dtype="float64"), same_stage.ngroup().to_numpy()),
                       index=unit.index).reindex(pd.MultiIndex.from_frame(d[keys])).to_numpy(dtype="float64")
    d["own_excess_frac"] = (d["own_ns"] - others) / d["step"].map(step_ns).astype("float64")
    d["own_excess_rel"] = np.where(others > 0, d["own_ns"].to_numpy() / np.where(others > 0, others, 1.0) - 1.0,
                                   np.nan)
    return d.sort_values(["rank", "step"], kind="stable").reset_index(drop=True)[STAGE_EXCESS_COLUMNS]
