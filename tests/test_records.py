"""``kvtrain.records.unrecorded``: which trained iterations no train record of a
metrics.jsonl stands for (each stands for its ``steps_in_window`` iterations)."""

from __future__ import annotations

from kvtrain.records import spans_text, unrecorded


def _train(*windows: tuple[int, int]) -> list[dict]:
    """Train records at ``iteration`` standing for ``steps`` iterations each."""
    return [{"kind": "train", "iteration": i, "steps_in_window": k} for i, k in windows]


START = [{"kind": "event", "iteration": 0, "message": "backend"}]


def test_a_whole_history_has_no_gap():
    # windows of any length, a resume's window carried over a save (4 + 3 steps)
    records = START + _train((5, 5), (10, 5), (17, 7), (18, 1))
    assert unrecorded(records) == [] and unrecorded(records, through=18) == []


def test_gaps_inside_and_at_the_end():
    records = START + _train((2, 2), (4, 2), (10, 2), (12, 2))
    assert unrecorded(records) == [(5, 8)]
    assert unrecorded(records, through=15) == [(5, 8), (13, 15)]
    assert unrecorded(records, through=6) == [(5, 6)]  # up to the checkpoint's, no further
    assert unrecorded(START, through=3) == [(1, 3)]  # no train record kept at all


def test_a_history_begun_from_another_runs_checkpoint_starts_there():
    """An explicit checkpoint.resume of another run at 100: 1-100 are that run's."""
    records = [{"kind": "event", "iteration": 100, "message": "backend"}] + \
        _train((110, 10), (130, 10))
    assert unrecorded(records) == [(111, 120)]


def test_gaps_an_event_names_count_once():
    named = {"kind": "event", "iteration": 12, "missing_iterations": [[5, 8]]}
    records = START + _train((4, 4), (12, 4)) + [named] + _train((14, 2))
    assert unrecorded(records + _train((20, 2))) == [(15, 18)]
    assert unrecorded(records, named_too=True) == [(5, 8)]  # a curve's gaps: all of them
    assert unrecorded(records, through=16) == [(15, 16)]


def test_a_file_that_cannot_tell_says_nothing():
    # an older kvtrain's records (no window), an empty file, a window not a count
    assert unrecorded(START + [{"kind": "train", "iteration": 10}], through=20) == []
    assert unrecorded([], through=20) == []
    assert unrecorded(START + [{"kind": "train", "iteration": 10, "steps_in_window": "10"}]) == []


def test_spans_read_as_text():
    assert spans_text([(7, 10)]) == "7-10"
    assert spans_text([(3, 3), (7, 10), (12, 20)]) == "3, 7-10 and 12-20"
