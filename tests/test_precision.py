"""Mixed precision: autocast dtypes, fp16 loss scaling rows, and an injected overflow on 2 ranks via ``dtprobe run``."""

from __future__ import annotations

import pytest
import torch

from dtprobe.runtime.model import build_model, lm_loss
from dtprobe.runtime.precision import MixedPrecision, PrecisionConfig
from dtprobe.store.errors import ConfigError


def _batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _one_step(mp: MixedPrecision, model, opt, *, step: int, inject: bool = False):
    x, y = _batch()
    with mp.autocast():
        logits = model(x)
        loss = lm_loss(logits, y)
    mp.backward(loss, inject_overflow=inject)
    row = mp.step(opt, step=step)
    opt.zero_grad(set_to_none=True)
    return logits, row


@pytest.mark.parametrize("dtype,logits_dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                                ("fp16", torch.float16)])
def test_precision_autocast_computes_in_dtype_and_keeps_fp32_master_weights(dtype, logits_dtype):
    model = build_model("tiny", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logits, _ = _one_step(MixedPrecision(PrecisionConfig(dtype=dtype)), model, opt, step=0)
    assert logits.dtype == logits_dtype
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_precision_fp16_overflow_halves_scale_and_skips_the_step():
    rows: list[tuple[str, dict]] = []
    model = build_model("tiny", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mp = MixedPrecision(PrecisionConfig(dtype="fp16"), record=lambda t, r: rows.append((t, r)))
    _one_step(mp, model, opt, step=0)
    before = [p.detach().clone() for p in model.parameters()]
    _, row = _one_step(mp, model, opt, step=1, inject=True)
    assert row == {"step": 1, "scale_before": 65536.0, "scale_after": 32768.0, "found_inf": True, "skipped": True}
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))     # the step was skipped
    _, row = _one_step(mp, model, opt, step=2)
    assert row["found_inf"] is False and row["scale_before"] == row["scale_after"] == 32768.0
    assert [t for t, _ in rows] == ["amp", "amp", "amp"]


def test_precision_bf16_and_fp32_write_no_amp_rows():
    rows = []
    for dtype in ("fp32", "bf16"):
        model = build_model("tiny", seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _, row = _one_step(MixedPrecision(PrecisionConfig(dtype=dtype), record=lambda t, r: rows.append(r)), model,
                           opt, step=0)
        assert row is None
    assert rows == []


def test_precision_overflow_injection_without_fp16_is_a_config_error():
    model = build_model("tiny", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ConfigError, match="needs --precision fp16"):
        _one_step(MixedPrecision(PrecisionConfig(dtype="bf16")), model, opt, step=0, inject=True)


@pytest.mark.parametrize("kwargs,match", [({"dtype": "fp8"}, "choose one of fp32, bf16, fp16"),
                                          ({"dtype": "fp16", "init_scale": 0}, "init_scale = 0"),
                                          ({"dtype": "fp16", "backoff_factor": 1.0}, "backoff_factor")])
def test_precision_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        PrecisionConfig(**kwargs)


# ------------------------------------------------------------------------------ 2 ranks through dtprobe run

@pytest.mark.multiproc
def test_fp16_overflow_at_step_10_halves_every_ranks_scale_and_skips_the_step(fp16_overflow_run):
    from dtprobe.store import RunStore

    proc = fp16_overflow_run.proc
    assert (fp16_overflow_run.steps, fp16_overflow_run.rank, fp16_overflow_run.step) == (14, 1, 10)
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = RunStore.open(fp16_overflow_run.run_dir)
    amp = store.table("amp")
    assert sorted(amp["rank"].unique()) == [0, 1]
    assert len(amp) == 2 * 14
    at10 = amp[amp["step"] == 10]
    assert len(at10) == 2
    assert at10["found_inf"].all() and at10["skipped"].all()
    assert (at10["scale_after"] == at10["scale_before"] / 2).all()
    others = amp[amp["step"] != 10]
    assert not others["skipped"].any()              # only the injected step overflowed
    faults = store.table("faults")
    injected = faults[faults["kind"] == "overflow"]
    assert list(injected["rank"]) == [1] and list(injected["step"]) == [10] and injected["injected"].all()
