"""Policies that choose a compressor per DDP bucket."""

