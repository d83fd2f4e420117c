"""The built-in GPT (decoder-only transformer) with size presets; trained by the runtime, split by the layouts.

Shaped for every parallel layout: attention projections are separate ``q``/``k``/``v``/``o`` linears and the
MLP is ``fc1``/``fc2`` (tensor parallel plans name them), heads are reshaped with ``-1`` so local heads work
under TP, and blocks live in a ``ModuleDict`` keyed by layer index so pipeline stages can drop blocks and keep
the names (checkpoints stay layout-independent). ``embed`` is first, ``norm``/``head`` last, and every
submodule may be ``None`` on a pipeline stage that does not own it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dtprobe.catalog import BUILTIN_MODELS, UnknownNameError, lookup
from dtprobe.store.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class GPTConfig:
    """Model shape."""

    num_layers: int
    """Transformer blocks."""
    hidden: int
    """Model width (d_model)."""
    num_heads: int
    """Attention heads; must divide ``hidden``."""
    ffn_hidden: int
    """MLP inner width."""
    vocab_size: int
    """Vocabulary size (the built-in data uses bytes: 256)."""
    max_seq_len: int
    """Longest sequence the position embedding covers."""

    def __post_init__(self) -> None:
        if self.hidden % self.num_heads:
            raise ConfigError(
                f"model.hidden ({self.hidden}) must be divisible by model.num_heads ({self.num_heads}); "
                f"pick num_heads from the divisors of {self.hidden}.")

    @property
    def num_params(self) -> int:
        """Parameter count (weights and biases, embeddings included, head untied)."""
        h, f, v, s, n = self.hidden, self.ffn_hidden, self.vocab_size, self.max_seq_len, self.num_layers
        per_block = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
        return v * h + s * h + n * per_block + 2 * h + h * v + v


PRESETS: dict[str, GPTConfig] = {
    name: GPTConfig(num_layers=shape.num_layers, hidden=shape.hidden, num_heads=shape.num_heads,
                    ffn_hidden=shape.ffn_hidden, vocab_size=shape.vocab_size, max_seq_len=shape.seq_len)
    for name, shape in BUILTIN_MODELS.items()}
"""Built-in sizes, from ``dtprobe.catalog.BUILTIN_MODELS`` (the shapes the planner and the analysis read too)."""


def model_config(name: str) -> GPTConfig:
    """The config of a built-in size; ConfigError naming ``model`` and listing the sizes otherwise."""
    try:
        return lookup(PRESETS, name, key="model")
    except UnknownNameError as exc:
        raise ConfigError(f"{exc}.") from None


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.hidden // cfg.num_heads
        self.q = nn.Linear(cfg.hidden, cfg.hidden)
        self.k = nn.Linear(cfg.hidden, cfg.hidden)
        self.v = nn.Linear(cfg.hidden, cfg.hidden)
        self.o = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallel each rank holds only its local heads.
        q = self.q(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn_hidden)
        self.fc2 = nn.Linear(cfg.ffn_hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token + learned position embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok(tokens) + self.pos(positions)


class GPT(nn.Module):
    """Embedding -> blocks -> norm -> head. Pipeline stages set ``embed``/``norm``/``head`` to None and
    delete blocks they do not own; ``forward`` then maps hidden states to hidden states."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Module | None = Embedding(cfg)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.num_layers)})
        self.norm: nn.Module | None = nn.LayerNorm(cfg.hidden)
        self.head: nn.Module | None = nn.Linear(cfg.hidden, cfg.vocab_size)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32 for stability under autocast)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(name: str, *, seed: int) -> GPT:
    """The preset model with weights drawn from ``seed`` (identical on every rank)."""
    torch.manual_seed(seed)
    return GPT(model_config(name))


def warmup_lr(step: int, *, base_lr: float, warmup_steps: int) -> float:
    """Linear warmup to ``base_lr`` over ``warmup_steps`` (1-based step), then constant."""
    if warmup_steps <= 0:
        return base_lr
    return base_lr * min(1.0, (step + 1) / warmup_steps)


__all__ = ["GPT", "GPTConfig", "PRESETS", "build_model", "lm_loss", "model_config", "warmup_lr"]
