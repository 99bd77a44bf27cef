""" "Chance level" only on grounds: a known class count (stall.chance_loss) or a loss frozen exactly on ln k."""

import math
import random

from helpers.detector_tester import loss_records, loud

from nummon import load_policy


def messages(losses, policy="default"):
    return [a.message for a in loud(loss_records(losses), policy)]


def test_a_seq2seq_loss_near_ln_6_is_not_called_a_6_class_classifier():
    rng = random.Random(0)
    losses = [2.6 - 0.8 * i / 40 for i in range(40)] + [1.79 * (1 + rng.uniform(-0.008, 0.008)) for _ in range(200)]
    said = " | ".join(messages(losses))
    assert "chance level" not in said and "6-class" not in said, said


def test_a_loss_frozen_exactly_on_ln_2_is_at_chance():
    losses = [0.9 - 0.2 * i / 10 for i in range(10)] + [math.log(2)] * 30
    said = " | ".join(messages(losses))
    assert "ln 2 = 0.6931, the chance level of a 2-class classifier" in said, said


def test_with_the_class_count_known_a_noisy_loss_at_chance_is_a_stall():
    rng = random.Random(1)
    losses = [1.9 - 0.1 * i / 10 for i in range(10)] + [math.log(6) * (1 + rng.uniform(-0.02, 0.02)) for _ in range(60)]
    policy = load_policy("default").model_copy(deep=True)
    policy = policy.model_copy(update={"stall": policy.stall.model_copy(update={"chance_loss": math.log(6)})})
    said = " | ".join(messages(losses, policy))
    assert "the chance level" in said and "stall.chance_loss" in said, said
