"""Tiny configs for every architecture of a transformers task, made from the
architecture's own defaults, and example inputs for them (random weights, no downloads).

    tiny_config("deepseek_v3")        -> DeepseekV3Config with 2 layers, width 64, 4 experts, ...
    example_inputs(Task.CAUSAL_LM, config, batch=4, seq=8) -> {"input_ids": ..., "labels": ...}

1. Read the default config of the architecture (CONFIG_MAPPING[model_type]()).
2. Shrink every field whose name says what it is (SHRINK: layers, widths, heads, experts,
   vocabulary, positions, windows, state sizes) to one small value per kind, keeping the
   widths consistent (hidden 64 = 4 heads x 16).
3. Zero every dropout, router noise and speech SpecAugment mask probability (the sweep
   compares against one device exactly),
   and keep initial weights small (std 0.02), so rounding is not amplified into a mismatch.
   Speech inputs: sweep_inputs.py.
4. Per-layer lists (layer_types and the like) keep one layer of each distinct kind.
5. Special token ids move inside the small vocabulary (highest ids first).
6. Nested configs (text_config, vision_config, ...) shrink the same way.
7. FAMILY_OVERRIDES, applied last, is the one table of per-architecture exceptions.
The config is then built again from the overrides, so derived fields are recomputed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from autopar.tools.sweep_inputs import speech_inputs


class Task(Enum):
    CAUSAL_LM = "causal-lm"
    MASKED_LM = "masked-lm"
    SEQ2SEQ = "seq2seq"
    IMAGE_CLASSIFICATION = "image-classification"
    SPEECH = "speech"


# task -> the transformers auto mappings (model_type -> class name) it sweeps, first wins
TASK_MAPPINGS: dict[Task, tuple[str, ...]] = {
    Task.CAUSAL_LM: ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",),
    Task.MASKED_LM: ("MODEL_FOR_MASKED_LM_MAPPING_NAMES",),
    Task.SEQ2SEQ: ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",),
    Task.IMAGE_CLASSIFICATION: ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",),
    Task.SPEECH: ("MODEL_FOR_CTC_MAPPING_NAMES", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES"),
}

HIDDEN, HEADS, HEAD_DIM = 64, 4, 16  # HIDDEN == HEADS * HEAD_DIM
VOCAB = 128

WIDTH = ("hidden_size", "n_embd", "n_embed", "d_model", "dim", "embed_dim", "emb_dim", "embedding_dim", "d_embed",
         "word_embed_proj_dim", "hidden_dim")
TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "num_selected_experts",
         "experts_per_token", "moe_top_k")
# field name -> the small value it gets (only fields the default config has, and only
# when the default is larger; None defaults stay None)
SHRINK: dict[str, int] = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers",
                     "num_encoder_layers", "encoder_layers", "decoder_layers"), 2),
    **dict.fromkeys(WIDTH, HIDDEN),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads",
                     "encoder_attention_heads", "decoder_attention_heads", "swa_num_attention_heads",
                     "linear_num_heads", "linear_num_value_heads", "index_n_heads"), HEADS),
    **dict.fromkeys(("head_dim", "d_kv", "d_head", "dim_head", "attention_head_size", "attention_head_dim",
                     "kv_channels", "swa_head_dim", "linear_head_dim", "linear_key_head_dim",
                     "linear_value_head_dim", "index_head_dim", "v_head_dim", "hidden_size_per_layer_input"),
                    HEAD_DIM),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "d_ff", "n_inner", "dff", "dim_ff", "d_inner",
                     "encoder_ffn_dim", "decoder_ffn_dim", "ffn_hidden_size", "feed_forward_size",
                     "intermediate_size_mlp", "dense_intermediate_size"), 2 * HIDDEN),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_ffn_hidden_size",
                     "shared_experts_intermediate_size", "shared_intermediate_size", "router_hidden_size"), 32),
    **dict.fromkeys(("vocab_size", "decoder_vocab_size", "shape_vocab_size", "pronunciation_vocab_size",
                     "vocab_size_per_layer_input", "unpadded_vocab_size", "encoder_hash_byte_group_vocab"), VOCAB),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "context_length",
                     "max_source_positions", "max_target_positions", "max_sequence_length"), 128),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
                     "num_routed_experts"), 4),
    **dict.fromkeys(TOP_K, 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "first_k_dense_replace",
                     "topk_group"), 1),
    **dict.fromkeys(("n_group", "num_expert_group"), 2),
    # multi-head latent attention (DeepSeek-V2/V3): low-rank q and kv, split rope/nope heads
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "qk_head_dim": 16,
    # sliding-window and chunked attention: windows shorter than the example sequence
    **dict.fromkeys(("sliding_window", "sliding_window_size", "attention_window_size", "window_size",
                     "attention_chunk_size", "local_attention"), 4),
    # state-space and linear-attention layers
    **dict.fromkeys(("state_size", "ssm_state_size", "mamba_d_state", "d_state", "time_step_rank",
                     "mamba_dt_rank"), 8),
    # vision: 32x32 images in 8x8 patches
    "image_size": 32, "patch_size": 8,
    "rotary_dim": 8, "index_topk": 4, "laurel_rank": 8, "adapter_rank": 8, "gated_norm_rank": 8,
    "index_block_size": 4, "loop_gate_rank": 8, "hc_lowrank": 8,
}
# other widths that are the hidden size times a power of two keep that ratio (2., consistency)
WIDTH_WORDS = ("hidden", "width", "_dim", "_size", "d_")
NOT_WIDTHS = ("chunk_size", "image_size", "patch_size", "kernel_size", "block_size", "window_size", "batch_size",
              "group_size", "conv_kernel_size", "chunk_size_feed_forward")
RATIOS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
# (follower, leader): when the defaults are equal, the follower takes the leader's new value
TIES = (("head_dim", "qk_rope_head_dim"), ("rotary_dim", "head_dim"))
INIT_STD = ("init_std", "initializer_range")
DROPOUT_WORDS = ("dropout", "pdrop", "layerdrop", "drop_path", "jitter", "drop_rate")
SPEC_AUGMENT = ("mask_time_prob", "mask_feature_prob")  # speech masks drawn at random in training

# model_type (or model class name) -> config values applied after the generic shrink (the
# only hand-written part)
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),  # the default has no experts
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "gemma3n_text": dict(num_kv_shared_layers=0),
    # the serialised config interleaves "mlp" blocks; three layers, one per stage
    "dory": dict(layer_types=None, num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1),
    "zamba": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"]),
    # axial positions factor the sequence (2 x 4 = 8) and the width (16 + 48 = 64)
    "reformer": dict(axial_pos_shape=[2, 4], axial_pos_embds_dim=[16, 48], local_attn_chunk_length=4,
                     lsh_attn_chunk_length=4),
    "ReformerModelWithLMHead": dict(is_decoder=True),  # keyed by class: the masked-LM head must not be a decoder
    **dict.fromkeys(("qwen4_exp", "qwen4_exp_text"), dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16,
                                                         indexer_budget=4, indexer_compress_ratio=2)),
    # Mamba-2 style heads: num_heads * head_dim == expand * hidden_size
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1, chunk_size=4),
    "bamba": dict(mamba_n_heads=8, mamba_d_head=16, mamba_chunk_size=4),
    "falcon_h1": dict(mamba_n_heads=8, mamba_d_head=16, mamba_chunk_size=4, mamba_d_ssm=128),
    "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=16, chunk_size=4),
    "zamba2": dict(mamba_headdim=16, n_mamba_heads=8, chunk_size=4),
    "granitemoehybrid": dict(mamba_n_heads=8, mamba_d_head=16, mamba_chunk_size=4),
    "audio-spectrogram-transformer": dict(max_length=64),  # spectrogram frames (1024: 1.2k patches)
}


def architectures(task: Task) -> dict[str, str]:
    """model_type -> model class name for every architecture of `task`, in mapping order."""
    from transformers.models.auto import modeling_auto
    out: dict[str, str] = {}
    for mapping in TASK_MAPPINGS[task]:
        for model_type, cls in getattr(modeling_auto, mapping).items():
            out.setdefault(model_type, cls[0] if isinstance(cls, (tuple, list)) else cls)
    return out


def tiny_config(model_type: str, config_class: Any = None, model_class: str = "") -> Any:
    """The architecture's config with everything shrunk (see the module docstring).
    `config_class`: the model class's own (a text-only head of a multimodal
    architecture takes the text config, not the architecture's composite one);
    `model_class` picks FAMILY_OVERRIDES kept for one head of an architecture."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import CONFIG_MAPPING
    cls = config_class or CONFIG_MAPPING[model_type]
    # 1. defaults; 2-6. shrunk values; 7. the family's own
    defaults = cls().to_dict()
    overrides = shrink(defaults)
    if model_class.endswith("ForCTC") and "vocab_size" in defaults and defaults["vocab_size"] is None:
        overrides["vocab_size"] = 32  # a CTC head needs its (small) character vocabulary
    overrides.update(FAMILY_OVERRIDES.get(model_type, {}))
    overrides.update(FAMILY_OVERRIDES.get(model_class, {}))
    overrides["use_cache"] = False
    return cls(**overrides)


def shrink(defaults: dict[str, Any]) -> dict[str, Any]:
    """The fields of one config level to change, as keyword arguments of its class."""
    out: dict[str, Any] = {}
    hidden = next((defaults[k] for k in WIDTH if isinstance(defaults.get(k), int)), 0)
    for key, value in defaults.items():
        new = _shrunk(key, value, hidden)
        if new is not _SAME:
            out[key] = new
    for follower, leader in TIES:
        if follower in defaults and defaults[follower] == defaults.get(leader) and leader in out:
            out[follower] = out[leader]
    layers = _layer_count(defaults)
    new_layers = _new_layer_count(defaults, layers)
    if layers:
        for key, value in defaults.items():
            if isinstance(value, list) and len(value) == layers and not key.endswith("_ids"):
                if key in SHRINK:
                    value = [min(v, SHRINK[key]) if isinstance(v, int) else v for v in value]
                if key not in out:
                    out[key] = _per_layer(value, new_layers)
                elif isinstance(out[key], list) and len(out[key]) == layers:  # a zeroed per-layer dropout list
                    out[key] = _per_layer(out[key], new_layers)
            elif key in out and isinstance(out[key], dict) and all(k.isdigit() for k in out[key]):
                out[key] = {k: v for k, v in out[key].items() if int(k) < new_layers}
        for key in SHRINK:
            if SHRINK[key] == 2 and isinstance(defaults.get(key), int) and defaults[key] == layers:
                out[key] = new_layers
    if "head_dim" in defaults and defaults["head_dim"] is None and "num_attention_heads" in defaults:
        out["head_dim"] = HEAD_DIM  # what hidden_size // num_attention_heads gives
    if "num_key_value_heads" in defaults and defaults["num_key_value_heads"] is None:
        out["num_key_value_heads"] = HEADS  # None means multi-head in most configs
    if any(isinstance(defaults.get(k), int) for k in ("num_experts", "num_local_experts", "n_routed_experts",
                                                       "moe_num_experts")):
        out.update({k: 2 for k in TOP_K if k in defaults and defaults[k] is None})  # experts need a top-k
    if defaults.get("is_encoder_decoder") and defaults.get("decoder_start_token_id") is None:
        out["decoder_start_token_id"] = defaults.get("pad_token_id") or 0  # labels shift right from it
    out.update(_stage_lists(defaults))
    out.update(_kv_heads(defaults))
    out.update(_token_ids(defaults, out.get("vocab_size", defaults.get("vocab_size"))))
    return out


_SAME = object()


def _shrunk(key: str, value: Any, hidden: int) -> Any:
    """2., 3. and 6. for one field; _SAME when it stays."""
    if isinstance(value, dict) and "model_type" in value:  # 6. a nested config
        return {**value, **shrink(value)}
    if isinstance(value, dict) and value and all(isinstance(k, str) and k.isdigit() and isinstance(v, dict)
                                                 for k, v in value.items()):  # per-layer overrides
        return {k: {**v, **shrink(v)} for k, v in value.items()}
    if isinstance(value, float) and any(w in key for w in DROPOUT_WORDS + SPEC_AUGMENT):
        return 0.0
    if key == "apply_spec_augment":
        return False
    if key == "conv_dim" and _int_list(value):
        return [min(v, HIDDEN) for v in value]  # speech conv feature encoder channels
    if (isinstance(value, list) and any(isinstance(v, float) for v in value) and any(w in key for w in DROPOUT_WORDS)
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
        return [0.0] * len(value)  # per-stage rates (CvT's drop_path_rate [0, 0, 0.1]: stochastic depth)
    if key in INIT_STD and isinstance(value, float) and value > 0.02:
        return 0.02  # unit-variance weights give attention scores of ~1e3, whose softmax amplifies rounding
    target = SHRINK.get(key)
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if target is not None:
        return target if is_int and value > target else _SAME
    if is_int and hidden and value > HIDDEN and any(w in key for w in WIDTH_WORDS) and key not in NOT_WIDTHS:
        ratio = value / hidden
        if ratio in RATIOS:
            return int(HIDDEN * ratio)
    return _SAME


def _layer_count(defaults: dict[str, Any]) -> int:
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"):
        if isinstance(defaults.get(key), int):
            return defaults[key]
    return 0


def _new_layer_count(defaults: dict[str, Any], layers: int) -> int:
    """Two layers, or one of each distinct kind a per-layer list names (up to four)."""
    kinds = 2
    for key, value in defaults.items():
        if isinstance(value, list) and len(value) == layers and layers and not any(w in key for w in DROPOUT_WORDS):
            kinds = max(kinds, len(_distinct(value)))
    return min(kinds, 4, layers) if layers else 0


def _per_layer(value: list, n: int) -> list:
    """4. `n` entries holding every distinct entry (first ones first), then the list's own."""
    distinct = _distinct(value)[:n]
    return distinct + value[len(distinct):n] if len(distinct) < n else distinct


def _distinct(value: list) -> list:
    seen: list = []
    for v in value:
        if v not in seen:
            seen.append(v)
    return seen


def _stage_lists(defaults: dict[str, Any]) -> dict[str, Any]:
    """Convolutional and hierarchical vision stages: one block per stage, and per-stage
    widths divided by one factor so the widest is 128 (when it divides them all)."""
    out: dict[str, Any] = {}
    if _int_list(defaults.get("depths")):
        out["depths"] = [1] * len(defaults["depths"])
    widths = defaults.get("hidden_sizes")
    if _int_list(widths) and max(widths) > 128 and all(w % (max(widths) // 128) == 0 for w in widths):
        out["hidden_sizes"] = [w // (max(widths) // 128) for w in widths]
    return out


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, int) and not isinstance(v, bool)
                                                           for v in value)


def _kv_heads(defaults: dict[str, Any]) -> dict[str, Any]:
    """Key/value heads keep their kind: one (multi-query), fewer than the query heads
    (grouped-query: 2), or as many (multi-head)."""
    out = {}
    heads = defaults.get("num_attention_heads") or defaults.get("n_head") or 0
    for key in ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
                "swa_num_key_value_heads", "linear_num_key_heads"):
        kv = defaults.get(key)
        if isinstance(kv, int) and not isinstance(kv, bool):
            out[key] = 1 if kv == 1 else 2 if isinstance(heads, int) and kv < heads else HEADS
    return out


def _token_ids(defaults: dict[str, Any], vocab: Any) -> dict[str, Any]:
    """5. ids at or past the new vocabulary move to its top: vocab-1, vocab-2, ... (an id
    and its repeats in lists keep one new value)."""
    if not isinstance(vocab, int):
        return {}
    moved: dict[int, int] = {}

    def move(i: Any) -> Any:
        if isinstance(i, int) and not isinstance(i, bool) and i >= vocab:
            moved.setdefault(i, vocab - 1 - len(moved))
            return moved[i]
        return i

    out = {}
    for key, value in defaults.items():
        if key.endswith(("_token_id", "_token_index", "_token_ids")):
            new = [move(v) for v in value] if isinstance(value, list) else move(value)
            if new != value:
                out[key] = new
    return out


def special_token_ids(config: Any) -> set[int]:
    """Every token id the config names (kept out of random inputs)."""
    ids: set[int] = set()
    for key, value in config.to_dict().items():
        if key.endswith(("_token_id", "_token_index", "_token_ids")):
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, int) and not isinstance(v, bool):
                    ids.add(v)
    return ids


def text_config_of(config: Any) -> Any:
    """The config that holds the vocabulary (the config itself, or its text_config)."""
    if getattr(config, "vocab_size", None) is None and getattr(config, "text_config", None) is not None:
        return config.text_config
    return config


def example_inputs(task: Task, config: Any, model_class: str, batch: int = 4, seq: int = 8,
                   seed: int = 0) -> dict[str, Any]:
    """Random inputs (and labels, so the model returns a loss) for one example step."""
    g = torch.Generator().manual_seed(seed + 1)
    if task is Task.IMAGE_CLASSIFICATION:
        vision = getattr(config, "vision_config", None) or config
        size = getattr(vision, "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        channels = getattr(vision, "num_channels", 3)
        return {"pixel_values": torch.randn(batch, channels, size, size, generator=g),
                "labels": torch.randint(0, config.num_labels, (batch,), generator=g)}
    if task is Task.SPEECH:
        return speech_inputs(config, model_class, batch, g)
    text = text_config_of(config)
    allowed = torch.tensor(sorted(set(range(text.vocab_size)) - special_token_ids(config)))
    ids = allowed[torch.randint(0, len(allowed), (batch, seq), generator=g)]
    return {"input_ids": ids, "labels": ids.clone()}


MAX_PARAMS = 20_000_000  # a shrunk model bigger than this did not shrink


@dataclass(frozen=True)
class Tiny:
    """One architecture's tiny model and inputs, rebuilt alike in any process (fixed seed):
    the sweep's worker and every gloo rank of its --ranks stage build the same model."""

    arch: str  # transformers model_type
    model_class: str  # e.g. "LlamaForCausalLM"
    task: Task
    training: bool
    batch: int = 4
    seq: int = 8

    def build(self) -> tuple[torch.nn.Module, dict]:
        import transformers
        cls = getattr(transformers, self.model_class)
        config = tiny_config(self.arch, getattr(cls, "config_class", None), self.model_class)
        torch.manual_seed(0)
        model = cls(config)
        n = sum(p.numel() for p in model.parameters())
        if n > MAX_PARAMS:
            biggest = max(model.named_parameters(), key=lambda kv: kv[1].numel())
            raise ValueError(f"did not shrink: {n / 1e6:.1f}M parameters, the largest {biggest[0]} "
                             f"{tuple(biggest[1].shape)}; add the field to sweep_configs.SHRINK or FAMILY_OVERRIDES")
        model.train(self.training)
        return model, example_inputs(self.task, config, self.model_class, self.batch, self.seq)

