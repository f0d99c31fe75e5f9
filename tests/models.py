"""Tiny models for tests: built from a seed so every rank builds the same weights."""

from __future__ import annotations

import os

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class MLP(nn.Module):
    def __init__(self, widths: tuple[int, ...] = (16, 64, 16, 64, 16), bias: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(widths[:-1], widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def hf_config(family: str, **over):
    import transformers as T
    if family == "gpt2":
        c = T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, attn_pdrop=0.0,
                         resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
        return T.GPT2LMHeadModel, c
    if family == "llama":
        c = T.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, use_cache=False,
                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
        return T.LlamaForCausalLM, c
    if family == "bert":
        c = T.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         vocab_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, pad_token_id=0)
        return T.BertForMaskedLM, c
    raise ValueError(family)


def build(name: str, seed: int = 0, **over) -> nn.Module:
    torch.manual_seed(seed)
    if name == "mlp":
        return MLP(**over).eval()
    cls, cfg = hf_config(name)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cls(cfg).eval()


def inputs(name: str, batch: int = 2, seq: int = 8, seed: int = 1) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return (torch.randn(batch, 16, generator=g),), {}
    ids = torch.randint(1, 64, (batch, seq), generator=g)
    return (), {"input_ids": ids, "labels": ids}
