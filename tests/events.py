"""What tests read of the online tuners' events: their kinds across ranks, and the story of an online proof."""


def happened_in_order(events: list[tuple[int, str, str]], *whats: str) -> None:
    """Each of ``whats`` is among the ``(step, what, detail)`` events, the first of each in this order;
    the failure shows every event, details included (an index() of a missing one would show none)."""
    seen = [w for _, w, _ in events]
    assert all(w in seen for w in whats), (whats, events)
    at = [seen.index(w) for w in whats]
    assert at == sorted(at), (whats, events)


def event_kinds(events: list[str]) -> list[str]:
    """What each event was, in order (their details carry rank-local timings, like "took 0.2 s")."""
    return [e.split(":", 1)[0] for e in events]


def proven_online(events: list[tuple[int, str, str]], retimed: list[dict], label: str) -> tuple[str, list, dict]:
    """Check the story of a plan ``label`` (``"<config> everywhere"`` as the race names it) that the first
    trial was too short for, told by ``(step, what, detail)`` events: decided unproven and announced
    to go on online; proven at the announced step; raced alone beside the baseline on the next steps;
    installed on that second figure.  Returns the decision's text, the proofs ``(step, detail)`` and
    the one re-timing, for a tuner's own checks."""
    decided = next(d for _, w, d in events if w == "decided")
    assert f"{label} everywhere: not proven" in decided, decided
    unproven = next(d for _, w, d in events if w == "unproven")
    assert "won the race" in unproven and "the trial goes on online" in unproven, unproven
    at = int(unproven.split("from the weights at step ")[1].split(",")[0])
    proofs = [(step, d) for step, w, d in events if w == "proof"]
    assert proofs and proofs[0][0] == at, events
    # a near-lossless plan on a steadily learning task: the longer trial proves it ...
    assert "within the tolerance" in proofs[0][1] and "timed again beside" in proofs[0][1], proofs
    # ... then it races the baseline alone on the loop's next steps, and is installed on that figure
    happened_in_order(events, "decided", "re-timing", "re-timed")
    (timing,) = retimed
    assert timing["label"].startswith(label), timing
    last = proofs[-1][1]
    assert len(proofs) == 2 and proofs[1][0] > proofs[0][0] and "re-timed step speed-up" in last, proofs
    assert f"{timing['speedup']:.2f}x" in last and "proven online, installed" in last, last
    return decided, proofs, timing
