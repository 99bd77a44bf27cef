"""A log's non-finite gradient norm beside a finite loss: with too few earlier losses to measure
a noise, the message says so (and how the loss stands against them), never "within its noise"."""

import math
import re
import statistics

from helpers.detector_tester import engine_steps, loss_records
from hypothesis import assume, given
from hypothesis import strategies as st

from nummon import AlertKind, load_policy

P = load_policy("default")

SHORT = re.compile(
    r"beside a finite loss \((\S+)x the median of the (\d+) loss(?:es)? before it: too few to measure its noise\)"
)


def _skip_alert(losses, norms):
    """The non-finite alert of the last record."""
    last = engine_steps(loss_records(losses, norms))[-1]
    return [a for a in last.alerts if a.kind is AlertKind.NONFINITE][0]


def test_a_nan_grad_norm_beside_a_loss_up_1_6x_after_two_records_claims_no_noise():
    alert = _skip_alert([2.0, 2.1, 3.3], [1.0, 1.1, float("nan")])
    assert "within its noise" not in alert.message
    m = SHORT.search(alert.message)
    assert m and m.groups() == ("1.61", "2"), alert.message


@given(
    before=st.lists(st.floats(0.01, 100.0), min_size=1, max_size=4),
    up=st.floats(0.3, 3.9),
)
def test_with_fewer_than_five_earlier_losses_the_words_give_the_true_ratio(before, up):
    """1-4 earlier losses, then a NaN grad norm beside a loss `up` x their median (under the
    4x a short history takes for a jump): the message's ratio and count are the truth."""
    mid = statistics.median(before)
    # (a jump is judged in log space: the median of the log losses, of two middle ones their mean)
    assume(up * mid < 3.9 * 10 ** statistics.median([math.log10(v) for v in before]))
    alert = _skip_alert([*before, up * mid], [1.0] * len(before) + [float("nan")])
    m = SHORT.search(alert.message)
    assert m, alert.message
    assert math.isclose(float(m.group(1)), up, rel_tol=5e-3) and int(m.group(2)) == len(before)


def test_with_no_earlier_loss_the_words_say_there_is_no_history():
    alert = _skip_alert([3.3], [float("nan")])
    assert "(no earlier loss: no history to measure its noise)" in alert.message


def test_with_enough_history_the_loss_is_still_read_against_its_noise():
    alert = _skip_alert([2.0, 2.02, 1.98, 2.01, 1.99, 2.0, 2.0], [1.0] * 6 + [float("nan")])
    assert "beside a finite loss within its noise" in alert.message
