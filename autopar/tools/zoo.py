"""Built-in models for the command line, notebooks, benchmarks and the coverage test:
transformers configs with random weights (no downloads), and example inputs.

    build("gpt2-tiny") -> (model, args, kwargs)
    build("llama3-8b", device="meta")   # shapes only, for planning

Each entry names a family (its config and model classes and the inputs it takes) and
the config values; build(name, **overrides) changes any of them (e.g. n_layer=48).
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable

import torch

# family -> (config class, model class, inputs kind, fixed config values)
FAMILIES: dict[str, tuple[str, str, str, dict]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "causal",
             dict(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", "causal", dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", "causal", dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "causal", dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", "causal", dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    "phi": ("PhiConfig", "PhiForCausalLM", "causal",
            dict(resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
                 pad_token_id=0)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", "causal",
                 dict(hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    "opt": ("OPTConfig", "OPTForCausalLM", "causal",
            dict(dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=1)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "causal", dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    "t5": ("T5Config", "T5ForConditionalGeneration", "seq2seq",
           dict(dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
    "bart": ("BartConfig", "BartForConditionalGeneration", "seq2seq",
             dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, decoder_start_token_id=2,
                  pad_token_id=1, bos_token_id=0, eos_token_id=2, forced_eos_token_id=None)),
    "bert": ("BertConfig", "BertForMaskedLM", "masked",
             dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", "masked",
                dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1)),
    "vit": ("ViTConfig", "ViTForImageClassification", "image",
            dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
}
TINY_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    vocab_size=64)

ZOO: dict[str, dict[str, Any]] = {
    "gpt2-tiny": dict(family="gpt2", n_layer=2, n_embd=32, n_head=4, vocab_size=64),
    "gpt2-small": dict(family="gpt2", n_layer=12, n_embd=768, n_head=12, vocab_size=50257),
    "llama-tiny": dict(family="llama", num_key_value_heads=2, **TINY_DECODER),
    "llama-small": dict(family="llama", num_hidden_layers=8, hidden_size=1024, intermediate_size=2816,
                        num_attention_heads=16, num_key_value_heads=4, vocab_size=32000),
    # Llama-3-8B's shape (GQA: 8 K/V heads for 32 query heads); build it on the meta device
    "llama3-8b": dict(family="llama", num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "bert-tiny": dict(family="bert", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                      num_attention_heads=4, vocab_size=64),
    # grouped-query attention, 6 query heads over 2 K/V heads: heads do not divide a 4-way
    # axis; sliding-window attention
    "mistral-tiny": dict(family="mistral", **{**TINY_DECODER, "hidden_size": 48, "num_attention_heads": 6},
                         num_key_value_heads=2, head_dim=8),
    # GQA with biased q/k/v projections
    "qwen2-tiny": dict(family="qwen2", num_key_value_heads=2, **TINY_DECODER),
    # multi-query attention (one K/V head), explicit head_dim
    "gemma-tiny": dict(family="gemma", num_key_value_heads=1, head_dim=8, **TINY_DECODER),
    # partial rotary embedding, parallel attention and MLP
    "phi-tiny": dict(family="phi", partial_rotary_factor=0.5, **TINY_DECODER),
    "gpt-neox-tiny": dict(family="gpt_neox", rotary_pct=0.5, **TINY_DECODER),
    # learned positions, ReLU MLP
    "opt-tiny": dict(family="opt", hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                     word_embed_proj_dim=32, vocab_size=64),
    # mixture of experts: 4 experts, top-2 routing, GQA
    "mixtral-tiny": dict(family="mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                         **TINY_DECODER),
    # encoder-decoders
    "t5-tiny": dict(family="t5", d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, vocab_size=64),
    "bart-tiny": dict(family="bart", d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=64),
    "roberta-tiny": dict(family="roberta", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                         num_attention_heads=4, vocab_size=64),
    # vision transformer: 16x16 images in 4x4 patches, 8 classes
    "vit-tiny": dict(family="vit", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     image_size=16, patch_size=4, num_channels=3, num_labels=8),
}


def names() -> list[str]:
    return sorted(ZOO)


def build(name: str, batch: int = 4, seq: int = 32, training: bool = False, seed: int = 0,
          device: str = "cpu", **config_overrides: Any) -> tuple:
    """(model, args, kwargs) for a zoo name, or for 'package.module:factory' where factory()
    returns a model, (model, args) or (model, args, kwargs). device="meta" builds the model
    without weights (for planning); config_overrides change the config (e.g. n_layer=48)."""
    if ":" in name:
        return _from_factory(name)
    if name not in ZOO:
        raise ValueError(f"unknown model {name!r}: use one of {names()} or 'package.module:factory'")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers as T
    except ImportError:
        raise ImportError(f"model {name!r} needs transformers: pip install transformers") from None
    cfg = dict(ZOO[name], **config_overrides)
    config_cls, model_cls, kind, fixed = FAMILIES[cfg.pop("family")]
    positions = {"max_position_embeddings": max(seq, 32)} if kind != "image" else {}
    if config_cls == "GPT2Config":
        positions = {"n_positions": max(seq, 32)}
    elif config_cls == "RobertaConfig":  # positions start after the padding index
        positions = {"max_position_embeddings": max(seq, 32) + 2}
    elif config_cls == "T5Config":  # relative position buckets
        positions = {}
    config = getattr(T, config_cls)(**{"use_cache": False, **positions, **fixed, **cfg})
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(T, model_cls)(config)
    model.train(training)
    return (model, (), _inputs(kind, config, batch, seq, seed))


class LossOnly(torch.nn.Module):
    """A zoo model that returns its loss alone, what a training loop reads: its other
    outputs (a causal LM's logits, batch x sequence x vocabulary) need not come back whole
    to every rank."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**inputs).loss


def _inputs(kind: str, config: Any, batch: int, seq: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed + 1)
    if kind == "image":
        pixels = torch.randn(batch, config.num_channels, config.image_size, config.image_size, generator=g)
        return {"pixel_values": pixels, "labels": torch.randint(0, config.num_labels, (batch,), generator=g)}
    ids = torch.randint(1, config.vocab_size, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids}


def _from_factory(spec: str) -> tuple:
    module_name, _, attr = spec.partition(":")
    try:
        factory: Callable = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load model factory {spec!r}: {e}") from None
    made = factory()
    if isinstance(made, torch.nn.Module):
        raise ValueError(f"factory {spec} returned only a model; return (model, args) or (model, args, kwargs) "
                         "so autopar has example inputs to trace with")
    model, args, *rest = made
    return model, tuple(args), dict(rest[0]) if rest else {}
