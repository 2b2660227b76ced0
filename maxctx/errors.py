"""The user-facing error of a bad configuration (the entry points print it as one line and exit 2)."""


class ConfigError(ValueError):
    """A bad configuration: the message names the key, the value and the fix."""
