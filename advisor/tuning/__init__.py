"""Choosing and proving a plan: autotune (offline), wrap (online), live measurement, the accuracy trial, what-if."""
