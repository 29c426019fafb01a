class ConfigError(ValueError):
    """one-line configuration error naming the field"""


def check(cond: bool, msg: str) -> None:
    """Raise :class:`ConfigError` with ``msg`` unless ``cond``."""
    if not cond:
        raise ConfigError(msg)
