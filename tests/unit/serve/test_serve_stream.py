"""``RequestStream.subscribe``: every event reaches the callback exactly once and in order, the
ones put before subscribing and the ones put after, also while the engine's thread puts during
the subscription; a stream nobody subscribed to still iterates; one consumer per stream."""

import logging
import threading

import pytest

from shardwise.serve._api import RequestStream, TokenEvent

WAIT = 20  # seconds before a test fails instead of hanging


def _stream() -> RequestStream:
    return RequestStream("r", lambda request_id: None)


def test_events_before_during_and_after_subscribing_arrive_once_in_order():
    stream, got = _stream(), []
    halfway, subscribed = threading.Event(), threading.Event()

    def engine():
        for i in range(20000):
            stream.put(TokenEvent(i))
            if i == 1000:
                halfway.set()  # the rest races with subscribe()
        assert subscribed.wait(WAIT)
        for i in range(20000, 21000):
            stream.put(TokenEvent(i))
        stream.put(TokenEvent(None, True, "length"))

    thread = threading.Thread(target=engine)
    thread.start()
    assert halfway.wait(WAIT)
    stream.subscribe(lambda event: got.append((threading.get_ident(), event)))
    subscribed.set()
    thread.join(WAIT)
    assert [e.token_id for _, e in got] == [*range(21000), None]
    callers = {ident for ident, _ in got}
    assert callers >= {threading.get_ident(), thread.ident}  # delivered in both threads
    assert stream.finished


def test_a_stream_nobody_subscribed_to_still_iterates():
    stream = _stream()
    for i in range(3):
        stream.put(TokenEvent(i))
    stream.put(TokenEvent(None, True, "stop"))
    assert [e.token_id for e in stream.events(timeout=WAIT)] == [0, 1, 2, None]
    assert stream.finished


def test_one_consumer_per_stream():
    stream = _stream()
    stream.subscribe(lambda event: None)
    with pytest.raises(RuntimeError, match="already has a subscriber"):
        stream.subscribe(lambda event: None)
    with pytest.raises(RuntimeError, match="a subscriber takes"):
        next(stream.events())


def test_a_failing_subscriber_does_not_fail_the_engine(caplog):
    stream, got = _stream(), []

    def fussy(event):
        got.append(event.token_id)
        if event.token_id == 1:
            raise ValueError("no")

    stream.subscribe(fussy)
    with caplog.at_level(logging.ERROR, logger="shardwise.serve"):
        for i in range(3):
            stream.put(TokenEvent(i))
        stream.put(TokenEvent(None, True, "length"))
        stream.put(TokenEvent(7))  # after the end: nobody is called
    assert got == [0, 1, 2, None] and stream.finished
    assert "subscriber failed" in caplog.text
