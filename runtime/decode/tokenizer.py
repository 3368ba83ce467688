"""Byte-level tokenizer of the tiny demo model: ids 0..255 are bytes, then BOS and EOS.

No vocabulary file, no merges: any text round-trips. The model's vocab may be padded past 258
(e.g. to 264, a multiple of 8); the padding ids are never produced and decode to nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from draftgraph.runtime.errors import InputError, describe

NUM_BYTES = 256
BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 258  # the smallest vocab that holds every id; models may pad it


class ByteTokenizer:
    """UTF-8 bytes as token ids.

    Examples
    --------
    >>> tok = ByteTokenizer()
    >>> tok.encode("hi")
    [104, 105]
    >>> tok.decode([tok.bos_id, 104, 105, tok.eos_id])
    'hi'
    """

    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    vocab_size: int = VOCAB_SIZE

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """UTF-8 bytes of ``text``, optionally framed by BOS / EOS. A lone surrogate (bytes that were
        not UTF-8, decoded with ``surrogateescape``) raises InputError."""
        if not isinstance(text, str):
            raise InputError(describe("text", "a str", type(text).__name__, "decode bytes to str first"))
        bad = not_utf8(text)
        if bad is not None:
            raise InputError(describe("text", "encodable as UTF-8", bad, "pass text, not undecodable bytes"))
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, BOS_ID)
        if add_eos:
            ids.append(EOS_ID)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the byte ids; specials and padding ids are dropped, bad UTF-8 is replaced."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < NUM_BYTES)
        return data.decode("utf-8", errors="replace")


def not_utf8(text: str) -> str | None:
    """None for text that encodes as UTF-8, else its first offending character and where it is
    (a lone surrogate: argv or a file read with ``surrogateescape`` held bytes that were not UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"{ascii(text[e.start])} at character {e.start}"
    return None


def encode(text: str) -> list[int]:
    return ByteTokenizer().encode(text)


def decode(ids: Iterable[int]) -> str:
    return ByteTokenizer().decode(ids)


bos_id = BOS_ID
eos_id = EOS_ID
