"""Errors that fedrun reports to the user as one line."""


class ConfigError(ValueError):
    """An invalid configuration value, found before any training starts.

    Args:
        key: The config key, relative to its group (``temperature``) or absolute (``aggregator.temperature``).
        value: The value that was given.
        allowed: What is allowed, in words (``"a number > 0"``).
    """

    def __init__(self, key: str, value, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value!r} is invalid: allowed is {allowed}")

    def within(self, group: str) -> "ConfigError":
        """The same error with its key prefixed by the config group it belongs to."""
        if self.key == group or self.key.startswith(group + "."):
            return self
        return ConfigError(f"{group}.{self.key}", self.value, self.allowed)


class JobFailed(Exception):
    """A sweep job that failed (its one-line reason already printed): the sweep's other jobs still run, and the
    sweep ends with exit status 1 and one line, not Hydra's traceback of the first failure."""


class DivergenceError(RuntimeError):
    """Training produced a non-finite loss or model."""


def check(ok: bool, key: str, value, allowed: str) -> None:
    """Raise a ConfigError for ``key`` unless ``ok``."""
    if not ok:
        raise ConfigError(key, value, allowed)
