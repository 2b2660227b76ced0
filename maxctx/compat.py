"""MaxText's key names and values, read into maxctx's schema (filled in by the MaxText compatibility work)."""

from __future__ import annotations

from typing import Any


def translate(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """One config layer (a YAML file or the command line) with MaxText's spellings turned into maxctx's."""
    return dict(raw)
