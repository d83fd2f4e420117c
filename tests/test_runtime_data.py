"""Token streams and the mesh-aware sampler: deterministic, rank-dependent, split-invariant."""

from __future__ import annotations

import torch

from dtprobe.runtime.data import CORPUS_FILE, Sampler, synthetic_tokens, text_tokens


def make(tokens, **kw):
    args = dict(batch_size=4, seq_len=16, grad_accum=1, dp_rank=0, dp_size=1, seed=3)
    args.update(kw)
    return Sampler(tokens, **args)


def cat_inputs(batches):
    return torch.cat([b.inputs for b in batches])


def test_synthetic_stream_is_seeded_and_learnable():
    a, b, c = synthetic_tokens(1, length=4096), synthetic_tokens(1, length=4096), synthetic_tokens(2, length=4096)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # a Markov chain with 4 successors per token: each token's 4 commonest successors cover almost every bigram
    # (only the joins between the 1024 parallel chains are arbitrary); random bytes would give ~4/256 = 1.6%
    s = synthetic_tokens(1, length=1 << 16).long()
    counts = torch.zeros(256, 256).index_put_((s[:-1], s[1:]), torch.ones(s.numel() - 1), accumulate=True)
    top4 = counts.topk(4, dim=1).values.sum()
    assert top4 / counts.sum() > 0.95


def test_text_corpus_is_shipped_real_text():
    data = CORPUS_FILE.read_bytes()
    assert len(data) > 200_000 and b"dictionary" in data
    assert text_tokens().numel() == len(data)


def test_sampler_is_deterministic_given_seed_step_and_rank():
    tokens = synthetic_tokens(0, length=8192)
    first = cat_inputs(make(tokens).micro_batches(5))
    assert torch.equal(first, cat_inputs(make(tokens).micro_batches(5)))
    assert not torch.equal(first, cat_inputs(make(tokens).micro_batches(6)))
    assert not torch.equal(first, cat_inputs(make(tokens, seed=4).micro_batches(5)))


def test_sampler_targets_are_inputs_shifted_by_one():
    tokens = torch.arange(1000) % 256
    batch = make(tokens.to(torch.uint8)).micro_batches(0)[0]
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1]) and batch.inputs.dtype == torch.long


def test_global_batch_is_the_same_whatever_the_split_into_ranks_and_micro_batches():
    tokens = synthetic_tokens(0, length=8192)
    whole = cat_inputs(make(tokens, batch_size=8).micro_batches(2))
    accum = cat_inputs(make(tokens, batch_size=4, grad_accum=2).micro_batches(2))
    ranks = torch.cat([cat_inputs(make(tokens, batch_size=4, dp_rank=r, dp_size=2).micro_batches(2))
                       for r in range(2)])
    assert torch.equal(whole, accum) and torch.equal(whole, ranks)
    r0, r1 = (cat_inputs(make(tokens, dp_rank=r, dp_size=2).micro_batches(2)) for r in range(2))
    assert not torch.equal(r0, r1)
