"""A small byte-level GPT for the DiLoCo example.

Decoder-only transformer: token and learned positional embeddings, ``n_layers`` pre-LayerNorm
blocks (causal self-attention through ``scaled_dot_product_attention`` and a GELU MLP), a final
LayerNorm and an untied LM head. The head is untied on purpose: a weight shared between the root
module and a block would straddle two FSDP2 parameter groups, and tied entries make state-dict
keys depend on how the model was wrapped.

State-dict keys are part of the interface (checkpoints and the coordinator's global state use
them) and are stable::

    tok_emb.weight, pos_emb.weight,
    blocks.{i}.ln1.{weight,bias}, blocks.{i}.attn.qkv.{weight,bias},
    blocks.{i}.attn.proj.{weight,bias}, blocks.{i}.ln2.{weight,bias},
    blocks.{i}.mlp.fc.{weight,bias}, blocks.{i}.mlp.proj.{weight,bias},
    ln_f.{weight,bias}, head.weight
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model; the defaults give about 0.87 M parameters.

    Attributes
    ----------
    vocab_size
        Number of token ids; 256 for raw bytes.
    seq_len
        Longest sequence the positional embedding covers.
    d_model, n_layers, n_heads, d_ff
        Width, depth, attention heads (must divide ``d_model``) and MLP hidden width.
    dropout
        Dropout on attention weights and residual branches while training.
    init_seed
        Seed of the weight initialisation; it uses its own generator, so every site and rank
        that builds the model with the same config starts from identical weights whatever the
        global RNG state is.
    """

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 512
    dropout: float = 0.0
    init_seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, H, T, C/H), the layout scaled_dot_product_attention expects.
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-LayerNorm transformer block; the unit a trainer wraps with ``fully_shard``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Byte-level decoder-only transformer; ``forward(idx)`` returns logits ``(B, T, vocab)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        # GPT-2 initialisation; residual output projections are scaled down by depth so the
        # residual stream's variance does not grow with n_layers.
        gen = torch.Generator().manual_seed(self.config.init_seed)
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_f"):
                p.fill_(1.0)
            else:
                std = resid_std if name.endswith("proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits for every position of ``idx`` (a ``(B, T)`` LongTensor, ``T <= seq_len``)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (batch, time), got {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise ValueError(
                f"sequence length {t} exceeds the model's seq_len {self.config.seq_len}"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``(B, T, V)`` logits against ``(B, T)`` targets."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model`` in order: ``fully_shard`` each of them, then the root."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no 'blocks' ModuleList; is it a GPT?")
    return list(blocks)


def build_model(**kwargs: Any) -> GPT:
    """Build a :class:`GPT`; a job config names it ``examples.gpt_diloco.model:build_model``.

    Parameters
    ----------
    **kwargs
        Fields of :class:`GPTConfig`; anything omitted keeps its default.

    Raises
    ------
    TypeError
        A key is not a field of :class:`GPTConfig` (the message names it).
    ValueError
        A value is out of range (e.g. ``d_model`` not divisible by ``n_heads``).
    """
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    for key in kwargs:
        if key not in known:
            raise TypeError(f"build_model: unknown parameter {key!r} (known: {sorted(known)})")
    return GPT(GPTConfig(**kwargs))


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())
