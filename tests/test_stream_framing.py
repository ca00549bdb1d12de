"""A chunked HTTP/1.1 body's framing undone as its bytes arrive (models/_http1.py's ``Unchunker``, which both
the stream pump and the httpx path's ``chunked_body`` use): however the bytes are cut, the body is the same, the
end is seen with whatever came after it, and broken framing is refused in one line."""

from __future__ import annotations

import random

import pytest

from agentnb.models._http1 import BodyBroken, Unchunker

BODY = "data: {\"é\": 1}\n\n".encode() * 7 + b"x" * 300


def _framed(body: bytes, size: int, *, trailer: bytes = b"x-trailer: 1\r\n") -> bytes:
    parts = [b"%x;ext=1\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size]) for i in range(0, len(body), size)]
    return b"".join(parts) + b"0\r\n" + trailer + b"\r\n"


def _feed(pieces: list[bytes], owed: int = 0) -> tuple[bytes, Unchunker]:
    u = Unchunker(owed)
    out = b""
    for p in pieces:
        assert not u.ended
        out += u.feed(p)
        if u.ended:
            break
    return out, u


@pytest.mark.parametrize("size", [1, 7, 4096])
def test_the_body_is_the_same_however_the_bytes_are_cut(size: int) -> None:
    framed = _framed(BODY, size)
    body, u = _feed([framed])
    assert body == BODY and u.ended and u.extra == b""
    for cut in range(1, len(framed), max(1, len(framed) // 97)):
        body, u = _feed([framed[:cut], framed[cut:]])
        assert body == BODY and u.ended and u.extra == b"", cut
    body, u = _feed([bytes([b]) for b in framed])  # a byte at a time
    assert body == BODY and u.ended
    rng = random.Random(7)
    pieces, i = [], 0
    while i < len(framed):
        n = rng.randint(1, 40)
        pieces.append(framed[i:i + n])
        i += n
    assert _feed(pieces)[0] == BODY


def test_the_end_is_seen_with_what_came_after_it() -> None:
    body, u = _feed([_framed(b"abc", 2, trailer=b"") + b"HTTP/1.1 200 OK\r\n"])
    assert body == b"abc" and u.ended and u.extra == b"HTTP/1.1 200 OK\r\n"
    # a body taken over after a chunk's data, before its CRLF
    body, u = _feed([b"\n3\r\nxyz\r\n0\r\n\r\n"], owed=1)
    assert body == b"xyz" and u.ended and u.extra == b""


@pytest.mark.parametrize(("framed", "why"), [
    (b"zz\r\nab\r\n", "a chunk-size line b'zz'"),
    (b"-2\r\nab\r\n", "a chunk-size line b'-2'"),
    (b"2\r\nabXY", "no CRLF after a chunk"),
    (b"f" * 5000, "a chunk-size line too long"),
])
def test_broken_framing_is_refused_in_one_line(framed: bytes, why: str) -> None:
    for pieces in ([framed[:3], framed[3:]], [framed]):  # cut, or whole (a whole chunk is taken in one turn)
        with pytest.raises(BodyBroken) as caught:
            _feed(pieces)
        assert why in str(caught.value) and "\n" not in str(caught.value)
