"""What tests compare of the online tuner's events across ranks."""


def event_kinds(events: list[str]) -> list[str]:
    """What each event was, in order (their details carry rank-local timings, like "took 0.2 s")."""
    return [e.split(":", 1)[0] for e in events]
