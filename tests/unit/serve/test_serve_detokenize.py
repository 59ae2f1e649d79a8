"""Incremental detokenizing with stop strings (see [Note: incremental detokenizing]): the pieces
join to the whole text, text that may start a stop string waits for the next token, a stop
string ends the text before it, and the end of a request releases what was held."""

import pytest

from shardwise.serve._openai import IncrementalDetokenizer, RequestError, parse_request


class Bytes:
    """Token ids are UTF-8 bytes, so one character may take several tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def _pieces(text: str, stop=()):
    detok = IncrementalDetokenizer(Bytes(), stop)
    pieces = [detok.add(b) for b in text.encode()]
    return pieces, detok.finish(), detok


def test_pieces_join_to_the_whole_text_and_never_split_a_character():
    pieces, last, detok = _pieces("h\u00e9llo w\u00f6rld")
    assert "".join(pieces) + last == "h\u00e9llo w\u00f6rld"
    assert not any("\ufffd" in p for p in pieces)
    assert not detok.stopped


def test_a_stop_string_ends_the_text_before_it_and_is_never_emitted():
    pieces, last, detok = _pieces("hello world, hello", stop=["wor"])
    assert "".join(pieces) + last == "hello "
    assert detok.stopped
    assert pieces[6:9] == ["", "", ""]  # "w", "o" held back, then "r" completes the stop string
    assert all(p == "" for p in pieces[9:])


def test_the_earliest_of_several_stop_strings_wins():
    pieces, last, _ = _pieces("abcdef", stop=["de", "bcd"])
    assert "".join(pieces) + last == "a"


def test_held_text_is_released_when_it_stops_matching():
    pieces, _, _ = _pieces("hello world", stop=["wx"])
    assert pieces[6] == "" and pieces[7] == "wo"


def test_the_end_of_the_request_releases_held_text():
    pieces, last, detok = _pieces("hello world", stop=["ld!"])
    assert "".join(pieces) == "hello wor" and last == "ld"
    assert detok.text == "hello world"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "a", "max_tokens": "3"}, "max_tokens"),
        ({"prompt": "a", "n": 0}, "n"),
        ({"prompt": "a", "stop": [1]}, "stop"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "a", "temperature": "hot"}, "temperature"),
        ({"prompt": "a", "stream": "yes"}, "stream"),
        ({"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_fields_are_refused_by_name(body, param):
    with pytest.raises(RequestError) as caught:
        parse_request(body, chat="messages" in body)
    assert caught.value.status == 400 and caught.value.param == param


def test_chat_limits_and_unknown_fields():
    parsed = parse_request(
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5, "frequency_penalty": 0.5},
        chat=True,
    )
    assert parsed.max_tokens == 5 and parsed.params(1, 5).seed is None
    assert parse_request({"prompt": "a", "seed": 3, "n": 2}, chat=False).params(1, 4).seed == 4
    with pytest.raises(RequestError):
        parse_request({"messages": []}, chat=True)
