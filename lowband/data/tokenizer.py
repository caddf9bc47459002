"""Byte-level tokenizer: UTF-8 bytes are ids 0-255, BOS = 256, EOS = 257, vocab padded to 320.

No files, no dependency, lossless: ``decode(encode(s)) == s`` for every ``str``, including lone
surrogates (encoded with ``surrogatepass``). Decoding arbitrary ids skips the special ids (>= 256)
and replaces invalid UTF-8 with U+FFFD.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

import numpy as np
import torch

_ERRORS = "lowband.surrogatepass_replace"


def _surrogatepass_replace(exc: UnicodeError) -> tuple[str, int]:
    """Decode error handler: keep encoded surrogates (as ``surrogatepass``), replace anything else."""
    try:
        return codecs.lookup_error("surrogatepass")(exc)
    except UnicodeError:
        return codecs.lookup_error("replace")(exc)


codecs.register_error(_ERRORS, _surrogatepass_replace)


class ByteTokenizer:
    """UTF-8 byte tokenizer with BOS/EOS specials.

    Attributes:
        BOS: id 256, put before every document.
        EOS: id 257 (optional end marker).
        vocab_size: 320 (258 used ids padded to a multiple of 64).
    """

    BOS: int = 256
    EOS: int = 257
    n_bytes: int = 256
    vocab_size: int = 320

    @property
    def bos_id(self) -> int:
        return self.BOS

    @property
    def eos_id(self) -> int:
        return self.EOS

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Token ids of ``text``: ``[BOS] + utf8 bytes (+ [EOS])``.

        Args:
            text: any Python string (lone surrogates included).
            bos: prepend BOS.
            eos: append EOS.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = list(text.encode("utf-8", "surrogatepass"))
        if bos:
            ids.insert(0, self.BOS)
        if eos:
            ids.append(self.EOS)
        return ids

    def decode(self, ids: Iterable[int] | np.ndarray | torch.Tensor) -> str:
        """Text of ``ids``; special ids (256..vocab_size-1) are skipped, invalid UTF-8 becomes U+FFFD.

        Raises:
            ValueError: an id is negative or >= vocab_size.
        """
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().reshape(-1).tolist()
        elif isinstance(ids, np.ndarray):
            ids = ids.reshape(-1).tolist()
        out = bytearray()
        for i in ids:
            i = int(i)
            if i < 0 or i >= self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            if i < self.n_bytes:
                out.append(i)
        return out.decode("utf-8", _ERRORS)
