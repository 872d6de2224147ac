"""The advisor inside the frameworks users train with.

- :mod:`advisor.integrations.lightning`: a Lightning ``Callback`` (``pip install
  compression-advisor[lightning]``).
- :mod:`advisor.integrations.accelerate`: install, autotune or wrap after
  ``accelerator.prepare`` (``pip install compression-advisor[accelerate]``).

Each module imports its framework at import time; this package imports neither.
"""
