"""Example inputs for the speech sweep, made from the model's own `main_input_name` and
config (re-exported through sweep_configs.example_inputs).

- Raw waveforms (input_values of a convolutional feature encoder: conv_kernel/conv_stride
  on the config or a sub-config) are long enough for FRAMES encoder frames, comfortably
  more than any SpecAugment mask length or positional conv kernel.
- Spectrograms (the config or a sub-config names a feature size, FEATURE_SIZE) are
  (batch, FEATURES_FRAMES, features), whatever the input's name.
- CTC heads get no labels (torch.export cannot trace the CTC loss: a data-dependent
  output shape, and transformers' Python check of labels.max()); classification heads
  one label in range(num_labels).
- SPEECH_FORMS is the one table of per-family exceptions to these input shapes.
"""

from __future__ import annotations

from typing import Any

import torch

FRAMES = 32  # encoder frames after a waveform's conv feature encoder
FEATURES_FRAMES = 64  # spectrogram frames (subsampled 4-8x by the feature models)
# config fields that name the spectrogram's feature size, first found wins
FEATURE_SIZE = ("num_mel_bins", "feature_projection_input_dim", "input_feat_per_channel", "feature_size")

# model_type -> exceptions to the generic shapes:
#   features_first: spectrogram as (batch, features, frames)
#   frames: the exact frame count the model requires, from its config
#   stacked: the feature extractor stacks that many frames into one row (features x stacked)
#   channel: the waveform is (batch, 1, samples)
#   mask: an all-ones (batch, frames or samples) mask under that name (the CTC loss takes
#         its lengths from the mask the encoder returns, None without one)
SPEECH_FORMS: dict[str, dict[str, Any]] = {
    "whisper": dict(features_first=True, frames=lambda c: 2 * c.max_source_positions),  # two stride-1/2 convs
    "audio-spectrogram-transformer": dict(frames=lambda c: c.max_length),  # patch grid fixed by max_length
    "granite_speech5_ctc": dict(stacked=4, mask="attention_mask"),  # input_linear takes num_mel_bins * 4
    "lasr_ctc": dict(mask="attention_mask"),
    "parakeet_ctc": dict(mask="attention_mask"),
    "omniasr_ctc": dict(channel=True, mask="padding_mask"),
}


def speech_inputs(config: Any, model_class: str, batch: int, g: torch.Generator) -> dict[str, Any]:
    """Inputs and labels of one speech model (see the module docstring)."""
    import transformers

    cls = getattr(transformers, model_class, None)
    name = getattr(cls, "main_input_name", None) or "input_values"
    form = SPEECH_FORMS.get(config.model_type, {})
    features = _find(config, FEATURE_SIZE)
    conv = _find(config, ("conv_stride",))
    if isinstance(features, int) and not conv:
        frames: int = form.get("frames", lambda c: FEATURES_FRAMES)(config)
        features *= form.get("stacked", 1)
        shape = (batch, features, frames) if form.get("features_first") else (batch, frames, features)
        length = frames
    else:
        length = _samples(config)
        shape = (batch, 1, length) if form.get("channel") else (batch, length)
    inputs = {name: torch.randn(*shape, generator=g)}
    if "mask" in form:
        inputs[form["mask"]] = torch.ones(batch, length, dtype=torch.long)
    if model_class.endswith("ForCTC"):
        # no labels: the CTC loss cannot be exported (aten._ctc_loss has a data-dependent
        # output shape, and transformers checks labels.max() in Python first); the sweep
        # differentiates the mean square of the logits instead (simulated.loss_of)
        return inputs
    inputs["labels"] = torch.randint(0, config.num_labels, (batch,), generator=g)
    return inputs


def _samples(config: Any) -> int:
    """Waveform length whose conv feature encoder yields FRAMES frames (receptive field of
    the first frame plus one total stride per further frame)."""
    strides = _find(config, ("conv_stride",)) or [320]
    kernels = _find(config, ("conv_kernel",)) or [400]
    field, step = 1, 1
    for k, s in zip(kernels, strides):
        field += (k - 1) * step
        step *= s
    return field + step * (FRAMES - 1)


def _find(config: Any, keys: tuple[str, ...]) -> Any:
    """The first of `keys` set on the config, else on one of its sub-configs."""
    for key in keys:
        if getattr(config, key, None) is not None:
            return getattr(config, key)
    for sub in vars(config).values():
        if hasattr(sub, "to_dict") and hasattr(sub, "model_type"):
            found = _find(sub, keys)
            if found is not None:
                return found
    return None

