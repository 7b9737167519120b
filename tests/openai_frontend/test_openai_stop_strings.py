"""Stop strings cut the text before the first stop; a stop split across deltas never leaks."""
import pytest

from openai_frontend.stop_strings import StopTrimmer


def run(stops, deltas):
    trimmer = StopTrimmer(stops)
    out = [trimmer.push(d) for d in deltas]
    return out, trimmer.flush(), trimmer.stopped


def test_no_stops_pass_everything_through_at_once():
    assert run([], ["a", "b"]) == (["a", "b"], "", False)


def test_stop_inside_one_delta_cuts_before_it():
    out, rest, stopped = run(["Paris"], ["The capital is Paris.", " More"])
    assert "".join(out) + rest == "The capital is " and stopped


def test_stop_split_across_deltas_is_held_back_then_dropped():
    out, rest, stopped = run(["Paris"], ["is P", "ar", "is!"])
    assert out == ["is ", "", ""] and rest == "" and stopped


def test_held_back_prefix_is_released_when_it_is_not_a_stop():
    out, rest, stopped = run(["Paris"], ["is P", "ie"])
    assert out == ["is ", "Pie"] and not stopped
    out, rest, stopped = run(["Paris"], ["a Par"])
    assert out == ["a "] and rest == "Par" and not stopped  # the end of the stream releases it


def test_earliest_of_several_stops_wins():
    out, rest, _ = run(["cd", "b"], ["abcd"])
    assert "".join(out) == "a"


@pytest.mark.parametrize("text", ["hello world, stop here", "xxstopyy", "stostop"])
def test_any_split_gives_the_same_text(text):
    expected = text[:text.index("stop")]
    for cut in range(1, len(text)):
        out, rest, _ = run(["stop"], [text[:cut], text[cut:]])
        assert "".join(out) + rest == expected, cut
