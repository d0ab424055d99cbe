"""Input that cannot run, and the exit code every command of this project gives for it."""

EXIT_BAD_INPUT = 2


class BadInput(ValueError):
    """A value, path or name given by the user that cannot run; the message names it, what was
    given and what is allowed. The CLIs (`agentgym-mega`, `checkpoint_tools`) turn it into
    exit code EXIT_BAD_INPUT and the message, without a traceback."""


class ConfigError(BadInput):
    """A configuration that cannot run; the message names the key, the value and what is allowed."""
