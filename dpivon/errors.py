"""User-facing errors: one clear line, no traceback, non-zero exit."""


class DpivonError(Exception):
    """An input or environment problem the user can fix; the message says how."""
