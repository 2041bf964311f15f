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


def test_a_stop_met_inside_a_batch_of_tokens_ends_at_the_token_that_completed_it():
    """A reader that lagged gets several tokens in one output; what the client sees (tokens,
    logprobs, text, usage) must be what it would have seen one token at a time."""
    from epd.models.locate import resolve_model
    from epd.models.tokenizer_loading import load_tokenizer
    from epd.router.backends.base import BackendOutput
    from epd.router.pipeline import _TextStream
    from epd.types import TokenLogprobs

    tokenizer = load_tokenizer(resolve_model("tiny-qwen2-vl"))
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog again and again.", add_special_tokens=False)
    logprobs = [TokenLogprobs(token_id=t, logprob=-0.5) for t in ids]

    def run(chunk: int):
        stream, events = _TextStream(tokenizer, ["lazy"]), []
        for start in range(0, len(ids), chunk):
            events.append(stream.event(BackendOutput(ids[start:start + chunk], logprobs[start:start + chunk]), None))
            if events[-1].finish_reason:
                break
        return ([t for e in events for t in e.token_ids], len([lp for e in events for lp in e.logprobs]),
                "".join(e.text for e in events), events[-1].finish_reason, events[-1].stop_reason)

    one_at_a_time = run(1)
    assert one_at_a_time[2] == "The quick brown fox jumps over the " and one_at_a_time[3:] == ("stop", "lazy")
    assert len(one_at_a_time[0]) < len(ids)  # the tokens after the stop never reach the client
    for chunk in (2, 3, 5, len(ids)):
        assert run(chunk) == one_at_a_time, chunk
