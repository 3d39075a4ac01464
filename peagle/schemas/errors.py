"""The one exception type for mistakes a user can fix (bad flag, missing file, mismatched store)."""


class UserError(Exception):
    """A user-caused error: the CLI prints ``str(err)`` as one line on stderr and exits non-zero.

    Raise it with a message that names the thing and both values where two disagree, e.g.
    ``UserError("store hidden_size 4096 does not match target hidden_size 128 (store: /data/s)")``.
    """
