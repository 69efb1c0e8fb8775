"""The one exception type for bad input.

Anything the user can fix (a config value, a missing file, a corrupt shard) raises UsageError with a
single line that names the problem and the fix. The CLI prints it and exits with status 2 before any
long work starts; everything else is a bug and keeps its traceback.
"""

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input: printed as one line by the CLI, exit status 2."""

    def __init__(self, message: str):
        # Keep it on one line whatever the caller passed.
        super().__init__(" ".join(str(message).split()))
