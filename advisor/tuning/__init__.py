"""Choosing and proving a plan, in the order the tuners run.

- ``steps``: the steps both tuners share (profile, search, short-list, decide, install);
- ``autotune``: the offline tuner, before the training loop;
- ``online``: the online tuner inside the loop (``wrap``: observe, race, watch);
- ``live``: plans timed on a shadow copy of the user's model;
- ``accuracy``: the paired accuracy trial against fp32;
- ``results``, ``prediction``, ``whatif``: the documents and summaries they produce.
"""
