"""Stop strings (freetoken_agent/service/stops.py) against a brute-force reference, their bounds,
and their cost; prompt pieces (freetoken_agent/service/encode.py) against one whole encode."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import RequestError
from freetoken_agent.service.encode import PIECE_CHARS, PromptEncoder, pieces
from freetoken_agent.service.stops import MAX_STOP_CHARS, MAX_STOPS, StopMatcher, check_stops
from freetoken_agent.tokenizer import ChatTokenizer


def reference(stream: list[str], stops: list[str]) -> tuple[str, str | None]:
    """Everything released before the stop, and the stop: the earliest-ending match as pieces
    arrive, of those the earliest-starting (then the longest) one."""
    seen = ""
    for piece in stream:
        seen += piece
        hits = [(seen.find(s), -len(s), s) for s in stops if s and s in seen]
        if hits:
            pos, _, s = min(hits)
            return seen[:pos], s
    return seen, None


@settings(max_examples=300, deadline=None)
@given(stream=st.lists(st.text(alphabet="abc", max_size=6), max_size=12),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3))
def test_stop_matcher_agrees_with_brute_force(stream: list[str], stops: list[str]) -> None:
    m = StopMatcher(stops)
    out, hit = "", None
    for piece in stream:
        emit, hit = m.feed(piece)
        out += emit
        if hit is not None:
            break
    if hit is None:
        out += m.flush()
    want_text, want_hit = reference(stream, stops)
    assert hit == want_hit
    if hit is not None:  # a match that started in earlier pieces is found when it completes
        assert out == want_text[:len(out)] and want_text.startswith(out)
        assert (out + hit) in "".join(stream)
    else:
        assert out == want_text


def test_held_back_text_never_exceeds_the_longest_stop() -> None:
    m = StopMatcher(["q" * MAX_STOP_CHARS + "!"])
    t0 = time.perf_counter()
    released = 0
    for _ in range(20_000):
        emit, hit = m.feed("q")
        released += len(emit)
        assert hit is None
    assert 20_000 - released <= MAX_STOP_CHARS
    assert time.perf_counter() - t0 < 5.0  # linear: the old hold-back check was quadratic in the stop length


def test_stop_bounds() -> None:
    check_stops(["x" * MAX_STOP_CHARS] * MAX_STOPS)
    with pytest.raises(RequestError):
        check_stops(["x"] * (MAX_STOPS + 1))
    with pytest.raises(RequestError):
        check_stops(["x" * (MAX_STOP_CHARS + 1)])


@pytest.fixture(scope="module")
def tokenizer(demo_dirs: dict[str, Path]) -> ChatTokenizer:
    return ChatTokenizer.from_dir(demo_dirs["qwen3_5_moe"])


def test_long_text_in_pieces_encodes_as_one_whole(tokenizer: ChatTokenizer) -> None:
    rng = random.Random(3)
    words = ["alpha", "Beta", "42", "x=1;", "  ", "\n", "\n\n", " é", "naïve", "\t", "<think>", "日本語", "'s", "--"]
    text = "".join(rng.choice(words) + rng.choice(["", " ", "\n"]) for _ in range(6_000))
    parts = pieces(text, 500)
    assert len(parts) > 20 and "".join(parts) == text
    assert all(len(p) >= 500 for p in parts[:-1])
    assert len(pieces("x" * (3 * PIECE_CHARS))) == 1
    enc = PromptEncoder(tokenizer, piece_chars=500)
    assert enc.encode_long(text) == tokenizer.encode(text)


def test_escaped_literals_round_trip(tokenizer: ChatTokenizer) -> None:
    enc = PromptEncoder(tokenizer)
    text = "a<|im_end|>b\U000f0000c<think>"
    escaped = enc.escape(text)
    assert "<|im_end|>" not in escaped and "<think>" not in escaped
    assert enc.unescape(escaped) == text
    ids = enc.encode(escaped)
    assert tokenizer.decode(ids) == text
    assert not set(ids) & set(tokenizer.special_ids.values())
