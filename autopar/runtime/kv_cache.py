"""A causal LM with its static KV cache held as registered buffers, so a plan can shard it.

    CachedLM(model, max_batch=2, max_cache_len=16)
      buffers  key_cache_{i}, value_cache_{i}   (max_batch, kv_heads, max_cache_len, head_dim)
               cache_length_{i}                 () int64: where the next tokens are written
      forward(input_ids (B, S), cache_position (S,)) -> logits (B, S, vocab)

Why not transformers' own export wrapper (integrations/executorch.py,
TorchExportableModuleWithStaticCache): it registers the StaticCache's tensors as
buffers, but non-strict torch.export swaps a module's buffers for traced stand-ins by
attribute, so the cache layers, which hold the original tensor objects, are lifted as
constants and the cache writes never become buffer updates (transformers 5.24). Here
the cache layers are pointed at the module's buffers at every call, through attribute
access, so export sees the writes to the buffers themselves: each `index_copy_` into a
cache layer becomes a buffer update of the traced graph (passes/trace/trace.py,
TracedGraph.buffer_updates), which the plan may split like any other tensor.

1. Each call first sets every layer's write position from `cache_position[0]`
   (transformers' StaticLayer writes at `cumulative_length`, positions and the causal
   mask follow from it), so one traced program serves every step: the position is an
   input, not a constant of the trace.
2. The model runs under no_grad: generation is inference, and a cache written by values
   that need gradients is not something torch.export can functionalise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autopar.core.errors import CacheReleasedError, UnsupportedModelError


@dataclass(frozen=True)
class CacheShape:
    """The static cache's extent: every layer's keys and values are
    (batch, kv_heads, length, head_dim)."""

    layers: int
    batch: int
    kv_heads: int
    length: int
    head_dim: int


class CachedLM(nn.Module):
    """`model` (a transformers causal LM) with a static KV cache of `max_batch` rows and
    `max_cache_len` positions, registered as buffers (non-persistent: a state dict of the
    model stays the model's)."""

    def __init__(self, model: nn.Module, max_batch: int, max_cache_len: int) -> None:
        super().__init__()
        # transformers is a dev dependency of autopar: only this wrapper needs it
        from transformers.cache_utils import StaticCache, StaticLayer
        from transformers.integrations.executorch import get_head_shapes

        if not callable(getattr(getattr(model, "config", None), "get_text_config", None)):
            raise UnsupportedModelError(
                f"{type(model).__name__} is not a transformers causal LM: generation needs a model with a "
                "transformers config (model.config.get_text_config()) whose forward takes input_ids and cache= "
                "(a PreTrainedModel such as LlamaForCausalLM); wrap or load the model through transformers")
        config = model.config.get_text_config()
        positions = getattr(config, "max_position_embeddings", None)
        if isinstance(positions, int) and max_cache_len > positions:
            raise UnsupportedModelError(
                f"max_cache_len={max_cache_len} is longer than {type(model).__name__}'s "
                f"max_position_embeddings={positions}; pass max_cache_len <= {positions}")
        window = getattr(config, "sliding_window", None)
        if window is not None and max_cache_len > window:
            raise UnsupportedModelError(
                f"max_cache_len={max_cache_len} is longer than {type(model).__name__}'s sliding_window={window}: "
                "the static cache here keeps every position (no window), so it matches the model only up to "
                f"the window; pass max_cache_len <= {window}")
        self.model = model
        self.cache = StaticCache(config=config, max_cache_len=max_cache_len)
        # a sliding layer's static variant has data-dependent control flow export cannot take;
        # within the window (checked above) a plain static layer computes the same attention
        self.cache.layers = [StaticLayer(max_cache_len) for _ in self.cache.layers]
        heads, head_dim = get_head_shapes(config)
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.cache.early_initialization(max_batch, heads, head_dim, dtype, device)
        for i, layer in enumerate(self.cache.layers):
            self.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
            self.register_buffer(f"value_cache_{i}", layer.values, persistent=False)
            self.register_buffer(f"cache_length_{i}", layer.cumulative_length, persistent=False)
        self.shape = CacheShape(len(self.cache.layers), max_batch, int(layer.keys.shape[1]), max_cache_len,
                                int(layer.keys.shape[3]))

    def cache_names(self) -> list[str]:
        """The state names of the key and value buffers, layer by layer."""
        return [f"{kind}_cache_{i}" for i in range(self.shape.layers) for kind in ("key", "value")]

    def release_cache(self) -> None:
        """Drop this module's own full cache: once a ParallelModule holds each rank's block
        (after its plans are made) the full tensors would only double the memory the split
        saves. The module cannot run or be traced again afterwards."""
        for name in self.cache_names():
            setattr(self, name, torch.empty(0, dtype=getattr(self, name).dtype))
        for layer in self.cache.layers:  # the layers held the same full tensors
            layer.keys = layer.values = None
        self.cache = None
        self.released = True

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        if getattr(self, "released", False):
            raise CacheReleasedError("this CachedLM released its cache to a ParallelModule (release_cache); run "
                                     "the ParallelModule (Generator.step), or build a new CachedLM")
        with torch.no_grad():
            for i, layer in enumerate(self.cache.layers):
                # 1. the layers write into this module's buffers, from cache_position[0] on
                layer.keys = getattr(self, f"key_cache_{i}")
                layer.values = getattr(self, f"value_cache_{i}")
                layer.cumulative_length = getattr(self, f"cache_length_{i}")
                layer.cumulative_length.copy_(cache_position[0])
            # 2. inference only
            return self.model(input_ids=input_ids, cache=self.cache, use_cache=True).logits
