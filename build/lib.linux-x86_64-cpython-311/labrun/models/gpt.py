"""A small decoder-only transformer, after nanoGPT's model.py: token and position embeddings,
pre-norm blocks of causal self-attention and an MLP, and an output head tied to the token
embedding. `GPT(...)(ids)` maps token ids (batch, time) to next-token logits (batch, time,
vocab_size). The language-modelling task builds it with the vocabulary its token folder
declares (labrun.data.tokens).

Attention goes through torch's scaled_dot_product_attention with is_causal=True, which picks a
fused kernel where the device has one (flash or memory-efficient attention on a GPU).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own name for it
from torch import nn

from labrun.core.errors import ConfigError


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.dropout = n_head, dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = (t.view(batch, time, self.n_head, channels // self.n_head).transpose(1, 2)
                   for t in self.qkv(x).split(channels, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(batch, time, channels)
        return self.resid_dropout(self.proj(y))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """`block_size` is the most positions the model knows: a window longer than it is refused.
    Sizes as nanoGPT's keys (n_layer, n_head, n_embd); the defaults train on a CPU."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0):
        super().__init__()
        if n_embd % n_head:
            raise ConfigError(f"model.n_embd={n_embd} is not a multiple of model.n_head="
                              f"{n_head}: each head takes n_embd / n_head channels")
        self.vocab_size, self.block_size = vocab_size, block_size
        self.token_embedding = nn.Embedding(vocab_size, n_embd)
        self.position_embedding = nn.Embedding(block_size, n_embd)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        # Weight tying (Press & Wolf 2017, as GPT-2 and nanoGPT): one matrix embeds a token and
        # scores it as the next one.
        self.head.weight = self.token_embedding.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections that add into the residual stream.
        for name, parameter in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        time = ids.shape[1]  # a shape: known on the host, no wait for the device
        if time > self.block_size:
            raise ValueError(f"a window of {time} tokens is longer than the model's "
                             f"block_size={self.block_size}")
        positions = torch.arange(time, device=ids.device)
        x = self.dropout(self.token_embedding(ids) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
