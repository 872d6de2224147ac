"""Policies that choose a compressor per DDP bucket."""

# The advisor package (whose lower layers this one builds on) loads first, whichever package a
# program imports first: its root re-exports the tuning entry points, which import this one.
import advisor  # noqa: F401

