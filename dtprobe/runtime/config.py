"""The job config of ``dtprobe run``: one frozen dataclass per concern, TOML + flag merging, JSON round trip.

Read by the launcher (validation before anything starts), written to ``<run>/job.json`` and read back by every
worker (``DTPROBE_JOB``). Tables: ``[model]`` ModelConfig, ``[layout]`` ``runtime.layout.LayoutConfig``,
``[train]`` TrainConfig, ``[collect]`` ``dtprobe.collectors.config.CollectConfig``, ``[precision]``,
``[compression]``, ``[ckpt]`` and ``[hang]`` (``runtime.config_sections``); ``inject`` (fault specs, see
``runtime.faults``) and the launch keys are top-level keys of ``JobConfig``. The flags of ``dtprobe run`` and the
keys of ``--config job.toml`` are derived from these dataclasses (``runtime.options``). Torch-free.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from dtprobe.catalog import BUILTIN_MODELS
from dtprobe.collectors.config import CollectConfig
from dtprobe.runtime.config_sections import CheckpointConfig, CompressionConfig, HangConfig, PrecisionConfig
from dtprobe.runtime.faults import FaultSpec, parse_fault
from dtprobe.runtime.layout import Layout, LayoutConfig
from dtprobe.runtime.options import LAUNCH_GROUP, Flag, option, section, sections, top_level_keys
from dtprobe.store.errors import ConfigError

LR_SCALINGS = ("linear", "none")
OPTIMIZERS = ("adamw", "lamb", "lars")
DATA_SOURCES = ("synthetic", "text")
DEVICES = ("auto", "cpu", "cuda")
CPU_BINDS = ("auto", "off")
WORKER_STARTS = ("fork", "exec")
WORKER_START_ENV = "DTPROBE_WORKER_START"
"""The variable by which the launcher tells torchrun's agent the job's ``worker_start`` (``runtime.fork_start``)."""


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
class TrainConfig:
    """The optimisation: steps, batch, learning rate, data. Read by ``runtime.train``."""

    steps: int = option(30)
    """Optimizer steps to run (numbered 0 .. steps-1)."""
    batch_size: int = option(8)
    """Sequences per micro-batch on each data-parallel rank."""
    seq_len: int = option(64)
    """Tokens per sequence (at most the preset's max_seq_len)."""
    grad_accum: int = option(1)
    """Micro-batches accumulated per optimizer step (DDP syncs only on the last one)."""
    optimizer: str = option("adamw", choices=OPTIMIZERS)
    """``adamw``; ``lamb`` (Adam moments, update scaled per parameter by the trust ratio ||w||/||update||) or
    ``lars`` (momentum SGD, lr scaled per parameter by 0.001 * ||w||/(||grad|| + weight_decay * ||w||); its lr
    is the paper's global lr, orders of magnitude above AdamW's): the large-batch optimizers of You et al.
    (``runtime.optimizers``). Norms are of whole parameters on every layout; 1-D parameters (biases, norms)
    get neither weight decay nor a trust ratio under lamb and lars."""
    lr: float = option(1e-3)
    """Peak learning rate of ``optimizer`` for a global batch of ``reference_batch`` sequences."""
    lr_scaling: str = option("linear", choices=LR_SCALINGS)
    """``linear``: peak lr = lr * global_batch / reference_batch (Goyal et al. 2017); ``none``: lr as given."""
    reference_batch: int = option(32)
    """Global batch (sequences per step over all dp ranks) that ``lr`` was tuned for."""
    warmup: int = option(5)
    """Linear warmup steps to the peak lr (0 = none)."""
    clip: float = option(1.0)
    """Max global gradient norm (``clip_grad_norm_``); 0 disables clipping."""
    weight_decay: float = 0.1
    """Weight decay (decoupled for adamw and lamb, added to the gradient for lars)."""
    seed: int = option(0)
    """Seeds the weights and the data order: the same seed gives the same losses."""
    bucket_mb: float = option(25.0)
    """DDP gradient bucket size (``bucket_cap_mb``) in MiB."""
    data: str = option("synthetic", choices=DATA_SOURCES)
    """``synthetic`` (seeded Markov-chain tokens) or ``text`` (the shipped byte-level corpus)."""

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "grad_accum", "reference_batch"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key} = {getattr(self, key)}; it must be >= 1.")
        if self.seq_len < 2:
            raise ConfigError(f"train.seq_len = {self.seq_len}; it must be >= 2 tokens.")
        if not self.lr > 0:
            raise ConfigError(f"train.lr = {self.lr}; it must be > 0 (e.g. 1e-3).")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"train.optimizer = {self.optimizer!r}; use --optimizer with one of "
                              f"{list(OPTIMIZERS)}.")
        if self.lr_scaling not in LR_SCALINGS:
            raise ConfigError(f"train.lr_scaling = {self.lr_scaling!r}; use 'linear' or 'none'.")
        if self.warmup < 0 or self.clip < 0 or self.weight_decay < 0:
            raise ConfigError(f"train.warmup ({self.warmup}), train.clip ({self.clip}) and train.weight_decay "
                              f"({self.weight_decay}) must be >= 0.")
        if not self.bucket_mb > 0:
            raise ConfigError(f"train.bucket_mb = {self.bucket_mb}; it must be > 0 MiB (torch's default is 25).")
        if self.data not in DATA_SOURCES:
            raise ConfigError(f"train.data = {self.data!r}; use 'synthetic' or 'text'.")

    def global_batch(self, dp: int) -> int:
        """Sequences per optimizer step over all dp ranks."""
        return self.batch_size * self.grad_accum * dp

    def peak_lr(self, dp: int) -> float:
        """The learning rate after warmup, with the linear scaling rule applied when enabled."""
        if self.lr_scaling == "none":
            return self.lr
        return self.lr * self.global_batch(dp) / self.reference_batch


def parse_step_window(text: str) -> list[int]:
    """``--profile-steps 10-11`` -> [10, 11]; ``10`` -> [10, 10]."""
    first, _, last = text.partition("-")
    try:
        return [int(first), int(last or first)]
    except ValueError:
        raise ConfigError(f"--profile-steps {text!r}: write FIRST-LAST step numbers, e.g. 10-11.") from None


_CKPT_GROUP = "checkpoints and hangs (runtime.recovery, runtime.hang)"
_TELEMETRY_GROUP = "telemetry and faults"
FLAG_GROUPS = (LAUNCH_GROUP, "model and layout", "training", _CKPT_GROUP, _TELEMETRY_GROUP)
"""The groups of ``dtprobe run --help``, in order."""


@dataclass(kw_only=True, frozen=True)
class JobConfig:
    """Everything one ``dtprobe run`` needs; serialized to ``<run>/job.json`` for the workers."""

    model: ModelConfig = section(ModelConfig, group="model and layout", flags={"name": Flag(name="--model")})
    """``[model]``."""
    layout: LayoutConfig = section(LayoutConfig, group="model and layout")
    """``[layout]``."""
    train: TrainConfig = section(TrainConfig, group="training")
    """``[train]``."""
    collect: CollectConfig = section(CollectConfig, group=_TELEMETRY_GROUP, flags={
        "enabled": Flag(name="--no-collect", negate=True),
        "collectives": Flag(name="--no-collectives", negate=True),
        "devices": Flag(name="--no-devices", negate=True),
        "device_interval_s": Flag(name="--device-interval", metavar="S"),
        "profile_steps": Flag(metavar="A-B", parse=parse_step_window)})
    """``[collect]``: telemetry switches (``dtprobe.collectors.config``)."""
    faults: tuple[FaultSpec, ...] = option((), toml="inject", flag="--inject", metavar="KIND:K=V,...",
                                           repeat=True, group=_TELEMETRY_GROUP)
    """Injected faults, repeatable (``inject = ["straggler:rank=2,delay_ms=40"]``; kinds in ``runtime.faults``)."""
    ckpt: CheckpointConfig = section(CheckpointConfig, group=_CKPT_GROUP)
    """``[ckpt]``: checkpoints and resume (``runtime.recovery``)."""
    compression: CompressionConfig = section(CompressionConfig, group="training")
    """``[compression]``: gradient compression of DDP (``runtime.compression``)."""
    hang: HangConfig = section(HangConfig, group=_CKPT_GROUP)
    """``[hang]``: the collective watchdog (``runtime.hang``)."""
    precision: PrecisionConfig = section(PrecisionConfig, group="training")
    """``[precision]``: autocast and loss scaling (``runtime.precision``)."""
    run_dir: str | None = option(None, metavar="DIR")
    """Run directory; unset: ``runs/<timestamp>-<model>-dp<N>`` (chosen by the launcher)."""
    device: str = option("auto", choices=DEVICES)
    """``auto`` (cuda when available), ``cpu`` or ``cuda``."""
    nproc: int = option(1)
    """Worker processes per node (torchrun ``--nproc-per-node``)."""
    nnodes: int = option(1)
    """Nodes (torchrun ``--nnodes``); > 1 needs ``rdzv_endpoint`` and a run_dir on a shared filesystem."""
    node_rank: int = option(0)
    """This node's index, 0..nnodes-1; node 0's launcher writes the manifest and compacts the store."""
    rdzv_endpoint: str | None = option(None, metavar="HOST:PORT")
    """``host:port`` of the c10d rendezvous (multi-node); unset on one node (torchrun ``--standalone``)."""
    max_restarts: int = option(0)
    """torchrun ``--max-restarts``: how often the workers are restarted after a failure."""
    timeout_s: float = option(300.0, flag="--timeout", metavar="S")
    """Process-group timeout (seconds) for init and every collective: how long a hang lasts before it errors."""
    cpu_bind: str = option("auto", choices=CPU_BINDS)
    """``auto``: on a CPU device each worker binds to its own share of the node's cores (``worker.bind_cores``),
    so ranks do not migrate between cores and the scheduler's noise stays off their step times; ``off``: leave
    placement to the OS."""
    worker_start: str = option("fork", choices=WORKER_STARTS)
    """How torchrun's agent starts each worker: ``fork`` a copy of itself that already imported torch and the
    worker's modules (``runtime.fork_start``; the workers skip seconds of imports at every start and restart) or
    ``exec`` a new ``python -m dtprobe.runtime.worker`` (torchrun's own start)."""

    def __post_init__(self) -> None:
        if self.worker_start not in WORKER_STARTS:
            raise ConfigError(f"worker_start = {self.worker_start!r}; use --worker-start fork or exec.")
        if self.cpu_bind not in CPU_BINDS:
            raise ConfigError(f"cpu_bind = {self.cpu_bind!r}; use --cpu-bind auto or off.")
        if self.device not in DEVICES:
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

    # ------------------------------------------------------------------------------------------ (de)serialization

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (the content of job.json, also the manifest's ``config``)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.metadata.get("toml", f.name)] = dataclasses.asdict(value) if "section" in f.metadata else value
        out["collect"]["profile_steps"] = (list(self.collect.profile_steps)
                                           if self.collect.profile_steps is not None else None)
        out["inject"] = [spec.to_string() for spec in self.faults]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> "JobConfig":
        """Validate a nested dict (TOML file, job.json, or merged flags); ConfigError names the bad key."""
        tables, top_level = sections(cls), top_level_keys(cls)
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key in tables:
                if not isinstance(value, Mapping):
                    raise ConfigError(f"{source}: [{key}] must be a table of keys, got {value!r}.")
                kwargs[key] = _build_section(key, tables[key], value, source)
            elif key == "inject":
                items = [value] if isinstance(value, (str, Mapping)) else list(value or [])
                kwargs["faults"] = tuple(parse_fault(item, source=f"{source}: inject") for item in items)
            elif key in top_level:
                kwargs[top_level[key]] = value
            else:
                known = sorted([*tables, *top_level])
                raise ConfigError(f"{source}: unknown key '{key}'; known top-level keys and tables: {known}.")
        try:
            return cls(**kwargs)
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

    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"DTPROBE_JOB={path}: cannot read the job file ({exc}); start workers with "
                          f"`dtprobe run`, which writes it.") from None
    return JobConfig.from_dict(data, source=str(path))


__all__ = ["CheckpointConfig", "CompressionConfig", "HangConfig", "JobConfig", "Layout", "LayoutConfig",
           "ModelConfig", "PrecisionConfig", "TrainConfig", "load_job", "merge", "parse_step_window", "read_toml"]
