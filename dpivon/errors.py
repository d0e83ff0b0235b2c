"""User-facing errors: one clear line, no traceback, non-zero exit."""


class DpivonError(ValueError):
    """An input or environment problem the user can fix; the message says how.

    A ValueError, like the library's other argument errors: the CLI shows both as one line.
    """


def first_line(err: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, at most ``limit`` characters (its type's
    name where the message is empty): what a one-line error quotes of a library's error,
    whose later lines are detail or traceback."""
    lines = str(err).strip().splitlines()
    return lines[0][:limit] if lines else type(err).__name__
