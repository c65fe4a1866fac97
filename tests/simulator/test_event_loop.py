import math

import pytest

from benchmarks.simulator.event_loop import EventLoop


def test_events_run_in_time_order_and_ties_in_scheduling_order():
    loop, seen = EventLoop(), []
    loop.at(2.0, seen.append, "c")
    loop.at(1.0, seen.append, "a")
    loop.at(1.0, seen.append, "b")
    loop.after(0.5, lambda: loop.after(1.0, seen.append, "a2"))  # runs at 1.5
    assert loop.run() == 2.0
    assert seen == ["a", "b", "a2", "c"]
    assert loop.events_run == 5 and len(loop) == 0


def test_run_until_stops_the_clock_there_and_keeps_later_events():
    loop, seen = EventLoop(), []
    loop.at(1.0, seen.append, 1)
    loop.at(3.0, seen.append, 3)
    assert loop.run(until=2.0) == 2.0
    assert seen == [1] and len(loop) == 1
    assert loop.run() == 3.0 and seen == [1, 3]


@pytest.mark.parametrize("when", [-1.0, math.nan, math.inf])
def test_the_past_and_non_finite_times_are_refused(when):
    loop = EventLoop()
    loop.at(1.0, lambda: None)
    loop.run()
    with pytest.raises(ValueError, match="cannot schedule"):
        loop.at(when if when != -1.0 else 0.5, lambda: None)
    with pytest.raises(ValueError, match="delay must be >= 0"):
        loop.after(-0.1, lambda: None)
    assert len(loop) == 0
