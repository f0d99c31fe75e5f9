"""Profiles autopar ships: cost profiles measured on an accelerator (bench/gpu_profile.py
writes one), kept in cost_models/profiles/ as <preset>.json, so that users of that device
plan from its measurements offline, without one: Options(cost_model="saved", device=
"h200") with no profile_path reads profiles/h200.json."""

from __future__ import annotations

import os
from typing import Optional

from autopar.core.errors import OptionsError

PROFILES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")


def shipped_presets(folder: Optional[str] = None) -> tuple[str, ...]:
    """The presets a profile is shipped for, sorted."""
    folder = folder or PROFILES_DIR
    if not os.path.isdir(folder):
        return ()
    return tuple(sorted(f[:-len(".json")] for f in os.listdir(folder) if f.endswith(".json")))


def shipped_profile_path(preset: str, folder: Optional[str] = None) -> str:
    """The shipped profile of `preset` (a DeviceSpec's name); an OptionsError naming the
    ones shipped where it has none."""
    folder = folder or PROFILES_DIR
    path = os.path.join(folder, f"{preset}.json")
    if os.path.isfile(path):
        return path
    shipped = ", ".join(shipped_presets(folder)) or "none yet"
    raise OptionsError(f"cost_model='saved' without profile_path reads the profile autopar ships for the device, "
                       f"and none is shipped for {preset!r} (shipped: {shipped}); give a profile's file as "
                       "profile_path=, or measure one on the device with cost_model='profile'")
