"""The one exception a stage turns into a one-line reason on stderr and a non-zero exit."""


class StageError(Exception):
    """A reason a stage cannot do its job; printed as one line on stderr, exit code 1."""
