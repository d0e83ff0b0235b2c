"""ChaCha20 (RFC 8439) as vectorised torch integer operations, on whichever device the
tensors live: the keystream of many 64-byte blocks at once, made where it is used.

The state of ``n`` blocks is a [16, n] int32 tensor (row i is word i of every block), so a
quarter round is a handful of elementwise operations on [4, n] rows: the four column
rounds at once, then, with rows b, c and d rotated by 1, 2 and 3 words, the four diagonal
rounds. torch has no uint32 arithmetic, so words are int32 bit patterns: addition and left
shift wrap modulo 2^32 as two's complement does, and the arithmetic right shift is masked
to a logical one. The output is bit-identical to RFC 8439's block function (and to the
``cryptography`` package, which the tests use as the reference).

The block counter is RFC 8439's 32 bits. A request that would run it past 2^32 - 1 is
refused: the RFC forbids it, and carrying into the nonce (what OpenSSL does) would reuse
the keystream of the message whose nonce is one higher.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK_WORDS = 16
KEY_BYTES = 32
NONCE_BYTES = 12
COUNTER_LIMIT = 2**32  # block counters 0 .. 2^32 - 1 (RFC 8439 section 2.4)
# "expand 32-byte k" as four little-endian words (RFC 8439 section 2.3).
CONSTANT_WORDS = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)
# Blocks per pass of `keystream_words`: bounds its working memory (48 int32 words per
# block: the state, its start and the rotated rows) to 48 MiB.
_CHUNK_BLOCKS = 2**18


def as_int32(word: int) -> int:
    """The int32 whose bit pattern is the unsigned 32-bit ``word``."""
    return word - 2**32 if word >= 2**31 else word


def words_from_bytes(data: bytes) -> list[int]:
    """Little-endian 32-bit words of ``data`` as int32 bit patterns."""
    return [as_int32(int.from_bytes(data[i : i + 4], "little")) for i in range(0, len(data), 4)]


def rotate_left(words: Tensor, bits: int, scratch: Tensor) -> None:
    """Rotate 32-bit ``words`` left by ``bits``, in place; ``scratch`` is of their shape."""
    torch.bitwise_left_shift(words, bits, out=scratch)
    # The arithmetic shift copies the sign bit: the mask keeps the ``bits`` that wrapped.
    words.bitwise_right_shift_(32 - bits).bitwise_and_((1 << bits) - 1).bitwise_or_(scratch)


def quarter_round(a: Tensor, b: Tensor, c: Tensor, d: Tensor, scratch: Tensor) -> None:
    """RFC 8439 section 2.1's quarter round on rows of words, in place."""
    a.add_(b)
    d.bitwise_xor_(a)
    rotate_left(d, 16, scratch)
    c.add_(d)
    b.bitwise_xor_(c)
    rotate_left(b, 12, scratch)
    a.add_(b)
    d.bitwise_xor_(a)
    rotate_left(d, 8, scratch)
    c.add_(d)
    b.bitwise_xor_(c)
    rotate_left(b, 7, scratch)


def rotate_rows(rows: Tensor, by: int, out: Tensor) -> None:
    """``out`` = [4, n] ``rows`` with row i + ``by`` (mod 4) in row i."""
    out[: 4 - by].copy_(rows[by:])
    out[4 - by :].copy_(rows[:by])


def double_round(state: Tensor, diagonal: Tensor, scratch: Tensor) -> None:
    """RFC 8439 section 2.3's column round then diagonal round on [16, n] ``state``, in
    place. The diagonal round is a column round with rows b, c and d rotated by 1, 2 and 3
    words (QUARTERROUND(0, 5, 10, 15) and so on) into ``diagonal`` ([12, n]) and back:
    slice copies, since index_select with out= is ~50 times slower on a CPU (measured)."""
    a, b, c, d = state.view(4, 4, -1).unbind(0)
    quarter_round(a, b, c, d, scratch)
    rotated = diagonal.view(3, 4, -1).unbind(0)
    for by, (rows, into) in enumerate(zip((b, c, d), rotated, strict=True), start=1):
        rotate_rows(rows, by, into)
    quarter_round(a, *rotated, scratch)
    for by, (rows, into) in enumerate(zip(rotated, (b, c, d), strict=True), start=1):
        rotate_rows(rows, 4 - by, into)


def check_counter_range(counter: int, n_blocks: int) -> None:
    """Refuse blocks outside ChaCha20's 32-bit block counter (see the module's note)."""
    if counter < 0 or counter + n_blocks > COUNTER_LIMIT:
        raise ValueError(
            f"blocks {counter} .. {counter + n_blocks - 1} are outside ChaCha20's 32-bit block "
            "counter: the keystream of one nonce ends at block 2^32 - 1 (RFC 8439); draw "
            "the rest under a new nonce"
        )


def initial_state(key_words: Tensor, nonce: bytes, counter: int, n_blocks: int) -> Tensor:
    """[16, n_blocks] int32: RFC 8439 section 2.3's input state of blocks ``counter``,
    ``counter + 1``, ... under ``key_words`` (8 int32 on the target device) and ``nonce``."""
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"a ChaCha20 nonce is {NONCE_BYTES} bytes, got {len(nonce)}")
    check_counter_range(counter, n_blocks)
    device = key_words.device
    state = torch.empty(BLOCK_WORDS, n_blocks, dtype=torch.int32, device=device)
    # Python scalars are kernel arguments: only the key crossed to the device, once.
    for row, word in enumerate(CONSTANT_WORDS):
        state[row].fill_(as_int32(word))
    state[4:12].copy_(key_words.view(8, 1).expand(8, n_blocks))
    # Counters as int64 then wrapped to int32 bit patterns (counter + i < 2^32).
    counters = torch.arange(counter, counter + n_blocks, dtype=torch.int64, device=device)
    state[12].copy_(torch.where(counters >= 2**31, counters - 2**32, counters))
    for row, word in enumerate(words_from_bytes(nonce), start=13):
        state[row].fill_(word)
    return state


def chacha20_block_words(key_words: Tensor, nonce: bytes, counter: int, n_blocks: int) -> Tensor:
    """[16, n_blocks] int32: the keystream words of ``n_blocks`` consecutive blocks from
    ``counter``, block i in column i (RFC 8439 section 2.3's block function)."""
    start = initial_state(key_words, nonce, counter, n_blocks)
    state = start.clone()
    diagonal = torch.empty(12, n_blocks, dtype=torch.int32, device=start.device)
    scratch = torch.empty(4, n_blocks, dtype=torch.int32, device=start.device)
    for _ in range(10):  # 20 rounds
        double_round(state, diagonal, scratch)
    return state.add_(start)


def key_words_on(key: bytes, device: torch.device) -> Tensor:
    """The 256-bit ``key`` as 8 int32 words on ``device`` (the one copy of the key there)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a ChaCha20 key is {KEY_BYTES} bytes, got {len(key)}")
    return torch.tensor(words_from_bytes(key), dtype=torch.int32, device=device)


def keystream_words(
    key_words: Tensor, nonce: bytes, n_words: int, counter: int = 0, out: Tensor | None = None
) -> Tensor:
    """The first ``n_words`` 32-bit words (int32 bit patterns, little-endian words of the
    byte stream) of the keystream from block ``counter`` on, on ``key_words``'s device;
    written into ``out`` (int32, ``n_words`` long) when given."""
    device = key_words.device
    if out is None:
        out = torch.empty(n_words, dtype=torch.int32, device=device)
    n_blocks = -(-n_words // BLOCK_WORDS)
    check_counter_range(counter, n_blocks)
    for first in range(0, n_blocks, _CHUNK_BLOCKS):
        blocks = min(_CHUNK_BLOCKS, n_blocks - first)
        words = chacha20_block_words(key_words, nonce, counter + first, blocks)
        begin = first * BLOCK_WORDS
        if begin + blocks * BLOCK_WORDS <= n_words:  # whole blocks: one strided copy
            out[begin : begin + blocks * BLOCK_WORDS].view(blocks, BLOCK_WORDS).copy_(words.t())
        else:
            out[begin:].copy_(words.t().reshape(-1)[: n_words - begin])
    return out
