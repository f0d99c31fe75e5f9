"""Random small models for fuzzed equivalence: MLPs, attention blocks, residual and
norm mixes, widths that often do not divide the mesh."""

from __future__ import annotations

import random

import torch
from torch import nn

MESHES = [(2,), (4,), (3,), (2, 2), (1, 4), (4, 1), (2, 3)]
WIDTHS = [3, 4, 6, 8, 12, 16]


class RMSNorm(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h) + 0.1 * torch.randn(h))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Attention(nn.Module):
    def __init__(self, h: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x):
        b, s, h = x.shape
        split = lambda t: t.view(b, s, self.heads, h // self.heads).transpose(1, 2)  # noqa: E731
        y = torch.nn.functional.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)),
                                                             is_causal=self.causal)
        return self.o(y.transpose(1, 2).reshape(b, s, h))


class FuzzNet(nn.Module):
    def __init__(self, spec: dict) -> None:
        super().__init__()
        h = spec["hidden"]
        self.spec = spec
        blocks = []
        for kind, arg in spec["blocks"]:
            if kind == "mlp":
                blocks.append(nn.Sequential(nn.Linear(h, arg), nn.GELU(), nn.Linear(arg, h)))
            elif kind == "attn":
                blocks.append(Attention(h, arg, causal=spec["causal"]))
            elif kind == "layernorm":
                blocks.append(nn.LayerNorm(h))
            else:  # our decomposed RMSNorm (pow/mean/rsqrt) or torch's, which exports as aten.rms_norm
                blocks.append(RMSNorm(h) if arg == 0 else nn.RMSNorm(h))
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(h, spec["out"], bias=spec["bias"])

    def forward(self, x):
        for (kind, _), block in zip(self.spec["blocks"], self.blocks):
            x = x + block(x) if self.spec["residual"] and kind in ("mlp", "attn") else block(x)
        return self.head(x).softmax(-1) if self.spec["softmax"] else self.head(x)


def random_spec(rng: random.Random) -> dict:
    hidden = rng.choice([4, 6, 8, 12, 16])
    heads = [d for d in (1, 2, 3, 4) if hidden % d == 0]
    blocks = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(["mlp", "mlp", "attn", "layernorm", "rmsnorm"])
        arg = (rng.choice(WIDTHS) if kind == "mlp" else rng.choice(heads) if kind == "attn"
               else rng.choice([0, 1]) if kind == "rmsnorm" else 0)
        blocks.append((kind, arg))
    return {"hidden": hidden, "blocks": blocks, "out": rng.choice(WIDTHS), "bias": rng.random() < 0.7,
            "residual": rng.random() < 0.6, "softmax": rng.random() < 0.3, "causal": rng.random() < 0.3,
            "batch": rng.choice([1, 2, 3, 4, 6]), "seq": rng.choice([1, 2, 4, 6]), "mesh": rng.choice(MESHES),
            "alpha_s": rng.choice([1e-9, 1e-6, 1e-4]), "seed": rng.randrange(10_000)}


def build(spec: dict) -> tuple[FuzzNet, torch.Tensor]:
    torch.manual_seed(spec["seed"])
    model = FuzzNet(spec)
    x = torch.randn(spec["batch"], spec["seq"], spec["hidden"])
    return model, x


def device_for(spec: dict):
    from autopar.cost_models.devices import DeviceSpec, Link
    link = Link(spec["alpha_s"], 1e-11)
    return DeviceSpec("fuzz", {torch.float32: 1e9}, mem_bw_bytes_per_s=1e9, op_overhead_s=1e-7,
                      intra_link=link, inter_link=link, achievable=1.0)
