"""Time floors: ``max(bytes / BYTES_PER_S, FLOPs / FLOPS_PER_S)``.

The ceilings are the H200's device-copy bandwidth and bf16 matrix-product rate, rounded
(measured 4.27 TB/s and 694 TFLOP/s).

Bytes, forward: q, k, v read and o written once in bf16, g read once in float32, beta once in
bf16 (the API's bytes, not a float32 copy a kernel may read). Forward + backward adds one read
of q, k, v, g, beta and of the output gradient do, and one write of dq, dk, dv, dbeta (bf16) and
dg (float32); saved or recomputed intermediates are not counted. Decode: the float32 state read
and written once, plus q, k, v, beta, o (bf16) and g (float32).

FLOPs, chunk forward, per value head and per chunk of C = 64 tokens (2 FLOPs a multiply-add), the
matrix products of the WY/UT algorithm (``kda/reference.py``)::

    A   = (k e^c)(k e^-c)^T          2 C^2 K      in-chunk key-key products
    Aqk = (q e^c)(k e^-c)^T          2 C^2 K      in-chunk query-key products
    (I + A)^-1                       C^3 / 3      unit lower-triangular inverse
    W   = M (beta k e^c)             2 C^2 K
    U   = M (beta v)                 2 C^2 V
    W S                              2 C K V      corrections dV = U - W S
    (q e^c) S                        2 C K V      inter-chunk output
    Aqk dV                           2 C^2 V      intra-chunk output
    (k e^(c_last - c))^T dV          2 C K V      state update

i.e. ``6 C^2 K + 4 C^2 V + 6 C K V + C^3 / 3`` a chunk, about 182 kFLOP a token and head at
C = 64, K = V = 128. Applying M inside the state sweep (``M diag(beta) (V - (k e^c) S)``, W never
formed) saves 2 C^2 K, so this FLOP floor is ~10 % high for such a forward; at these shapes the
byte floor is the larger either way. Element-wise work (decays, normalization) is not counted.
Forward + backward counts 3x the forward's FLOPs (the backward's products are about twice the
forward's). Decode: ``8 K V`` a token and head (decay, prediction S^T k, rank-1 update, output
S^T q).
"""
from __future__ import annotations

from dataclasses import dataclass

from .cases import CHUNK, DECODE_H, HEAD_DIM

BYTES_PER_S = 4.3e12
FLOPS_PER_S = 700e12


@dataclass(frozen=True)
class Floor:
    """A time floor's two parts, in the unit of the function that made it."""
    bytes_part: float
    flops_part: float

    @property
    def time(self) -> float:
        return max(self.bytes_part, self.flops_part)


def chunk_flops_per_token_head(K: int = HEAD_DIM, V: int = HEAD_DIM, C: int = CHUNK) -> float:
    return (6 * C * C * K + 4 * C * C * V + 6 * C * K * V + C ** 3 / 3) / C


def chunk_floor_ms(tokens: int, H: int, HV: int | None = None, K: int = HEAD_DIM, V: int = HEAD_DIM,
                   backward: bool = False) -> Floor:
    """Floor in ms of a ``chunk_kda`` call (forward, or forward + backward) over ``tokens``."""
    HV = HV or H
    o_bytes = tokens * HV * V * 2
    fwd_bytes = tokens * (2 * H * K * 2 + HV * V * 2 + HV * K * 4 + HV * 2) + o_bytes
    flops = tokens * HV * chunk_flops_per_token_head(K, V)
    nbytes = fwd_bytes
    if backward:
        # reads q, k, v, g, beta, do (as many bytes as the forward); writes dq, dk, dv, dg, dbeta
        nbytes += fwd_bytes + (fwd_bytes - o_bytes)
        flops *= 3
    return Floor(nbytes / BYTES_PER_S * 1e3, flops / FLOPS_PER_S * 1e3)


def decode_state_bytes(B: int, H: int = DECODE_H, K: int = HEAD_DIM, V: int = HEAD_DIM) -> int:
    """Bytes of the float32 state read and written once by a decode step."""
    return 2 * B * H * K * V * 4


def decode_floor_us(B: int, H: int = DECODE_H, K: int = HEAD_DIM, V: int = HEAD_DIM) -> Floor:
    """Floor in us of one decode step of ``B`` sequences."""
    io = B * (2 * H * K * 2 + H * V * 2 * 2 + H * K * 4 + H * 2)
    nbytes = decode_state_bytes(B, H, K, V) + io
    return Floor(nbytes / BYTES_PER_S * 1e6, B * H * 8 * K * V / FLOPS_PER_S * 1e6)
