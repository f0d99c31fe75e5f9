"""Links between ranks: the alpha-beta model of one kind of connection, and its kind.

A mesh axis is priced with one link. Which one depends on where the axis's process
groups run (autopar/core/mesh.py, Mesh.link_kinds): an axis whose every group lies inside
one node talks over the intra-node link (NVLink, or loopback on one host); an axis with
any group spanning nodes talks over the inter-node link (InfiniBand). A ring collective
runs at the pace of its slowest hop, so a group that is only partly inside a node is an
inter-node group.

These are core values (not cost-model ones) because Options takes links to override a
device preset's, and a Plan records the link each of its axes was priced with.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping, Optional

from autopar.core.errors import OptionsError


class LinkKind(str, Enum):
    """Where an axis's collectives travel. A str enum: its value is what files store."""

    INTRA = "intra"  # every group of the axis stays inside one node
    INTER = "inter"  # some group of the axis spans nodes


@dataclass(frozen=True)
class Link:
    """alpha-beta model of one mesh axis: a message of b bytes costs alpha + b * beta."""

    alpha_s: float
    beta_s_per_byte: float
    name: str = ""


@dataclass(frozen=True)
class AxisLink:
    """The link one mesh axis was priced with, as a Plan records it (Plan.links[axis])."""

    kind: LinkKind
    link: Link

    def __str__(self) -> str:
        bandwidth = f", {1 / self.link.beta_s_per_byte / 1e9:.3g} GB/s" if self.link.beta_s_per_byte > 0 else ""
        return f"{self.link.name or 'unnamed'} ({self.kind.value}-node, {self.link.alpha_s * 1e6:.3g} us{bandwidth})"


def link_overrides(value: Optional[Mapping[Any, Any]]) -> dict[LinkKind, Link]:
    """Options.links as {LinkKind: Link}: keys are LinkKind members (or their values
    "intra" / "inter"), values Links. An OptionsError names anything else and the fix."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise OptionsError(f"Options.links={value!r} is not a mapping; pass e.g. "
                           "{LinkKind.INTER: Link(alpha_s=20e-6, beta_s_per_byte=1 / 25e9, name='ib')}")
    out: dict[LinkKind, Link] = {}
    for key, link in value.items():
        try:
            kind = LinkKind(key)
        except ValueError:
            raise OptionsError(f"Options.links has key {key!r}; the keys are LinkKind.INTRA ('intra') and "
                               "LinkKind.INTER ('inter')") from None
        if not isinstance(link, Link) or link.alpha_s < 0 or link.beta_s_per_byte < 0:
            raise OptionsError(f"Options.links[{kind.value!r}]={link!r} is not a Link with non-negative alpha_s "
                               "and beta_s_per_byte; pass Link(alpha_s, beta_s_per_byte, name)")
        out[kind] = link
    return out
