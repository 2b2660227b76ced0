"""The user-facing error of a bad configuration (the entry points print it as one line and exit 2), and the
"did you mean" hint its messages share."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A bad configuration: the message names the key, the value and the fix."""


def did_you_mean(value: str, options: Iterable[str], cutoff: float = 0.5, otherwise: str = "pick one of them") -> str:
    """"did you mean 'x'?" for the closest of `options`, or `otherwise` when none is close enough."""
    match = difflib.get_close_matches(value, list(options), n=1, cutoff=cutoff)
    return f"did you mean '{match[0]}'?" if match else otherwise


def article(noun: str) -> str:
    """'an int', 'a str': a type or key name with its article, for messages built from names."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"
