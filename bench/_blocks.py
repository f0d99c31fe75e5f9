"""The Llama-shaped block stack the peer and overhead benches time (bench/peer_speed.py,
bench/rank_overhead.py): attention and a SwiGLU MLP per block, a mean-square loss."""

from __future__ import annotations

from torch import nn


class Block(nn.Module):
    """A Llama-shaped block whose head count follows its weights' local size, so torch's
    tensor parallelism can shard it without rewriting the module."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden, bias=False) for _ in range(3))
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.gate, self.up = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        split = lambda t: t.view(b, s, -1, self.head_dim).transpose(1, 2)  # noqa: E731
        a = nn.functional.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)),
                                                       is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        h = self.norm2(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class Model(nn.Module):
    def __init__(self, layers=2, hidden=512, heads=8, ffn=1536) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn) for _ in range(layers))

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return (x.float() ** 2).mean()
