"""The server's text path without an engine: incremental detokenization, stop strings, bodies."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_jax.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from dspark_jax.server.text import IncrementalDetokenizer, StopStrings
from dspark_jax.testing import tiny_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.getbasetemp() / "tok_cache")


@settings(max_examples=40, deadline=None)
@given(
    text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=40),
)
def test_incremental_detokenization_equals_full_decode(tok, text, chunks):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    det = IncrementalDetokenizer(tok)
    out, i, k = [], 0, 0
    while i < len(ids):
        n = chunks[k % len(chunks)]
        piece = det.add(ids[i : i + n])
        assert "\ufffd" not in piece or "\ufffd" in text  # never a split character mid-stream
        out.append(piece)
        i, k = i + n, k + 1
    out.append(det.flush())
    assert "".join(out) == tok.decode(ids, skip_special_tokens=True) == text


def test_incremental_detokenizer_skips_special_tokens(tok):
    ids = tok("ab<|im_end|>cd", add_special_tokens=False)["input_ids"]
    det = IncrementalDetokenizer(tok)
    assert "".join(det.add([i]) for i in ids) + det.flush() == "abcd"


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet="abcx", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=3), max_size=3),
    cuts=st.lists(st.integers(1, 5), min_size=1, max_size=10),
)
def test_stop_strings_streamed_equal_one_shot(text, stops, cuts):
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    want = text if first < 0 else text[:first]
    ss = StopStrings(stops)
    out, i, k, hit = [], 0, 0, False
    while i < len(text) and not hit:
        piece, hit = ss.push(text[i : i + cuts[k % len(cuts)]])
        out.append(piece)
        i, k = i + cuts[k % len(cuts)], k + 1
    out.append(ss.flush())
    assert "".join(out) == want
    assert hit == (first >= 0)


def test_stop_strings_hold_back_only_possible_prefixes():
    ss = StopStrings(["END"])
    assert ss.push("hello E") == ("hello ", False)
    assert ss.push("x") == ("Ex", False)
    assert ss.push("EN") == ("", False)
    assert ss.push("D tail") == ("", True)


@pytest.mark.parametrize(
    "body, field",
    [
        (b"{not json", "malformed JSON"),
        (b"[1, 2]", "JSON object"),
        (b"", "empty"),
        (b'{"prompt": "x", "temperature": "hot"}', "temperature"),
        (b'{"prompt": "x", "temperature": -1}', "temperature"),
        (b'{"prompt": "x", "top_p": 0}', "top_p"),
        (b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
        (b'{"prompt": "x", "stream": 1}', "stream"),
        (b'{"prompt": "x", "n": 2}', "n=2"),
        (b'{"prompt": "x", "seed": -3}', "seed"),
        (b'{"prompt": ["a", "b"]}', "one prompt"),
        (b'{"prompt": "x", "stop": [""]}', "non-empty"),
        (b'{"max_tokens": 3}', "prompt"),
        (b'{"prompt": "x", "stream_options": {"include_usage": true}}', "stream=true"),
    ],
)
def test_invalid_completion_bodies_name_the_problem(body, field):
    with pytest.raises(APIError) as e:
        parse_body(CompletionRequest, body)
    assert e.value.status == 400 and field in e.value.message


def test_valid_bodies_and_extensions():
    r = parse_body(
        CompletionRequest,
        b'{"prompt": [5, 6], "stop": ["\\n", 7], "stop_token_ids": [9], "top_k": -1, "x": {}}',
    )
    assert r.single_prompt() == [5, 6]
    assert r.stop_strings() == ["\n"] and r.extra_stop_ids() == [9, 7]
    c = parse_body(
        ChatCompletionRequest,
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],'
        b' "max_completion_tokens": 5}',
    )
    assert c.template_messages() == [{"role": "user", "content": "hi"}] and c.max_tokens == 5
    with pytest.raises(APIError, match="messages"):
        parse_body(ChatCompletionRequest, b'{"messages": []}')
    with pytest.raises(APIError, match="role"):
        parse_body(ChatCompletionRequest, b'{"messages": [{"role": "robot", "content": "x"}]}')
