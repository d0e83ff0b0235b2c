"""ChaCha20 in torch operations (dpivon.privacy.chacha): bit-identical to RFC 8439's test
vectors and to the ``cryptography`` package (OpenSSL) for random keys, nonces and block
counters, up to the end of the 32-bit counter, on the CPU and on CUDA where present."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from dpivon.privacy import chacha
from dpivon.privacy.chacha import chacha20_block_words, key_words_on, keystream_words

CPU = torch.device("cpu")
RFC_KEY = bytes(range(32))  # 00:01:02:...:1f, RFC 8439 sections 2.3.2 and 2.4.2
CUDA = pytest.param(
    torch.device("cuda"),
    marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
)


def reference_words(key: bytes, nonce: bytes, counter: int, n_words: int) -> np.ndarray:
    """``cryptography``'s keystream as uint32 words: its 16-byte nonce is the 4-byte
    little-endian block counter followed by RFC 8439's 12-byte nonce."""
    iv = counter.to_bytes(4, "little") + nonce
    encryptor = Cipher(algorithms.ChaCha20(key, iv), mode=None).encryptor()
    return np.frombuffer(encryptor.update(bytes(4 * n_words)), dtype="<u4")


def ours(key: bytes, nonce: bytes, counter: int, n_words: int, device=CPU) -> np.ndarray:
    words = keystream_words(key_words_on(key, device), nonce, n_words, counter)
    return words.cpu().numpy().view(np.uint32)


def test_the_block_function_matches_rfc_8439_section_2_3_2():
    nonce = bytes.fromhex("000000090000004a00000000")
    block = chacha20_block_words(key_words_on(RFC_KEY, CPU), nonce, 1, 1)
    expected = bytes.fromhex(
        "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
        "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e"
    )
    assert block[:, 0].numpy().astype("<i4").tobytes() == expected


def test_the_keystream_encrypts_rfc_8439_section_2_4_2():
    nonce = bytes.fromhex("000000000000004a00000000")
    plaintext = (
        b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip for "
        b"the future, sunscreen would be it."
    )
    words = -(-len(plaintext) // 4)
    stream = ours(RFC_KEY, nonce, 1, words).astype("<u4").tobytes()[: len(plaintext)]
    ciphertext = bytes(p ^ k for p, k in zip(plaintext, stream, strict=True))
    assert ciphertext == bytes.fromhex(
        "6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0b"
        "f91b65c5524733ab8f593dabcd62b3571639d624e65152ab8f530c359f0861d8"
        "07ca0dbf500d6a6156a38e088a22b65e52bc514d16ccf806818ce91ab7793736"
        "5af90bbf74a35be6b40b8eedf2785e42874d"
    )


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_random_keys_nonces_and_counters_match_cryptography(device):
    draw = random.Random(28)
    for n_words in (1, 15, 16, 17, 1000, 16 * 300 + 7):
        key, nonce = os.urandom(32), os.urandom(12)
        counter = draw.randrange(2**32 - 400)
        expected = reference_words(key, nonce, counter, n_words)
        np.testing.assert_array_equal(ours(key, nonce, counter, n_words, device), expected)


def test_a_keystream_made_in_several_passes_is_the_same(monkeypatch):
    monkeypatch.setattr(chacha, "_CHUNK_BLOCKS", 3)  # 7 passes, the last one partial
    key, nonce = os.urandom(32), os.urandom(12)
    expected = reference_words(key, nonce, 5, 16 * 20 + 9)
    np.testing.assert_array_equal(ours(key, nonce, 5, 16 * 20 + 9), expected)


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_the_counter_runs_to_its_last_block_and_crosses_the_sign_bit(device):
    """Block counters up to 2^32 - 1 (and across 2^31, where the int32 pattern turns
    negative) are RFC 8439's and OpenSSL's alike."""
    key, nonce = os.urandom(32), os.urandom(12)
    for counter in (2**31 - 2, 2**32 - 4):
        expected = reference_words(key, nonce, counter, 16 * 4)
        np.testing.assert_array_equal(ours(key, nonce, counter, 16 * 4, device), expected)


def test_a_keystream_past_the_32_bit_counter_is_refused():
    """OpenSSL carries into the nonce after block 2^32 - 1; for one nonce the RFC's
    keystream ends there, and carrying would reuse the keystream of the next nonce (the
    next draw of dpivon.privacy.noise), so it is an error."""
    key_words = key_words_on(os.urandom(32), CPU)
    with pytest.raises(ValueError, match="32-bit block counter"):
        keystream_words(key_words, bytes(12), 16 * 5, counter=2**32 - 4)
    with pytest.raises(ValueError, match="32-bit block counter"):
        chacha20_block_words(key_words, bytes(12), 2**32, 1)
    with pytest.raises(ValueError, match="nonce is 12 bytes"):
        keystream_words(key_words, bytes(16), 16)
    with pytest.raises(ValueError, match="key is 32 bytes"):
        key_words_on(bytes(16), CPU)
