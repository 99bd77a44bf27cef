"""The report's countdown table, judged against what happened, on generated families of
runaways: a figure hit is a hit (also the exact value of "at most N"), a forecast at the first
non-finite step itself is not judged, a forecast on a run that never overflowed within the
figure is a miss; counts are written in the singular when there is one."""

import json
import math
import re

from helpers.countdown_families import Family
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nummon._report import build_report
from nummon._report.load import RunData, _new_record
from nummon._report.page import render
from nummon._report.story import Countdown

ROW = re.compile(
    r"<tr><td>step (\d+)</td><td><code>[^<]*</code></td><td>([^<]*)</td><td>([^<]*)</td><td class=muted>([^<]*)</td></tr>"
)
FIGURE = re.compile(r"^[~≤]([0-9.e+]+)(?:–([0-9.e+]+))? steps?$")


def rows(html):
    """[(said at, (low, high), left or None, verdict)] of every countdown table on the page."""
    out = []
    for step, said, left, verdict in ROW.findall(html):
        m = FIGURE.match(said)
        assert m, said
        low = float(m.group(1))
        high = float(m.group(2)) if m.group(2) else low
        out.append((int(step), (low, high), None if left == "—" else int(left.split()[0]), verdict))
    return out


def _write(path, recs):
    path.write_text("".join(json.dumps({"step": s, "loss": v if math.isfinite(v) else str(v)}) + "\n" for s, v in recs))
    return path


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.floats(0.5, 3.0), st.floats(0.3, 0.9), st.integers(0, 400))
def test_a_forecast_on_a_run_that_never_overflowed_is_a_miss(tmp_path, p1, rho, extra):
    """Decelerating runaways that level off below the max, then `extra` steps on the plateau: a
    figure the steps that followed outlived is a miss, never early and never a hit."""
    recs, over = Family("decelerating", p1, rho).records()
    assert over == math.inf
    last_step, last = recs[-1]
    recs += [(last_step + i, last) for i in range(1, extra + 1)]
    html = build_report(_write(tmp_path / "fam.jsonl", recs))
    end = recs[-1][0]
    for step, (_, high), left, verdict in rows(html):
        assert left is None
        followed = end - step
        if followed > high:
            assert verdict == f"missed: no overflow in the {followed} step{'s' if followed != 1 else ''} that followed"
        else:
            assert verdict.startswith("not judged: the log ends")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["constant", "quadratic", "double_exp"]), st.floats(0.2, 1.5), st.integers(0, 3))
def test_every_forecast_of_a_run_that_overflowed_is_judged_by_its_numbers(tmp_path, shape, p1, seed):
    p2 = {"constant": 0.0, "quadratic": 0.02, "double_exp": 0.1}[shape]
    fam = Family(shape, p1 if shape != "double_exp" else p1 / 4, p2, noise=0.003 * seed, seed=seed)
    recs, _ = fam.records()
    html = build_report(_write(tmp_path / "fam.jsonl", recs))
    for _, (low, high), left, verdict in rows(html):
        assert left is not None
        if left == 0:
            assert verdict == "not judged: said at the first NaN/Inf step itself"
        elif low <= left <= high or (left == round(low) and low == high):
            assert verdict.startswith("hit")
        elif left > high:
            assert verdict.startswith("early (safe side)")
        else:
            assert verdict.startswith("late") or verdict == "hit: within the bound said"


@given(st.integers(1, 10_000), st.booleans())
def test_the_exact_figure_is_a_hit_at_most_n_included(n, bound):
    assert Countdown(0, "loss", float(n), n, bound=bound).verdict.startswith("hit")
    assert Countdown(0, "loss", float(n), n + 1, bound=bound).verdict.startswith("early (safe side)")
    assert Countdown(0, "loss", float(n), 0, bound=bound).verdict.startswith("not judged")
    if bound and n > 1:
        assert Countdown(0, "loss", float(n), n - 1, bound=True).verdict == "hit: within the bound said"
    elif n > 1:
        assert Countdown(0, "loss", float(n), n - 1).verdict == "late: fewer were left"


def test_counts_of_one_are_singular_on_the_page():
    """Eleven forecasts of one step, each with one step left: '1 step', '1 more forecast'."""
    n = 40
    records = [_new_record({"step": s, "loss": 2.0 * 1.5 ** max(0, s - 20)}) for s in range(n)]
    records[-1] = _new_record({"step": n - 1, "loss": math.nan})
    alerts = [
        {"step": s, "kind": "runaway", "severity": "warning", "metric": m, "message": "m"}
        | {"details": {"steps_to_overflow": 1.0}}
        for s in (n - 2,)
        for m in [f"m{i}" for i in range(11)]
    ]
    events = [
        {"step": 25, "state": "open", "number": 1, "opened_step": 25},
        {"step": n - 1, "state": "nonfinite", "number": 1, "opened_step": 25},
    ]
    html = render(RunData("generated", records, alerts, events))
    assert "~1 step</td><td>1 step</td>" in html and "hit" in html
    assert "1 steps" not in html and "and 1 more forecast." in html
    assert "1 were left" not in html and "1 was left" in html
