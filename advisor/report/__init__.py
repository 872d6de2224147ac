"""Renderers: they draw what the library computed (rich tables fitted to the terminal, PNG plots).

``text``: profiles, plan predictions and the shared table helpers; ``results``: autotune
results and searches; ``validation``: time-to-accuracy reports.
"""
