"""Prompt-lookup (n-gram) proposals, on the host in NumPy: the tokens that followed the latest earlier occurrence
of the sequence's last n tokens, for the longest n in ``[min_n, max_n]`` that occurs."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` proposed continuations of ``tokens`` (i32[L], prompt + output so far); [] if no match.

    The match must end before the last token (the suffix itself is not a match); the latest match wins, and the
    proposal is what followed it, cut at the end of the known tokens.
    """
    size = tokens.shape[0]
    if k <= 0 or size < min_n + 1:
        return []
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        windows = sliding_window_view(tokens[: size - 1], n)  # windows ending before the last token
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
