"""Stop strings over streamed text (``epd.router.stop_strings``), the one implementation both front
ends get through the pipeline."""
from epd.router.stop_strings import StopStrings


def feed_all(stops, pieces):
    matcher, out = StopStrings(stops), []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return out, True
    out.append(matcher.flush())
    return out, False


def test_stop_string_split_across_pieces_is_never_partly_sent():
    out, stopped = feed_all(["world"], ["Hello wo", "rld and more"])
    assert stopped and out == ["Hello ", ""]


def test_held_back_text_is_released_when_it_stops_matching():
    out, stopped = feed_all(["STOP"], ["a ST", "x", "b"])
    assert not stopped and out == ["a ", "STx", "b", ""]
    out, stopped = feed_all(["ab", "xyz"], ["1x", "y", "2"])
    assert "".join(out) == "1xy2" and not stopped


def test_earliest_stop_string_wins():
    out, stopped = feed_all(["cd", "b"], ["abcd"])
    assert stopped and out == ["a"]


def test_stop_string_split_across_deltas():
    matcher = StopStrings(["STOP"])
    assert matcher.feed("abc ST") == ("abc ", None)  # "ST" might begin STOP: held back
    assert matcher.feed("OP and more") == ("", "STOP")


def test_held_back_text_is_released_at_the_end_when_it_is_not_a_stop():
    matcher = StopStrings(["STOP", "\n\n"])
    assert matcher.feed("x\n") == ("x", None)
    assert matcher.feed("y S") == ("\ny ", None)
    assert matcher.feed("T") == ("", None)
    assert matcher.flush() == "ST"


def test_earliest_stop_wins_and_no_stops_pass_through():
    assert StopStrings(["b", "a"]).feed("xxabxx") == ("xx", "a")
    assert StopStrings([]).feed("anything") == ("anything", None)


def test_the_stop_string_stays_in_the_output_when_asked_and_the_longer_of_two_at_one_place_wins():
    assert StopStrings(["ab", "abc"], include_in_output=True).feed("xxabcx") == ("xxabc", "abc")
    matcher = StopStrings(["END"], include_in_output=True)
    assert matcher.feed("one E") == ("one ", None) and matcher.feed("ND two") == ("END", "END")
