class ConfigError(ValueError):
    """one-line configuration error naming the field"""
