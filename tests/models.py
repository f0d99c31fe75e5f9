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
    if family in MOE:  # mixtures of 8 experts, top-2 (DeepSeek-V3: one shared expert, a dense first layer)
        from autopar.tools.sweep_configs import tiny_config
        c = tiny_config(family)
        experts = {"mixtral": "num_local_experts", "qwen3_moe": "num_experts", "deepseek_v3": "n_routed_experts"}
        for k, v in {experts[family]: 8, "num_experts_per_tok": 2, "use_cache": False}.items():
            setattr(c, k, v)
        return getattr(T, MOE[family]), c
    raise ValueError(family)


MOE = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def build(name: str, seed: int = 0, **over) -> nn.Module:
    torch.manual_seed(seed)
    if name == "mlp":
        return MLP(**over).eval()
    if name == "causal":
        return CausalLM(**over).eval()
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


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block: two 3x3 convs with a norm each and a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int, norm) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = norm(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))


class TinyResNet(nn.Module):
    """A torchvision-style ResNet (stem conv + max pool, two stages of basic blocks,
    global average pool, linear head) at toy width. norm: "batch" or "group"."""

    def __init__(self, norm: str = "batch", classes: int = 8, width: int = 8) -> None:
        super().__init__()
        make = nn.BatchNorm2d if norm == "batch" else (lambda c: nn.GroupNorm(2, c))
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), make(width), nn.ReLU(),
                                  nn.MaxPool2d(2))
        self.layer1 = BasicBlock(width, width, 1, make)
        self.layer2 = BasicBlock(width, 2 * width, 2, make)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class BigVocab(nn.Module):
    """A large vocabulary over a narrow hidden size: the embedding table dominates, so
    splitting it by vocabulary (each rank looks up its rows, partial sums all-reduced)
    beats gathering it."""

    def __init__(self, vocab: int = 4096, hidden: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(self.embed(ids)))


class CausalBlock(nn.Module):
    """nanoGPT's block with grouped-query attention: sdpa(is_causal=True, enable_gqa=True),
    no explicit mask (what HF models pass instead)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q = nn.Linear(hidden, hidden)
        self.kv = nn.Linear(hidden, 2 * kv_heads * self.head_dim)
        self.out = nn.Linear(hidden, hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2 * self.kv_heads, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class CausalLM(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, kv_heads: int = 2, layers: int = 2,
                 positions: int = 32) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(positions, hidden)
        self.blocks = nn.ModuleList(CausalBlock(hidden, heads, kv_heads) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
