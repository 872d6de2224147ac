"""The package's version: written here once; ``pyproject.toml`` reads it, and profiles record it."""

__version__ = "0.1.0"
