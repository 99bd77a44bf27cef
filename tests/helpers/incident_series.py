"""The incident-state series the incident events imply: what every sink's `nummon/incident_state`
chart must show."""

from nummon import IncidentState


def expected_series(events, steps):
    """step -> the incident state's code after that step's report: the latest event at or before it."""
    out, state, i = {}, IncidentState.NONE, 0
    events = sorted(events, key=lambda e: e.step)
    for s in steps:
        while i < len(events) and events[i].step <= s:
            state = events[i].state
            i += 1
        out[s] = state.rank
    return out
