"""Examples: run them from the repository root (see README)."""
