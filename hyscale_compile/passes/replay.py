"""Selection replay (joint-graph pass). Placeholder until the training issue lands."""

from __future__ import annotations

from typing import Any


def inductor_config_patches(current: dict[str, Any]) -> dict[str, Any]:
    return {}
