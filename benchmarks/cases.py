"""The benchmark's shapes, configurations and input builders, shared by every subcommand.

Chunk inputs are bf16 (unless another ``dtype`` is asked for), head dims K = V = 128 unless
given, with q and k L2-normalized in the kernel. Two configurations:

* ``g`` ("g pre-computed"): the per-channel log-decay g in float32, ``logsigmoid(x + 3) * 2``
  with x standard normal (mostly in [-1, 0)), beta after the sigmoid;
* ``kimi`` (the Kimi Linear layer's configuration): the raw gate in the inputs' dtype, activated
  in the kernel as ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` with ``A_log`` float32
  ``[H]``, ``dt_bias`` float32 ``[H * K]``, ``safe_gate=True, lower_bound=-5``, and beta as
  logits (``use_beta_sigmoid_in_kernel=True``). FlashKDA runs this configuration only.

Nothing here imports ``kda``: ``compare`` chooses which ``kda`` a process imports.
"""
from __future__ import annotations

from dataclasses import dataclass

HEAD_DIM = 128
CHUNK = 64
LOWER_BOUND = -5.0

CONFIGS = ('g', 'kimi')
CONFIG_TITLES = {'g': 'g pre-computed', 'kimi': 'Kimi configuration'}

# (B, T, H) of the chunk tables.
CHUNK_SHAPES = [(8, 4096, 16), (1, 32768, 32), (1, 8192, 96), (4, 8192, 32)]
# 8 sequences of mixed lengths, most not multiples of the chunk size, 32768 tokens in all.
VARLEN_LENGTHS = [1000, 7193, 2048, 5111, 3100, 6144, 4085, 4087]
VARLEN_H = 32

DECODE_H = 32
DECODE_BATCHES = [1, 16, 64, 256, 1024]
# Batches of the decode table timed in the Kimi configuration as well.
DECODE_KIMI_BATCHES = [1, 64]

# Forward throughput against sequence length at a fixed number of tokens.
PLOT_TOKENS = 32768
PLOT_T = [2048, 4096, 8192, 16384, 32768]
PLOT_H = 32


@dataclass(frozen=True)
class ChunkCase:
    """One chunk shape: ``B`` sequences of ``T`` tokens, or one batch of varlen ``lengths``."""
    label: str
    B: int
    T: int
    H: int
    lengths: tuple[int, ...] | None = None

    @property
    def tokens(self) -> int:
        return self.B * self.T


def chunk_cases() -> list[ChunkCase]:
    """The five benchmark shapes: the four fixed ones, then the varlen batch."""
    cases = [ChunkCase(f"({B}, {T}, {H})", B, T, H) for B, T, H in CHUNK_SHAPES]
    total = sum(VARLEN_LENGTHS)
    cases.append(ChunkCase(f"varlen, {len(VARLEN_LENGTHS)} seqs, {total} tokens, H = {VARLEN_H}",
                           1, total, VARLEN_H, tuple(VARLEN_LENGTHS)))
    return cases


def case_by_name(name: str) -> ChunkCase:
    """``'varlen'``, an index into ``chunk_cases()``, or ``'B,T,H'``."""
    cases = chunk_cases()
    if name == 'varlen':
        return cases[-1]
    if name.isdigit():
        index = int(name)
        if index >= len(cases):
            raise ValueError(f"shape index {index} out of range: there are {len(cases)} shapes")
        return cases[index]
    try:
        B, T, H = (int(x) for x in name.split(','))
    except ValueError:
        raise ValueError(f"shape {name!r}: expected 'varlen', an index or 'B,T,H'") from None
    return ChunkCase(f"({B}, {T}, {H})", B, T, H)


@dataclass
class ChunkInputs:
    """Tensors (``tensors``: q, k, v, g, beta) and keyword options of one ``chunk_kda`` call."""
    tensors: dict
    options: dict


def chunk_inputs(case: ChunkCase, config: str = 'g', device='cuda', seed: int = 0, K: int = HEAD_DIM,
                 V: int = HEAD_DIM, dtype=None) -> ChunkInputs:
    """Inputs of ``case`` in ``config`` ('g' or 'kimi'); ``dtype`` default bf16."""
    import torch
    import torch.nn.functional as F
    if config not in CONFIGS:
        raise ValueError(f"config {config!r}: expected one of {CONFIGS}")
    dtype = dtype or torch.bfloat16
    B, T, H = case.B, case.T, case.H
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, to=torch.float32):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(to)

    tensors = dict(q=rnd(B, T, H, K, to=dtype), k=rnd(B, T, H, K, to=dtype), v=rnd(B, T, H, V, to=dtype),
                   g=(F.logsigmoid(rnd(B, T, H, K) + 3.0) * 2.0).contiguous(),
                   beta=torch.sigmoid(rnd(B, T, H)).to(dtype))
    options = dict(use_qk_l2norm_in_kernel=True)
    if config == 'kimi':
        tensors['g'] = rnd(B, T, H, K, to=dtype)
        tensors['beta'] = rnd(B, T, H, to=dtype)
        options.update(use_gate_in_kernel=True,
                       A_log=torch.log(torch.rand(H, generator=gen, device=device) * 15 + 1),
                       dt_bias=rnd(H * K) * 0.1, safe_gate=True, lower_bound=LOWER_BOUND,
                       use_beta_sigmoid_in_kernel=True)
    if case.lengths is not None:
        cu = torch.tensor((0, *case.lengths), dtype=torch.int64).cumsum(0)
        options['cu_seqlens'] = cu.to(device)
        options['cu_seqlens_cpu'] = cu
    return ChunkInputs(tensors, options)


@dataclass
class DecodeInputs:
    """One decode step's tensors and options (``kwargs``) and its float32 state ``[B, H, K, V]``."""
    kwargs: dict
    state: object


def decode_inputs(B: int, config: str = 'g', device='cuda', seed: int = 0) -> DecodeInputs:
    """One decode step (T = 1, H = ``DECODE_H``, K = V = 128, bf16 inputs) in ``config``."""
    import torch
    import torch.nn.functional as F
    gen = torch.Generator(device=device).manual_seed(seed)
    H, K, V = DECODE_H, HEAD_DIM, HEAD_DIM
    bf = torch.bfloat16

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    kwargs = dict(q=rnd(B, 1, H, K).to(bf), k=rnd(B, 1, H, K).to(bf), v=rnd(B, 1, H, V).to(bf),
                  g=F.logsigmoid(rnd(B, 1, H, K) + 3.0) * 2.0, beta=torch.sigmoid(rnd(B, 1, H)).to(bf),
                  use_qk_l2norm_in_kernel=True)
    if config == 'kimi':
        kwargs.update(g=rnd(B, 1, H, K).to(bf), beta=rnd(B, 1, H).to(bf),
                      A_log=torch.log(torch.rand(H, generator=gen, device=device) * 15 + 1),
                      dt_bias=rnd(H * K) * 0.1, use_gate_in_kernel=True, lower_bound=LOWER_BOUND,
                      use_beta_sigmoid_in_kernel=True)
    return DecodeInputs(kwargs, rnd(B, H, K, V) * 0.1)
