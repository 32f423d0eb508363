"""`Deadline`: one point in time handed down the layers; what the option's timeout becomes."""

from __future__ import annotations

import time

import pytest

from ems.records import MAX_TIMEOUT_MS, Deadline
from ems.types import CcKvOption

# no EMS_* settings in the environment and no initialised `Ems`, before and after each test
pytestmark = pytest.mark.usefixtures("clean_ems")


@pytest.mark.parametrize("timeout_ms", [1, 1500, MAX_TIMEOUT_MS - 1])
def test_of_option_is_its_timeout_from_now(timeout_ms):
    before = time.monotonic()
    deadline = Deadline.of(CcKvOption(timeout=timeout_ms))
    assert before + timeout_ms / 1000 <= deadline.at <= time.monotonic() + timeout_ms / 1000


@pytest.mark.parametrize("timeout_ms", [0, MAX_TIMEOUT_MS, MAX_TIMEOUT_MS * 3])
def test_no_limit_and_beyond_are_the_maximum(timeout_ms):
    left = Deadline.of(CcKvOption(timeout=timeout_ms)).left()
    assert MAX_TIMEOUT_MS / 1000 - 5 < left <= MAX_TIMEOUT_MS / 1000


def test_left_never_negative_and_expired():
    past = Deadline.after(-3.0)  # a negative span is now
    assert past.left() == 0.0 and past.expired()
    gone = Deadline(time.monotonic() - 10)
    assert gone.left() == 0.0 and gone.expired()
    soon = Deadline.after(30)
    assert 29 < soon.left() <= 30 and not soon.expired()
    assert soon.extended(2).at == soon.at + 2


def test_within_keeps_a_deadline_and_turns_seconds_into_one():
    deadline = Deadline.after(1)
    assert Deadline.within(deadline) is deadline
    assert 4 < Deadline.within(5.0).left() <= 5.0
