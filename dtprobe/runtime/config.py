"""The job config of ``dtprobe run``: one frozen dataclass per concern, TOML + flag merging, JSON round trip.

Read by the launcher (validation before anything starts), written to ``<run>/job.json`` and read back by every
worker (``DTPROBE_JOB``). Sections: ``[model]`` ModelConfig, ``[layout]`` LayoutConfig, ``[train]`` TrainConfig,
``[collect]`` ``dtprobe.collectors.config.CollectConfig``, ``inject`` (fault specs, see ``runtime.faults``), and the
top-level launch keys of ``JobConfig``.

Seam for other owners (RELIABILITY: precision, compression, checkpoint, recovery, hang): a module listed in
``PLUGIN_MODULES`` may call ``register_section("precision", PrecisionConfig)`` at import time; ``[precision]``
in job.toml (and ``--set precision.key=value`` on the command line) then validates into that dataclass and the
worker reads it with ``job.section("precision")`` (the registered class's defaults when the file has none).
The same modules register their fault kinds with ``runtime.faults.register_fault_kind``.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from dtprobe.catalog import BUILTIN_MODELS
from dtprobe.collectors.config import CollectConfig
from dtprobe.runtime.faults import FaultSpec, parse_fault
from dtprobe.runtime.parallel.mesh import AC_MODES, PP_SCHEDULES, ZERO_STAGES
from dtprobe.store.errors import ConfigError

PLUGIN_MODULES: tuple[str, ...] = (
    "dtprobe.runtime.precision",
    "dtprobe.runtime.compression",
    "dtprobe.runtime.checkpoint",
    "dtprobe.runtime.recovery",
    "dtprobe.runtime.hang",
)
"""Modules imported (when they exist) before a job is parsed, so they can register sections and fault kinds."""

SECTIONS: dict[str, type] = {}
"""Extra config sections registered by plugin modules: TOML table name -> frozen dataclass."""

PLUGIN_SECTIONS: dict[str, str] = {
    "precision": "dtprobe.runtime.precision:PrecisionConfig",
    "compression": "dtprobe.runtime.compression:CompressionConfig",
}
"""Sections whose dataclass lives in another owner's module (``module:Class``), imported when first used."""


def register_section(name: str, cls: type) -> None:
    """Make ``[name]`` a valid job.toml table validated by the frozen dataclass ``cls`` (plugin seam)."""
    assert dataclasses.is_dataclass(cls), f"{cls} must be a dataclass"
    assert name not in _CORE_SECTIONS, f"section {name!r} is built in"
    SECTIONS[name] = cls


def load_plugins() -> None:
    """Import every existing module of ``PLUGIN_MODULES`` (a module that is absent is skipped; a broken one raises)
    and register the ``PLUGIN_SECTIONS`` whose module exists."""
    for module in PLUGIN_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    for name, target in PLUGIN_SECTIONS.items():
        module_name, _, class_name = target.partition(":")
        if name not in SECTIONS and module_name in sys.modules:
            SECTIONS[name] = getattr(sys.modules[module_name], class_name)


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """Which built-in GPT to train."""

    name: str = "tiny"
    """Preset name: ``tiny`` (0.9M params), ``small`` (6.6M) or ``medium`` (39M); see ``catalog.BUILTIN_MODELS``."""

    def __post_init__(self) -> None:
        if self.name not in BUILTIN_MODELS:
            raise ConfigError(f"model.name = {self.name!r} is not a preset; use --model with one of "
                              f"{list(BUILTIN_MODELS)}.")


@dataclass(kw_only=True, frozen=True)
class LayoutConfig:
    """How ranks split the work. Only pure data parallel is handled by the runtime itself; TP, PP and ZeRO are
    ``runtime.parallel``'s (which validates the combinations in ``parallel.mesh.check_layout``)."""

    dp: int = -1
    """Data-parallel degree; -1 uses every rank left after tp * pp."""
    tp: int = 1
    """Tensor-parallel degree; 1 disables TP."""
    pp: int = 1
    """Pipeline ranks; 1 disables PP."""
    zero: int = 0
    """ZeRO stage over the dp axis: 0 (plain DDP), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule (with pp > 1): one of ``parallel.mesh.PP_SCHEDULES``."""
    microbatches: int = 0
    """Pipeline micro-batches per step (with pp > 1); 0 = 2 * pp. Must divide the per-rank batch size."""
    virtual_stages: int = 0
    """Pipeline stages per rank; 0 = the schedule's natural count (2 for interleaved-1f1b and zbv, else 1)."""
    sequence_parallel: bool = False
    """Shard LayerNorm/dropout activations along the sequence over the tp axis (needs tp > 1)."""
    activation_checkpointing: str = "none"
    """Recompute activations in backward: one of ``parallel.mesh.AC_MODES`` (none, selective, full)."""
    stage_sleep: str = ""
    """LAYOUTS (tests, demos): ``fwd_ms=F,bwd_ms=B`` replaces every pipeline stage's compute by a fixed sleep per
    micro-batch (needs pp > 1; the loss is then meaningless); empty = real compute."""

    def __post_init__(self) -> None:
        if self.dp != -1 and self.dp < 1:
            raise ConfigError(f"layout.dp = {self.dp}; use a degree >= 1, or -1 for every rank left after tp * pp.")
        for key in ("tp", "pp"):
            if getattr(self, key) < 1:
                raise ConfigError(f"layout.{key} = {getattr(self, key)}; it must be >= 1 (1 disables it).")
        if self.zero not in ZERO_STAGES:
            raise ConfigError(f"layout.zero = {self.zero}; use one of {list(ZERO_STAGES)} (0 = off).")
        if self.microbatches < 0 or self.virtual_stages < 0:
            raise ConfigError(f"layout.microbatches ({self.microbatches}) and layout.virtual_stages "
                              f"({self.virtual_stages}) must be >= 0 (0 = automatic).")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"layout.pp_schedule = {self.pp_schedule!r}; use one of {list(PP_SCHEDULES)}.")
        if self.stage_sleep:   # LAYOUTS: validates 'fwd_ms=F,bwd_ms=B' (ConfigError naming the flag)
            from dtprobe.runtime.parallel.stage_sleep import parse_stage_sleep

            parse_stage_sleep(self.stage_sleep)
        if self.activation_checkpointing not in AC_MODES:
            raise ConfigError(f"layout.activation_checkpointing = {self.activation_checkpointing!r}; use one of "
                              f"{list(AC_MODES)}.")

    def resolve(self, world_size: int) -> "Layout":
        """Concrete degrees for ``world_size`` ranks; ConfigError naming the flags when they do not multiply up."""
        model_ranks = self.tp * self.pp
        dp = world_size // model_ranks if self.dp == -1 else self.dp
        if dp < 1 or dp * model_ranks != world_size:
            shown = dp if self.dp != -1 else f"-1 -> {dp}"
            fix = (f"Set --dp -1 (or --dp {world_size // model_ranks}) to use every rank"
                   if world_size % model_ranks == 0 else
                   f"Choose --tp/--pp whose product divides {world_size}")
            raise ConfigError(
                f"layout.dp({shown}) * layout.tp({self.tp}) * layout.pp({self.pp}) = {max(dp, 0) * model_ranks}, "
                f"but WORLD_SIZE = {world_size} (--nproc x --nnodes). {fix}, or launch "
                f"{max(dp, 1) * model_ranks} processes (--nproc {max(dp, 1) * model_ranks} --nnodes 1).")
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(dp=dp, microbatches=self.microbatches or (2 * self.pp if self.pp > 1 else 1))
        return Layout(**values)


@dataclass(kw_only=True, frozen=True)
class Layout(LayoutConfig):
    """A ``LayoutConfig`` resolved against the world size: ``dp`` and ``microbatches`` are concrete. Drop-in for
    ``parallel.mesh.check_layout`` and ``parallel.parallelize``."""

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def is_pure_dp(self) -> bool:
        """Plain DDP: no TP, no PP, no ZeRO (the runtime's own path; anything else goes to ``runtime.parallel``)."""
        return self.tp == 1 and self.pp == 1 and self.zero == 0 and not self.stage_sleep


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """The optimisation: steps, batch, learning rate, data. Read by ``runtime.train``."""

    steps: int = 30
    """Optimizer steps to run (numbered 0 .. steps-1)."""
    batch_size: int = 8
    """Sequences per micro-batch on each data-parallel rank."""
    seq_len: int = 64
    """Tokens per sequence (at most the preset's max_seq_len)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (DDP syncs only on the last one)."""
    lr: float = 1e-3
    """Peak AdamW learning rate for a global batch of ``reference_batch`` sequences."""
    lr_scaling: str = "linear"
    """``linear``: peak lr = lr * global_batch / reference_batch (Goyal et al. 2017); ``none``: lr as given."""
    reference_batch: int = 32
    """Global batch (sequences per step over all dp ranks) that ``lr`` was tuned for."""
    warmup: int = 5
    """Linear warmup steps to the peak lr (0 = none)."""
    clip: float = 1.0
    """Max global gradient norm (``clip_grad_norm_``); 0 disables clipping."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    seed: int = 0
    """Seeds the weights and the data order: the same seed gives the same losses."""
    bucket_mb: float = 25.0
    """DDP gradient bucket size (``bucket_cap_mb``) in MiB."""
    data: str = "synthetic"
    """``synthetic`` (seeded Markov-chain tokens) or ``text`` (the shipped byte-level corpus)."""

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "grad_accum", "reference_batch"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key} = {getattr(self, key)}; it must be >= 1.")
        if self.seq_len < 2:
            raise ConfigError(f"train.seq_len = {self.seq_len}; it must be >= 2 tokens.")
        if not self.lr > 0:
            raise ConfigError(f"train.lr = {self.lr}; it must be > 0 (e.g. 1e-3).")
        if self.lr_scaling not in ("linear", "none"):
            raise ConfigError(f"train.lr_scaling = {self.lr_scaling!r}; use 'linear' or 'none'.")
        if self.warmup < 0 or self.clip < 0 or self.weight_decay < 0:
            raise ConfigError(f"train.warmup ({self.warmup}), train.clip ({self.clip}) and train.weight_decay "
                              f"({self.weight_decay}) must be >= 0.")
        if not self.bucket_mb > 0:
            raise ConfigError(f"train.bucket_mb = {self.bucket_mb}; it must be > 0 MiB (torch's default is 25).")
        if self.data not in ("synthetic", "text"):
            raise ConfigError(f"train.data = {self.data!r}; use 'synthetic' or 'text'.")

    def global_batch(self, dp: int) -> int:
        """Sequences per optimizer step over all dp ranks."""
        return self.batch_size * self.grad_accum * dp

    def peak_lr(self, dp: int) -> float:
        """The learning rate after warmup, with the linear scaling rule applied when enabled."""
        if self.lr_scaling == "none":
            return self.lr
        return self.lr * self.global_batch(dp) / self.reference_batch


_LAUNCH_KEYS = ("run_dir", "device", "nproc", "nnodes", "node_rank", "rdzv_endpoint", "max_restarts",
                "timeout_s", "cpu_bind")
_CORE_SECTIONS = {"model": ModelConfig, "layout": LayoutConfig, "train": TrainConfig, "collect": CollectConfig}


@dataclass(kw_only=True, frozen=True)
class JobConfig:
    """Everything one ``dtprobe run`` needs; serialized to ``<run>/job.json`` for the workers."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """``[model]``."""
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    """``[layout]``."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """``[train]``."""
    collect: CollectConfig = field(default_factory=CollectConfig)
    """``[collect]``: telemetry switches (``dtprobe.collectors.config``)."""
    faults: tuple[FaultSpec, ...] = ()
    """Injected faults (``inject = ["straggler:rank=2,delay_ms=40"]`` / ``--inject``)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Plugin sections (``register_section``) by name; read with ``section(name)``."""
    run_dir: str | None = None
    """Run directory; None -> ``runs/<timestamp>-<model>-dp<N>`` (chosen by the launcher)."""
    device: str = "auto"
    """``auto`` (cuda when available), ``cpu`` or ``cuda``."""
    nproc: int = 1
    """Worker processes per node (torchrun ``--nproc-per-node``)."""
    nnodes: int = 1
    """Nodes (torchrun ``--nnodes``); > 1 needs ``rdzv_endpoint`` and a run_dir on a shared filesystem."""
    node_rank: int = 0
    """This node's index; node 0's launcher writes the manifest and compacts the store."""
    rdzv_endpoint: str | None = None
    """``host:port`` of the c10d rendezvous (multi-node); None on one node (torchrun ``--standalone``)."""
    max_restarts: int = 0
    """torchrun ``--max-restarts``: how often the workers are restarted after a failure."""
    timeout_s: float = 300.0
    """Process-group timeout (seconds) for init and every collective: how long a hang lasts before it errors."""
    cpu_bind: str = "auto"
    """``auto``: on a CPU device each worker binds to its own share of the node's cores (``worker.bind_cores``),
    so ranks do not migrate between cores and the scheduler's noise stays off their step times; ``off``: leave
    placement to the OS."""

    def __post_init__(self) -> None:
        if self.cpu_bind not in ("auto", "off"):
            raise ConfigError(f"cpu_bind = {self.cpu_bind!r}; use --cpu-bind auto or off.")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device = {self.device!r}; use --device auto, cpu or cuda.")
        if self.nproc < 1 or self.nnodes < 1:
            raise ConfigError(f"nproc = {self.nproc}, nnodes = {self.nnodes}; both must be >= 1.")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank = {self.node_rank} but nnodes = {self.nnodes}; use --node-rank "
                              f"0..{self.nnodes - 1}.")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigError(f"nnodes = {self.nnodes} needs a rendezvous: pass --rdzv-endpoint HOST:PORT (the "
                              f"same on every node, e.g. node 0's address and a free port).")
        if self.nnodes > 1 and not self.run_dir:
            raise ConfigError("a multi-node run needs --run-dir: the same path on every node, on a shared "
                              "filesystem (node 0 writes the manifest, every rank writes its events there).")
        if self.rdzv_endpoint and ":" not in self.rdzv_endpoint:
            raise ConfigError(f"rdzv_endpoint = {self.rdzv_endpoint!r}; give HOST:PORT, e.g. 10.0.0.1:29500.")
        if self.max_restarts < 0 or not self.timeout_s > 0:
            raise ConfigError(f"max_restarts ({self.max_restarts}) must be >= 0 and timeout_s ({self.timeout_s}) "
                              f"> 0.")
        max_len = BUILTIN_MODELS[self.model.name].seq_len
        if self.train.seq_len > max_len:
            raise ConfigError(f"train.seq_len = {self.train.seq_len} exceeds model '{self.model.name}' "
                              f"max_seq_len {max_len}; use --seq-len <= {max_len} or a larger --model.")
        for name in self.extra:
            if name not in SECTIONS:
                raise ConfigError(f"unknown config section [{name}]; known: "
                                  f"{sorted([*_CORE_SECTIONS, *SECTIONS])}.")
        # every registered plugin section is present (its defaults when not given): job.json records them all
        object.__setattr__(self, "extra", {**{n: cls() for n, cls in SECTIONS.items()}, **self.extra})

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def resolve_layout(self) -> Layout:
        """The layout for ``nproc * nnodes`` ranks, after checking the faults target existing ranks and steps."""
        layout = self.layout.resolve(self.world_size)
        for spec in self.faults:
            spec.check_against(world_size=self.world_size, steps=self.train.steps, job=self)
        if not layout.is_pure_dp:
            from dtprobe.runtime.model import model_config
            from dtprobe.runtime.parallel.mesh import check_layout

            shape = model_config(self.model.name)
            check_layout(layout, world_size=self.world_size, num_layers=shape.num_layers,
                         seq_len=self.train.seq_len, batch_size=self.train.batch_size * layout.dp,
                         num_heads=shape.num_heads)
        return layout

    def section(self, name: str) -> Any:
        """A plugin section: the parsed one, the registered class's defaults, or None if no plugin registered it."""
        if name in self.extra:
            return self.extra[name]
        cls = SECTIONS.get(name)
        return cls() if cls is not None else None

    # ------------------------------------------------------------------------------------------ (de)serialization

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (the content of job.json, also the manifest's ``config``)."""
        out: dict[str, Any] = {name: dataclasses.asdict(getattr(self, name)) for name in _CORE_SECTIONS}
        out["collect"]["profile_steps"] = (list(self.collect.profile_steps)
                                           if self.collect.profile_steps is not None else None)
        out["inject"] = [spec.to_string() for spec in self.faults]
        for name, value in sorted(self.extra.items()):
            out[name] = dataclasses.asdict(value)
        for key in _LAUNCH_KEYS:
            out[key] = getattr(self, key)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> "JobConfig":
        """Validate a nested dict (TOML file, job.json, or merged flags); ConfigError names the bad key."""
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in data.items():
            if key in _CORE_SECTIONS or key in SECTIONS:
                if not isinstance(value, Mapping):
                    raise ConfigError(f"{source}: [{key}] must be a table of keys, got {value!r}.")
                section = _build_section(key, (_CORE_SECTIONS | SECTIONS)[key], value, source)
                (kwargs if key in _CORE_SECTIONS else extra)[key] = section
            elif key == "inject":
                items = [value] if isinstance(value, (str, Mapping)) else list(value or [])
                kwargs["faults"] = tuple(parse_fault(item, source=f"{source}: inject") for item in items)
            elif key in _LAUNCH_KEYS:
                kwargs[key] = value
            else:
                known = sorted([*_CORE_SECTIONS, *SECTIONS, "inject", *_LAUNCH_KEYS])
                raise ConfigError(f"{source}: unknown key '{key}'; known top-level keys and tables: {known}.")
        try:
            return cls(**kwargs, extra=extra)
        except TypeError as exc:
            raise ConfigError(f"{source}: {exc}") from None


def _build_section(name: str, cls: type, values: Mapping[str, Any], source: str) -> Any:
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key in values:
        if key not in known:
            raise ConfigError(f"{source}: unknown key '{name}.{key}'; [{name}] accepts {sorted(known)}.")
    converted = {}
    for key, value in values.items():
        if key == "profile_steps" and isinstance(value, list):
            value = tuple(value)
        converted[key] = _check_type(f"{name}.{key}", known[key], value, source)
    return cls(**converted)


def _check_type(dotted: str, fld: dataclasses.Field, value: Any, source: str) -> Any:
    """Coerce ints to floats for float fields; reject a wrong scalar type with a message naming the key."""
    default = fld.default if fld.default is not dataclasses.MISSING else None
    if value is None or default is None:
        return value
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, str):
        ok = isinstance(value, str)
    else:
        ok = True
    if not ok:
        raise ConfigError(f"{source}: {dotted} = {value!r} should be a {type(default).__name__} "
                          f"(like the default {default!r}).")
    return value


def read_toml(path: str | Path) -> dict[str, Any]:
    """The TOML job file as a dict; ConfigError naming the file on a missing or malformed file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file. Pass the path of a TOML job file.") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML ({exc}). Fix the file.") from None


def merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` applied key by key (tables merged one level deep): flags override the file."""
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in base.items()}
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key].update(value)
        else:
            out[key] = dict(value) if isinstance(value, Mapping) else value
    return out


def load_job(path: str | Path) -> JobConfig:
    """Read ``job.json`` (written by the launcher) back into a JobConfig (used by every worker)."""
    import json

    load_plugins()
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"DTPROBE_JOB={path}: cannot read the job file ({exc}); start workers with "
                          f"`dtprobe run`, which writes it.") from None
    return JobConfig.from_dict(data, source=str(path))


__all__ = ["JobConfig", "Layout", "LayoutConfig", "ModelConfig", "TrainConfig", "load_job", "load_plugins",
           "merge", "read_toml", "register_section"]
