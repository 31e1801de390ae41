"""Bit-exact packing of D4 / E8 lattice points into bytes: (N, blocks, block_dim) points <-> (N, code_bytes) uint8.

Points arrive as `twice` = 2 * point (int64), so E8's half-integer coset stays integral.
They are the closest-lattice-point output *before* kakeyalattice's clamp to [-Q, Q]: that
keeps the lattice parity (D4/D8 coordinate sums are even) which is worth one bit per block,
and the decoder re-applies the same clamp. The pre-clamp point can lie one step outside the
box (the parity flip, E8's half shift), so the digit ranges below are that much wider.

Per block the point becomes mixed-radix digits (least significant first):

    [coset bit (E8 only)], u_0 .. u_{b-2}  in [0, W),  u_{b-1} >> 1  in [0, Q + 2)

    u = (twice + 2Q + 2 + coset) / 2,   W = 2Q + 3 (D4) or 2Q + 4 (E8)

u_{b-1}'s parity is implied because sum(u) is even for every D4 / E8 point. Digits are
grouped so each group's code stays below 2^62 (one group per block up to Q ~ 115 for E8); every group takes ceil(log2(product of its
radices)) bits, LSB first, concatenated block after block into one little-endian bitstream
per vector, zero-padded to a whole byte. At Q = 38 a block is one group of 25 bits (D4) or
51 bits (E8): the lattice bits kakeyalattice's own accounting states, as at Q = 19, 76, 152.
Below Q ~ 19 the wider box costs 1-8 bits per block over that accounting, which counts only
unclamped points although the codec's clamp emits others.
"""
from __future__ import annotations

import math
import sys

import torch

_MAX_GROUP_CODES = 1 << 62  # a group's code and its running product stay inside int64
_UNPACK_CHUNK = 16384  # blocks decoded per pass: E8's (n_digits + 1) x 16384 float64 temporaries are 1.3 MiB


class LatticeCodePacker:
    """Packs lattice points of one head_dim / lattice / q_range into fixed-width byte rows."""

    def __init__(self, head_dim: int, block_dim: int, q_range: int, half_integer_coset: bool,
                 device: str | torch.device = "cpu"):
        if head_dim % block_dim:
            raise ValueError(f"head_dim {head_dim} is not a multiple of the lattice block size {block_dim}")
        self.block_dim = block_dim
        self.blocks = head_dim // block_dim
        self.q_range = q_range
        self.half_integer_coset = half_integer_coset
        wide = 2 * q_range + 3 + int(half_integer_coset)
        self.radices = ([2] if half_integer_coset else []) + [wide] * (block_dim - 1) + [q_range + 2]
        self.groups = _split_into_int64_groups(self.radices)  # [(first digit, end digit)]
        self.group_bits = [(math.prod(self.radices[a:b]) - 1).bit_length() for a, b in self.groups]
        self.bits_per_block = sum(self.group_bits)
        self.bits_per_vector = self.blocks * self.bits_per_block
        self.code_bytes = -(-self.bits_per_vector // 8)
        self._pieces = _BitPieces(self.blocks, self.group_bits, torch.device(device))
        # Place value of every digit inside its group (mixed radix, least significant first): a
        # group's code is sum(digit * place). Decoding takes q_i = code // place_i for the group's
        # places and its total, then digit_i = q_i - radix_i * q_{i+1}: one division pass instead of
        # a Python loop of divisions, in the cheapest exact dtype for the group's codes
        # (`_division_dtype`).
        dev = torch.device(device)
        self._narrow = all(math.prod(self.radices[a:b]) < 1 << 31 for a, b in self.groups)
        self._place, self._decode_place, self._decode_radix = [], [], []
        for a, b in self.groups:
            places = [math.prod(self.radices[a:i]) for i in range(a, b + 1)]
            self._place.append(torch.tensor(places[:-1], dtype=torch.int64, device=dev))
            if not self._narrow:  # narrow codes decode with the int32 digit loop
                dtype = _division_dtype(places[-1])
                self._decode_place.append(torch.tensor(places, dtype=dtype, device=dev)[:, None])
                self._decode_radix.append(torch.tensor(self.radices[a:b], dtype=dtype, device=dev)[:, None])

    def pack(self, twice: torch.Tensor) -> torch.Tensor:
        """(N, blocks, block_dim) int64 twice-coordinates -> (N, code_bytes) uint8.

        Raises RuntimeError for a point outside the packable set (see `pack_flagged`)."""
        packed, invalid = self.pack_flagged(twice)
        if bool(invalid):
            raise self.invalid_error()
        return packed

    def pack_flagged(self, twice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed bytes, 0-d bool tensor: some point is outside what this layout holds), without a
        host sync: for a caller that folds the flag into a check of its own before it keeps the
        bytes (the bytes of an invalid point are meaningless). The flag holds for every point the
        D4 / E8 nearest-point step returns with the q_range cap of KakeyaLatticeCodec; a
        raised one is a codec change we must not store silently."""
        coset = twice[..., :1] & 1
        u = (twice + 2 * self.q_range + 2 + coset) >> 1
        invalid = ((u < 0) | (u >= self.radices[-2])).any()  # every digit in its range
        invalid = invalid | ((twice - coset) & 1).any()  # every coordinate in its block's coset
        invalid = invalid | (u.sum(-1) & 1).any()  # the parity the last digit leaves out
        if not self.half_integer_coset:
            invalid = invalid | coset.any()
        parts = ([coset] if self.half_integer_coset else []) + [u[..., :-1], u[..., -1:] >> 1]
        digits = torch.cat(parts, dim=-1)  # (N, blocks, n_digits), the last one halved
        codes = [(digits[..., a:b] * place).sum(-1) for (a, b), place in zip(self.groups, self._place)]
        fields = (codes[0] if len(codes) == 1 else torch.stack(codes, dim=-1)).reshape(twice.shape[0], -1)
        return self._pieces.write(fields, self.code_bytes), invalid

    def invalid_error(self) -> RuntimeError:
        return RuntimeError(
            f"lattice point outside the packable set (q_range={self.q_range}, block_dim={self.block_dim}); "
            "the kakeyalattice nearest-point step no longer matches this layout"
        )

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(N, code_bytes) uint8 -> (N, blocks, block_dim) int64 twice-coordinates."""
        n = packed.shape[0]
        fields = self._pieces.read(packed).reshape(n, self.blocks, len(self.groups))
        digits = torch.empty(n, self.blocks, len(self.radices), dtype=torch.int64, device=packed.device)
        for g, (a, b) in enumerate(self.groups):
            code = fields[..., g]
            for i in range(a, b - 1):
                quotient = code // self.radices[i]
                digits[..., i] = code - quotient * self.radices[i]
                code = quotient
            digits[..., b - 1] = code
        u = digits[..., 1:] if self.half_integer_coset else digits  # (N, blocks, block_dim)
        u[..., -1] = 2 * u[..., -1] + (u[..., :-1].sum(-1) & 1)  # un-halve; sum(u) is even
        twice = 2 * u - (2 * self.q_range + 2)
        return twice - digits[..., :1] if self.half_integer_coset else twice

    def unpack_points(self, packed: torch.Tensor) -> torch.Tensor:
        """(N, code_bytes) uint8 -> (N, blocks, block_dim) float32 points (twice / 2, before any clamp).

        Same values as unpack(packed) / 2: the decode hot path of a cache, in a few tensor ops
        per pass whatever the block size. Codes that fit in int32 (D4 up to q 126) are split digit
        by digit in int32; wider ones (E8) are divided by all place values at once in float64,
        digit-major, in column chunks whose temporaries stay in cache: on the CPU each is the
        faster of the two for its width (scripts/bench_kv_compressor.py)."""
        n = packed.shape[0]
        fields = self._pieces.read(packed).reshape(n * self.blocks, len(self.groups))
        if self._narrow:
            return self._points_int32(fields).reshape(n, self.blocks, self.block_dim)
        fields = fields.T  # (groups, N * blocks)
        out = torch.empty(n * self.blocks, self.block_dim, dtype=torch.float32, device=packed.device)
        for c in range(0, n * self.blocks, _UNPACK_CHUNK):
            out[c : c + _UNPACK_CHUNK] = self._points_digit_major(fields[:, c : c + _UNPACK_CHUNK]).T
        return out.reshape(n, self.blocks, self.block_dim)

    def _points_int32(self, fields: torch.Tensor) -> torch.Tensor:
        """(M, groups) codes below 2^31 -> (M, block_dim) float32 points."""
        digits = []
        for g, (a, b) in enumerate(self.groups):
            code = fields[:, g].to(torch.int32)
            for r in self.radices[a : b - 1]:
                quotient = torch.div(code, r, rounding_mode="floor")
                digits.append(code - quotient * r)
                code = quotient
            digits.append(code)
        coset = digits.pop(0) if self.half_integer_coset else None
        parity = digits[0]
        for d in digits[1:-1]:
            parity = parity + d
        digits[-1] = 2 * digits[-1] + (parity & 1)  # un-halve; sum(u) is even
        u = torch.stack(digits, dim=-1).to(torch.float32)
        if coset is None:
            return u - float(self.q_range + 1)
        return u - (float(self.q_range + 1) + 0.5 * coset.unsqueeze(-1).to(torch.float32))

    def _points_digit_major(self, fields: torch.Tensor) -> torch.Tensor:
        """(groups, m) codes -> (block_dim, m) float32 points."""
        parts = []
        for g, (place, radix) in enumerate(zip(self._decode_place, self._decode_radix)):
            code = fields[g : g + 1].to(place.dtype)
            q = torch.floor(code / place) if place.is_floating_point() else torch.div(code, place, rounding_mode="floor")
            parts.append(q[:-1] - q[1:] * radix)  # (n_g, m)
        digits = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(torch.float32)  # small ints: exact
        u = digits[1:] if self.half_integer_coset else digits  # (block_dim, m), last digit halved
        u[-1].mul_(2).add_(torch.remainder(u[:-1].sum(0), 2))  # un-halve; sum(u) is even
        offset = float(self.q_range + 1)
        return u - offset if not self.half_integer_coset else u - (offset + 0.5 * digits[0])

def _division_dtype(codes: int) -> torch.dtype:
    """Cheapest dtype that divides integers below `codes` exactly: the floor of a correctly rounded
    quotient of two integers below 2^24 (float32) or 2^53 (float64) is the integer quotient, and
    float division vectorizes where integer division does not (measured: scripts/bench_kv_compressor.py)."""
    if codes <= 1 << 24:
        return torch.float32
    return torch.float64 if codes <= 1 << 53 else torch.int64


def _split_into_int64_groups(radices: list[int]) -> list[tuple[int, int]]:
    groups, start, product = [], 0, 1
    for i, r in enumerate(radices):
        if product * r > _MAX_GROUP_CODES:
            groups.append((start, i))
            start, product = i, 1
        product *= r
    groups.append((start, len(radices)))
    return groups


class _BitPieces:
    """Moves fixed-width int64 fields to and from a little-endian bitstream, a byte window at a time.

    Each field is cut into pieces of at most 32 bits; a piece starting at bit `shift` of byte
    `byte` then lies inside the 5 bytes from `byte`, so one gather (read) or one index_add
    (write) per piece replaces per-bit work. Pieces never overlap, so adding bytes is OR-ing.
    """

    SPAN = 5

    def __init__(self, blocks: int, group_bits: list[int], device: torch.device):
        field, low, width, start = [], [], [], []
        offset = 0
        for f in range(blocks * len(group_bits)):
            bits = group_bits[f % len(group_bits)]
            for lo in range(0, bits, 32):
                field.append(f)
                low.append(lo)
                width.append(min(32, bits - lo))
                start.append(offset + lo)
            offset += bits
        self.n_fields = blocks * len(group_bits)
        self.one_piece_per_field = len(field) == self.n_fields
        self.field = torch.tensor(field, device=device)
        self.low = torch.tensor(low, device=device)
        self.mask = (1 << torch.tensor(width, device=device)) - 1
        starts = torch.tensor(start, device=device)
        self.shift = starts % 8
        self.byte_index = (starts // 8).unsqueeze(-1) + torch.arange(self.SPAN, device=device)  # (P, SPAN)
        self.byte_shift = 8 * torch.arange(self.SPAN, device=device)
        # Reads take each whole field from the little-endian 64-bit word holding its first bit
        # and the next word: two gathers per row instead of SPAN byte gathers per piece.
        # Fields are < 2^62, so one field spans at most two words.
        field_start, field_bits, offset = [], [], 0
        for f in range(self.n_fields):
            field_start.append(offset)
            field_bits.append(group_bits[f % len(group_bits)])
            offset += field_bits[-1]
        self.total_bits = offset
        fs = torch.tensor(field_start, device=device)
        self.word = fs // 64
        sh = fs % 64
        self.lo_shift = sh
        self.lo_mask = torch.where(sh == 0, torch.full_like(sh, -1), (1 << (64 - sh).clamp(max=63)) - 1)
        self.hi_shift = torch.where(sh == 0, torch.zeros_like(sh), 64 - sh)
        self.hi_keep = torch.where(sh == 0, torch.zeros_like(sh), torch.full_like(sh, -1))
        self.field_mask = (1 << torch.tensor(field_bits, device=device)) - 1

    def write(self, fields: torch.Tensor, n_bytes: int) -> torch.Tensor:
        """(N, n_fields) int64 -> (N, n_bytes) uint8."""
        n = fields.shape[0]
        pieces = ((fields[:, self.field] >> self.low) & self.mask) << self.shift  # (N, P), < 2^39
        window = (pieces.unsqueeze(-1) >> self.byte_shift) & 255  # (N, P, SPAN)
        out = torch.zeros(n, n_bytes + self.SPAN, dtype=torch.int64, device=fields.device)
        out.index_add_(1, self.byte_index.flatten(), window.reshape(n, -1))
        return out[:, :n_bytes].to(torch.uint8)

    def read(self, packed: torch.Tensor) -> torch.Tensor:
        """(N, n_bytes) uint8 -> (N, n_fields) int64."""
        if sys.byteorder != "little":
            return self._read_bytewise(packed)
        n_words = (self.total_bits + 63) // 64 + 1  # + 1: the word after a field's first is always there
        words = torch.nn.functional.pad(packed, (0, 8 * n_words - packed.shape[1])).view(torch.int64)  # (N, W)
        lo = (words[:, self.word] >> self.lo_shift) & self.lo_mask  # >> sign-extends; the mask drops it
        hi = (words[:, self.word + 1] << self.hi_shift) & self.hi_keep
        return (lo | hi) & self.field_mask

    def _read_bytewise(self, packed: torch.Tensor) -> torch.Tensor:
        n = packed.shape[0]
        padded = torch.nn.functional.pad(packed, (0, self.SPAN)).to(torch.int64)
        window = padded[:, self.byte_index]  # (N, P, SPAN)
        pieces = ((window << self.byte_shift).sum(-1) >> self.shift) & self.mask  # (N, P)
        if self.one_piece_per_field:
            return pieces
        out = torch.zeros(n, self.n_fields, dtype=torch.int64, device=packed.device)
        out.index_add_(1, self.field, pieces << self.low)
        return out
