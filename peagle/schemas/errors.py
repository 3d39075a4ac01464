"""The one exception type for mistakes a user can fix (bad flag, missing file, mismatched store)."""


class UserError(Exception):
    """A user-caused error: the CLI prints ``str(err)`` as one line on stderr and exits non-zero.

    Raise it with a message that names the thing and both values where two disagree, e.g.
    ``UserError("store hidden_size 4096 does not match target hidden_size 128 (store: /data/s)")``.
    """


def one_line(err: BaseException, limit: int = 240, with_type: bool = True) -> str:
    """``err`` as one line of at most ``limit`` characters of message, for a UserError or a record.

    Library errors (Inductor, vLLM, transformers) often span pages; a user-facing line keeps the
    start, where they name what failed, with every run of whitespace (newlines included) made one space.
    """
    text = " ".join(str(err).split())[:limit] or "no message"
    return f"{type(err).__name__}: {text}" if with_type else text


def show_value(value: object) -> str:
    """A setting's value as a user error names it: lists comma-joined (``2,15,27``, as flags take
    them), strings quoted (so an empty or spaced value stays visible), anything else as ``str``."""
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return repr(value) if isinstance(value, str) else str(value)
