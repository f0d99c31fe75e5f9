"""Built-in models for the command line and notebooks: transformers configs with
random weights (no downloads), and example inputs.

    build("gpt2-tiny") -> (model, args, kwargs)
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

ZOO: dict[str, dict[str, Any]] = {
    "gpt2-tiny": dict(family="gpt2", n_layer=2, n_embd=32, n_head=4, vocab_size=64),
    "gpt2-small": dict(family="gpt2", n_layer=12, n_embd=768, n_head=12, vocab_size=50257),
    "llama-tiny": dict(family="llama", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=64),
    "llama-small": dict(family="llama", num_hidden_layers=8, hidden_size=1024, intermediate_size=2816,
                        num_attention_heads=16, num_key_value_heads=4, vocab_size=32000),
    # Llama-3-8B's shape (GQA: 8 K/V heads for 32 query heads); build it on the meta device
    "llama3-8b": dict(family="llama", num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "bert-tiny": dict(family="bert", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                      num_attention_heads=4, vocab_size=64),
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
    family = cfg.pop("family")
    torch.manual_seed(seed)
    with torch.device(device):
        model = _model(T, family, cfg, seq)
    model.train(training)
    ids = torch.randint(1, cfg["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed + 1))
    return model, (), {"input_ids": ids, "labels": ids}


def _model(T: Any, family: str, cfg: dict, seq: int) -> torch.nn.Module:
    if family == "gpt2":
        config = T.GPT2Config(n_positions=max(seq, 32), attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                              use_cache=False, bos_token_id=0, eos_token_id=0, **cfg)
        model = T.GPT2LMHeadModel(config)
    elif family == "llama":
        config = T.LlamaConfig(max_position_embeddings=max(seq, 32), use_cache=False, bos_token_id=0,
                               eos_token_id=0, pad_token_id=0, **cfg)
        model = T.LlamaForCausalLM(config)
    else:
        config = T.BertConfig(max_position_embeddings=max(seq, 32), hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=0.0, pad_token_id=0, **cfg)
        model = T.BertForMaskedLM(config)
    return model


def _from_factory(spec: str) -> tuple:
    import importlib
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
