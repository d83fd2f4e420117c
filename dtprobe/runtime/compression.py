"""Gradient compression as DDP communication hooks; produces one ``compression`` row per bucket and step.

Methods (``--compress``): ``none`` (DDP's own all-reduce), ``fp16``, ``bf16`` (cast, all-reduce, cast back),
``powersgd[:rank=2]`` (rank-r PowerSGD with warm start and error feedback), ``topk[:ratio=0.01]`` (top-k
magnitudes with error feedback), ``signsgd`` (scaled sign, 1 bit per element, with error feedback).

Every hook issues its collectives **synchronously from the autograd thread**, in the same order on every rank,
and returns a finished future. torch's stock PowerSGD hook issues its second all-reduce from a ``Future.then``
callback on a gloo worker thread, so with several buckets in flight ranks issue collectives in different orders
(size-mismatch aborts or hangs on gloo); these hooks cannot. Correct on gloo and NCCL alike; on NCCL the price
is no overlap of a bucket's communication with the rest of backward.

Telemetry per bucket (table ``compression``, read by the analysis' compression finding): ``raw_bytes`` (the
bucket's fp32 gradient, what DDP would all-reduce), ``sent_bytes`` (what this rank contributes to the
collectives), ``encode_ns``/``decode_ns`` (compute only; communication excluded), ``residual_norm`` (L2 norm of
the error-feedback memory after this step; null for fp16/bf16 which keep none). Compression ratio =
raw_bytes / sent_bytes:

- fp16/bf16: 2 exactly.
- top-k: ``k = ceil(ratio * n)`` values (fp32) plus k **int32** indices, so ``4n / 8k`` (50x at ratio 0.01).
- signsgd: ``ceil(n / 8)`` bytes of packed sign bits plus one fp32 scale: about 32x.
- PowerSGD rank r: a gradient of shape (n, m...) viewed as an n x m matrix sends P (n x r) and Q (m x r), ratio
  ``n*m / (r*(n+m))``; it is compressed only when that ratio is >= ``min_compression_rate`` (2), otherwise it
  (like every 1-D tensor) is all-reduced raw and counted as sent raw. ``expected_ratio`` computes the model's
  overall ratio from parameter shapes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from dtprobe.runtime.config_sections import CompressionConfig  # noqa: F401 (its config, re-exported)

Recorder = Callable[[str, dict[str, Any]], None]


# ---------------------------------------------------------------- ratios (for docs, tests and the planner)

def powersgd_matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int] | None:
    """The (n, m) matrix view PowerSGD uses for a gradient of ``shape``; None for 1-D (sent raw)."""
    if len(shape) < 2:
        return None
    return int(shape[0]), int(math.prod(shape[1:]))


def powersgd_compresses(shape: torch.Size | tuple[int, ...], *, rank: int, min_compression_rate: float) -> bool:
    nm = powersgd_matrix_shape(shape)
    if nm is None:
        return False
    n, m = nm
    return n * m >= min_compression_rate * rank * (n + m)


def expected_ratio(config: CompressionConfig, shapes: Iterable[torch.Size | tuple[int, ...]]) -> float:
    """Raw bytes / sent bytes over all gradients of ``shapes`` treated as one bucket each per method's rule.

    Exact for fp16/bf16 and PowerSGD (bucketing does not change them); for top-k and signsgd it ignores the
    per-bucket rounding of k and of the packed bits (under 1% for buckets above a few thousand elements).
    """
    numels = [int(math.prod(s)) for s in shapes]
    raw = 4 * sum(numels)
    if config.method == "none":
        return 1.0
    if config.method in ("fp16", "bf16"):
        return 2.0
    if config.method == "topk":
        return 1.0 / (2.0 * config.ratio)
    if config.method == "signsgd":
        return 32.0
    sent = 0
    for s, n_el in zip(shapes, numels):
        if powersgd_compresses(s, rank=config.rank, min_compression_rate=config.min_compression_rate):
            n, m = powersgd_matrix_shape(s)
            sent += 4 * config.rank * (n + m)
        else:
            sent += 4 * n_el
    return raw / sent


# ---------------------------------------------------------------- the hook

@dataclass
class _BucketStats:
    sent_bytes: int
    encode_ns: int
    decode_ns: int
    residual_norm: float | None


class CompressionHook:
    """DDP comm-hook state: the method's per-bucket memory, the current step, and the telemetry sink.

    Register with ``register_compression(ddp, config, record=probe.record)``. Rows carry the step of
    ``probe.step`` (or the one given to ``set_step``, for use without a probe).
    """

    def __init__(self, config: CompressionConfig, *, process_group: Any = None,
                 record: Recorder | None = None) -> None:
        assert config.method != "none"
        self.config = config
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.step: int | None = None
        """Set by ``set_step``; when never set, the probe's current step
        (``dtprobe.collectors.collective_recorder.RECORDER``)."""
        self._record = record or (lambda table, row: None)
        self._residuals: dict[int, torch.Tensor] = {}
        self._qs: dict[int, list[torch.Tensor]] = {}
        self._layouts: dict[int, tuple] = {}
        """Bucket index -> the parameters its memory (residual, PowerSGD's Q) was laid out for (``_layout``)."""
        self._reduce = {"fp16": self._cast, "bf16": self._cast, "topk": self._topk,
                        "signsgd": self._signsgd, "powersgd": self._powersgd}[config.method]

    def set_step(self, step: int) -> None:
        self.step = int(step)

    def __call__(self, bucket: dist.GradBucket) -> torch.Tensor:
        """All-reduce (average) ``bucket`` in place through the method; returns the averaged buffer."""
        buf, index = bucket.buffer(), bucket.index()
        layout = _layout(bucket)
        if self._layouts.get(index) != layout:
            # The first step, or DDP rebuilt its buckets (after the first step it regroups the parameters in the
            # order their gradients became ready): this index may now hold other parameters or the same ones in
            # another order, even at the same size, so the memory laid out for the old ones would be added to the
            # wrong gradients (and PowerSGD's Q would not fit them). It starts again from zero.
            self._layouts[index] = layout
            self._residuals.pop(index, None)
            self._qs.pop(index, None)
        stats = self._reduce(index, buf, bucket.gradients())
        self._record("compression", {
            "step": self.step if self.step is not None else _probe_step(), "bucket": int(index),
            "method": self.config.spec,
            "raw_bytes": buf.numel() * buf.element_size(), "sent_bytes": stats.sent_bytes,
            "encode_ns": stats.encode_ns, "decode_ns": stats.decode_ns, "residual_norm": stats.residual_norm})
        return buf

    # --- error feedback memory
    def _residual(self, index: int, buf: torch.Tensor) -> torch.Tensor:
        """The bucket's error-feedback memory (zeros when its layout is new: ``__call__``)."""
        res = self._residuals.get(index)
        if res is None:
            res = self._residuals[index] = torch.zeros_like(buf)
        return res

    # --- methods: each averages buf in place and reports its own encode/decode time
    def _cast(self, index: int, buf: torch.Tensor, grads: list[torch.Tensor]) -> _BucketStats:
        dtype = torch.float16 if self.config.method == "fp16" else torch.bfloat16
        t0 = time.perf_counter_ns()
        low = buf.div(self.world_size).to(dtype)
        t1 = time.perf_counter_ns()
        dist.all_reduce(low, group=self.process_group)
        t2 = time.perf_counter_ns()
        buf.copy_(low)
        t3 = time.perf_counter_ns()
        return _BucketStats(low.numel() * low.element_size(), t1 - t0, t3 - t2, None)

    def _topk(self, index: int, buf: torch.Tensor, grads: list[torch.Tensor]) -> _BucketStats:
        t0 = time.perf_counter_ns()
        res = self._residual(index, buf)
        res.add_(buf)                                       # res = grad + error memory
        n = buf.numel()
        k = max(1, math.ceil(self.config.ratio * n))
        idx = res.abs().topk(k, sorted=False).indices
        # values and int32 indices travel in one fp32 all_gather (indices bit-cast, never computed on)
        payload = torch.cat([res[idx], idx.to(torch.int32).view(torch.float32)])
        res[idx] = 0.0                                      # what was sent leaves the memory
        t1 = time.perf_counter_ns()
        gathered = [torch.empty_like(payload) for _ in range(self.world_size)]
        dist.all_gather(gathered, payload, group=self.process_group)
        t2 = time.perf_counter_ns()
        buf.zero_()
        for part in gathered:
            buf.index_add_(0, part[k:].view(torch.int32).long(), part[:k])
        buf.div_(self.world_size)
        t3 = time.perf_counter_ns()
        return _BucketStats(payload.numel() * 4, t1 - t0, t3 - t2, float(res.norm()))

    def _signsgd(self, index: int, buf: torch.Tensor, grads: list[torch.Tensor]) -> _BucketStats:
        t0 = time.perf_counter_ns()
        res = self._residual(index, buf)
        res.add_(buf)
        n = buf.numel()
        scale = res.abs().mean().reshape(1)                 # ||p||_1 / n (EF-signSGD, Karimireddy et al. 2019)
        positive = res >= 0
        res.sub_(torch.where(positive, scale, -scale))      # memory keeps what the scaled sign missed
        payload = torch.cat([_pack_bits(positive), scale.view(torch.uint8)])
        t1 = time.perf_counter_ns()
        gathered = [torch.empty_like(payload) for _ in range(self.world_size)]
        dist.all_gather(gathered, payload, group=self.process_group)
        t2 = time.perf_counter_ns()
        buf.zero_()
        for part in gathered:
            sign = _unpack_bits(part[:-4], n).to(buf.dtype).mul_(2).sub_(1)
            buf.add_(sign.mul_(part[-4:].view(torch.float32)))
        buf.div_(self.world_size)
        t3 = time.perf_counter_ns()
        return _BucketStats(payload.numel(), t1 - t0, t3 - t2, float(res.norm()))

    def _powersgd(self, index: int, buf: torch.Tensor, grads: list[torch.Tensor]) -> _BucketStats:
        cfg = self.config
        t0 = time.perf_counter_ns()
        res = self._residual(index, buf)
        buf.add_(res)                                       # grads (views of buf) now include the memory
        res.copy_(buf)                                      # res holds the local input until decode
        mats, raws = [], []
        for g in grads:
            if powersgd_compresses(g.shape, rank=cfg.rank, min_compression_rate=cfg.min_compression_rate):
                mats.append(g.view(g.shape[0], -1))
            else:
                raws.append(g)
        qs = self._qs.get(index)
        if qs is None:
            gen = torch.Generator().manual_seed(cfg.seed + 7919 * index)
            qs = [torch.randn(m.shape[1], cfg.rank, generator=gen, dtype=buf.dtype).to(buf.device) for m in mats]
            self._qs[index] = qs
        raw_flat = torch.cat([g.reshape(-1) for g in raws]) if raws else buf.new_zeros(0)
        ps = [m @ q for m, q in zip(mats, qs)]
        p_flat = torch.cat([p.reshape(-1) for p in ps]) if ps else buf.new_zeros(0)
        enc = time.perf_counter_ns() - t0
        # Collective 1 and 2 (every rank, same order): raw tensors + P in one all-reduce; then Q.
        first = torch.cat([raw_flat, p_flat])
        dist.all_reduce(first, group=self.process_group)
        t1 = time.perf_counter_ns()
        raw_flat, p_flat = first[:raw_flat.numel()], first[raw_flat.numel():]
        ps = [_orthonormalize(p) for p in _split_like(p_flat, ps)]
        new_qs = [m.t() @ p for m, p in zip(mats, ps)]
        q_flat = torch.cat([q.reshape(-1) for q in new_qs]) if new_qs else buf.new_zeros(0)
        enc += time.perf_counter_ns() - t1
        if q_flat.numel():
            dist.all_reduce(q_flat, group=self.process_group)
        t2 = time.perf_counter_ns()
        q_flat.div_(self.world_size)
        new_qs = _split_like(q_flat, new_qs)
        for m, p, q in zip(mats, ps, new_qs):
            torch.matmul(p, q.t(), out=m)
        offset = 0
        for g in raws:
            g.copy_(raw_flat[offset:offset + g.numel()].view_as(g).div(self.world_size))
            offset += g.numel()
        res.sub_(buf)                                       # memory = local input - averaged approximation
        for i, q in enumerate(new_qs):                      # warm start: next step's Q is this step's Q
            qs[i] = q.clone()
        t3 = time.perf_counter_ns()
        sent = 4 * (raw_flat.numel() + sum(p.numel() for p in ps) + q_flat.numel())
        return _BucketStats(sent, enc, t3 - t2, float(res.norm()))


def _compression_hook(state: CompressionHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(state(bucket))
    return fut


# DDP checks the hook's annotations by identity; ``from __future__ import annotations`` made them strings.
_compression_hook.__annotations__ = {"state": CompressionHook, "bucket": dist.GradBucket,
                                     "return": torch.futures.Future[torch.Tensor]}


def register_compression(ddp_model: Any, config: CompressionConfig, *, process_group: Any = None,
                         record: Recorder | None = None) -> CompressionHook | None:
    """Register the hook for ``config`` on a ``DistributedDataParallel`` model; None (DDP's default) for none."""
    if config.method == "none":
        return None
    state = CompressionHook(config, process_group=process_group, record=record)
    ddp_model.register_comm_hook(state, _compression_hook)
    return state


def _layout(bucket: Any) -> tuple:
    """Which parameters a bucket holds, in order: each one's address and shape."""
    return tuple((p.data_ptr(), tuple(p.shape)) for p in bucket.parameters())


def _probe_step() -> int:
    try:
        from dtprobe.collectors.collective_recorder import RECORDER
    except ImportError:
        return -1
    return int(RECORDER.step)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Bool vector -> uint8, 8 per byte (MSB first), zero-padded."""
    n = bits.numel()
    padded = torch.zeros(math.ceil(n / 8) * 8, dtype=torch.uint8, device=bits.device)
    padded[:n] = bits
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=bits.device)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    shifts = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8, device=packed.device)
    return ((packed.view(-1, 1) >> shifts) & 1).view(-1)[:n]


def _orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p`` (reduced QR); deterministic, so identical on every rank."""
    return torch.linalg.qr(p, mode="reduced").Q


def _split_like(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return out
