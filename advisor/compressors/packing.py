"""Bit packing of small unsigned integers into bytes, and lane packing for summable payloads.

Written here (no library packs arbitrary 1..8-bit codes for torch tensors): eight b-bit
codes are combined into one 64-bit word with shifts, and the word's low ``b`` bytes are
kept, so every width 1..8 uses the same vectorised path and costs a few tensor passes.
"""

from __future__ import annotations

import torch

_SHIFTS_CACHE: dict[tuple[int, torch.device], torch.Tensor] = {}


def _shifts(bits: int, lanes: int, device: torch.device) -> torch.Tensor:
    key = (bits * 100 + lanes, device)
    if key not in _SHIFTS_CACHE:
        _SHIFTS_CACHE[key] = torch.arange(lanes, dtype=torch.int64, device=device) * bits
    return _SHIFTS_CACHE[key]


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that :func:`pack_bits` produces for ``numel`` codes of ``bits`` bits."""
    if bits == 8:
        return numel
    if _byte_aligned(bits):
        per_byte = 8 // bits
        return (numel + per_byte - 1) // per_byte
    groups = (numel + 7) // 8
    return groups * bits


def _byte_aligned(bits: int) -> bool:
    """Widths that divide a byte pack within uint8 arithmetic (no int64 detour)."""
    return bits in (1, 2, 4)


def pack_bits(codes: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack unsigned ``codes`` (< 2**bits) into a flat uint8 tensor of packed_nbytes bytes."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    numel = codes.numel()
    nbytes = packed_nbytes(numel, bits)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=codes.device)
    if bits == 8:
        out.copy_(codes.reshape(-1))
        return out
    if _byte_aligned(bits):
        per_byte = 8 // bits
        flat = codes.reshape(-1).to(torch.uint8)
        padded_len = nbytes * per_byte
        if padded_len != numel:
            flat = torch.nn.functional.pad(flat, (0, padded_len - numel))
        shifted = flat.view(nbytes, per_byte) << _shifts(bits, per_byte, codes.device).to(torch.uint8)
        torch.sum(shifted, dim=1, dtype=torch.uint8, out=out)
        return out
    groups = (numel + 7) // 8
    padded = codes.reshape(-1).to(torch.int64)
    if groups * 8 != numel:
        padded = torch.nn.functional.pad(padded, (0, groups * 8 - numel))
    words = (padded.view(groups, 8) << _shifts(bits, 8, codes.device)).sum(dim=1)
    out.view(groups, bits).copy_(words.view(torch.uint8).view(groups, 8)[:, :bits])
    return out


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`; returns integer codes (uint8 or int64).

    ``packed`` may be 2-D ``(rows, nbytes)`` (one row a rank, as all-gather delivers it);
    the result is then ``(rows, numel)``.
    """
    rows = packed.shape[0] if packed.dim() == 2 else None
    flat = packed.reshape(-1 if rows is None else rows, packed.shape[-1])
    if bits == 8:
        codes = flat[..., :numel].to(torch.int64)
        return codes if rows is not None else codes.reshape(-1)
    r = flat.shape[0]
    if _byte_aligned(bits):
        # uint8 codes: callers convert to float directly, a quarter of int64's traffic
        per_byte = 8 // bits
        nbytes = packed_nbytes(numel, bits)
        shifts = _shifts(bits, per_byte, packed.device).to(torch.uint8)
        codes = (flat[:, :nbytes].unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        codes = codes.view(r, nbytes * per_byte)[:, :numel]
        return codes if rows is not None else codes.reshape(-1)
    groups = (numel + 7) // 8
    words = torch.zeros(r, groups, 8, dtype=torch.uint8, device=packed.device)
    words[:, :, :bits] = flat[:, : groups * bits].view(r, groups, bits)
    words64 = words.view(r, groups * 8).view(torch.int64).view(r, groups, 1)
    codes = (words64 >> _shifts(bits, 8, packed.device)) & ((1 << bits) - 1)
    codes = codes.view(r, groups * 8)[:, :numel]
    return codes if rows is not None else codes.reshape(-1)


def lanes_per_word(lane_bits: int) -> int:
    """Lanes of ``lane_bits`` that fit in a signed 64-bit word without touching the sign."""
    return max(1, 63 // lane_bits)


def pack_lanes(codes: torch.Tensor, lane_bits: int, out: torch.Tensor) -> torch.Tensor:
    """Pack non-negative int64 codes into int64 words, ``lanes_per_word`` codes a word.

    Summing such words across ranks sums every lane independently as long as no lane
    overflows: the caller reserves headroom bits for the number of ranks.  ``codes`` is
    used as scratch (shifted in place) when it holds exactly ``out.numel()`` words of lanes.

    Lane-major: with ``W`` words, word ``w`` holds codes ``w, w + W, w + 2W, ...``, so the
    shift and the sum run over whole contiguous rows of ``W`` codes; the interleaved layout
    (codes ``7w .. 7w + 6`` in word ``w``) makes torch reduce 7-element rows, which is slower
    (benchmarks/kernel_choices.py).
    """
    lanes = lanes_per_word(lane_bits)
    words = out.numel()
    flat = codes.reshape(-1)
    if flat.numel() != words * lanes:
        flat = torch.nn.functional.pad(flat, (0, words * lanes - flat.numel()))
    grid = flat.view(lanes, words)
    grid.bitwise_left_shift_(_shifts(lane_bits, lanes, codes.device).view(lanes, 1))
    torch.sum(grid, dim=0, out=out)
    return out


def unpack_lanes(words: torch.Tensor, lane_bits: int, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_lanes`: the first ``numel`` lanes as int64.

    ``out``, if given, must hold ``words.numel() * lanes_per_word`` int64 values.
    """
    lanes = lanes_per_word(lane_bits)
    shifts = _shifts(lane_bits, lanes, words.device)
    if out is None:
        out = torch.empty(words.numel() * lanes, dtype=torch.int64, device=words.device)
    grid = out.view(lanes, words.numel())  # lane-major, as pack_lanes lays them out
    torch.bitwise_right_shift(words.view(1, -1), shifts.view(lanes, 1), out=grid)
    grid.bitwise_and_((1 << lane_bits) - 1)
    return out[:numel]


def lane_words(numel: int, lane_bits: int) -> int:
    lanes = lanes_per_word(lane_bits)
    return (numel + lanes - 1) // lanes
