"""User-facing errors: one clear line, no traceback, non-zero exit."""


class DpivonError(ValueError):
    """An input or environment problem the user can fix; the message says how.

    A ValueError, like the library's other argument errors: the CLI shows both as one line.
    """
