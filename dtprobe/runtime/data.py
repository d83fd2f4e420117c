"""Training data for the built-in GPT: byte-level token streams (seeded synthetic, or the shipped text corpus)
and a mesh-aware sampler. Read by ``runtime.train`` (and by ``runtime.parallel`` layouts through ``Sampler``).

Vocabulary: bytes (256 tokens). Both sources are one long uint8 stream; a batch is a set of windows into it.
The window of global sequence ``i`` of step ``s`` is drawn from a generator seeded by ``(seed, s)`` only, and
data-parallel rank ``r`` of ``dp_size`` takes sequences ``[r * per_rank, (r + 1) * per_rank)`` with
``per_rank = batch_size * grad_accum``, micro-batch ``m`` taking the ``m``-th slice of those. So the data of a step
depends only on (seed, step, dp_rank), ranks of one dp group that differ in tp/pp get the same batch, and the
global batch is the same sequences whatever the split into dp ranks x micro-batches (batch b x accum 2 == 2b).

The text corpus (``data/corpus.txt``, ~330 KB) is the docstrings of ~60 Python standard-library modules
(PSF license), extracted by ``build_corpus()``; see ``data/SOURCE.txt``.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

VOCAB_SIZE = 256
CORPUS_FILE = Path(__file__).with_name("data") / "corpus.txt"
SYNTHETIC_TOKENS = 1 << 20
"""Length of the synthetic stream (1 MiB of tokens, generated at start in a few ms)."""
_MARKOV_PROBS = (0.55, 0.25, 0.15, 0.05)
"""Each token has four possible successors with these probabilities: learnable (loss falls from ln 256 to ~1.2)."""


def synthetic_tokens(seed: int, *, length: int = SYNTHETIC_TOKENS) -> torch.Tensor:
    """A seeded first-order Markov chain over bytes (uint8, ``length`` tokens), identical on every rank."""
    gen = torch.Generator().manual_seed(10_007 * seed + 1)
    successors = torch.randint(0, VOCAB_SIZE, (VOCAB_SIZE, len(_MARKOV_PROBS)), generator=gen)
    chains, chain_len = 1024, -(-length // 1024)
    choice = torch.multinomial(torch.tensor(_MARKOV_PROBS), chains * chain_len, replacement=True,
                               generator=gen).view(chains, chain_len)
    out = torch.empty(chains, chain_len, dtype=torch.long)
    out[:, 0] = torch.randint(0, VOCAB_SIZE, (chains,), generator=gen)
    for t in range(1, chain_len):
        out[:, t] = successors[out[:, t - 1], choice[:, t]]
    return out.reshape(-1)[:length].to(torch.uint8)


def text_tokens() -> torch.Tensor:
    """The shipped corpus as bytes (uint8)."""
    return torch.frombuffer(bytearray(CORPUS_FILE.read_bytes()), dtype=torch.uint8)


def token_stream(kind: str, *, seed: int) -> torch.Tensor:
    """``synthetic`` or ``text`` (``TrainConfig.data``)."""
    return synthetic_tokens(seed) if kind == "synthetic" else text_tokens()


class Batch(NamedTuple):
    """One micro-batch: ``inputs`` and next-token ``targets``, both [batch, seq] int64 (a tuple: cheap to build,
    unpacks as ``inputs, targets``)."""

    inputs: torch.Tensor
    targets: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.inputs.numel()


class Sampler:
    """Deterministic micro-batches of one data-parallel rank (see the module docstring for the layout)."""

    def __init__(self, tokens: torch.Tensor, *, batch_size: int, seq_len: int, grad_accum: int, dp_rank: int,
                 dp_size: int, seed: int, device: torch.device | str = "cpu") -> None:
        assert 0 <= dp_rank < dp_size, (dp_rank, dp_size)
        assert tokens.numel() > seq_len + 1, "token stream shorter than one sequence"
        self.tokens = tokens
        self.batch_size, self.seq_len, self.grad_accum = batch_size, seq_len, grad_accum
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.device = torch.device(device)
        self._offsets = torch.arange(seq_len + 1)
        self._gen = torch.Generator()

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.grad_accum * self.dp_size

    def micro_batches(self, step: int) -> list[Batch]:
        """The ``grad_accum`` micro-batches of this rank for ``step``."""
        self._gen.manual_seed(1_000_003 * self.seed + step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (self.global_batch,), generator=self._gen)
        per_rank = self.batch_size * self.grad_accum
        mine = starts[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        windows = self.tokens[mine[:, None] + self._offsets].long()
        if self.device.type != "cpu":
            windows = windows.to(self.device, non_blocking=True)
        if self.grad_accum == 1:
            return [Batch(windows[:, :-1], windows[:, 1:])]
        return [Batch(chunk[:, :-1], chunk[:, 1:]) for chunk in windows.split(self.batch_size)]


def build_corpus() -> str:
    """Regenerate ``data/corpus.txt``: the docstrings of a fixed list of standard-library modules (PSF license)."""
    import importlib
    import inspect

    modules = ("collections functools itertools json pathlib argparse logging dataclasses textwrap string re "
               "datetime decimal fractions statistics random heapq bisect contextlib typing enum shutil subprocess "
               "threading queue socket email.message csv gzip zipfile tarfile tempfile difflib inspect abc copy "
               "pprint unittest doctest asyncio.tasks sched calendar hashlib base64 uuid fnmatch glob optparse "
               "configparser urllib.parse http.client xml.dom.minidom sqlite3 operator weakref numbers math").split()
    parts = []
    for name in modules:
        module = importlib.import_module(name)
        members = [module] + [obj for key, obj in sorted(vars(module).items())
                              if not key.startswith("_") and getattr(obj, "__module__", None) == module.__name__]
        parts.extend(doc for doc in map(inspect.getdoc, members) if doc)
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    CORPUS_FILE.write_text(build_corpus())
    print(f"wrote {CORPUS_FILE} ({CORPUS_FILE.stat().st_size} bytes)")
