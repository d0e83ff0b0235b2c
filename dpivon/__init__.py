"""dpivon."""
