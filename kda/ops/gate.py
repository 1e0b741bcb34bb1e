"""The gate and beta activations of docs/API.md, applied before the recurrence.

    g = -exp(A_log[h]) * softplus(g_raw + dt_bias[h])                  (no lower bound)
    g = lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias[h]))    (lower bound; without A_log
                                                                        the factor exp(A_log) is 1)
    beta = sigmoid(beta_raw)   or   2 * sigmoid(beta_raw)   (allow_neg_eigval)

Where the kernels run, ``chunk_kda`` activates the gate inside its kernels (``KernelGate`` below
says which; ``kernels/gate.py``) and beta here (it is 1/K the size of g), and
``fused_recurrent_kda`` activates both inside its kernel. The PyTorch paths (CPU tensors without
the interpreter) and the reference use the elementwise ops here, differentiable by autograd,
computed in float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class KernelGate:
    """The in-kernel gate of ``chunk_kda``: ``kind`` is ``'softplus'`` (no lower bound) or
    ``'sigmoid'`` (``lower_bound``), as ``kernels/gate.py`` names them."""
    kind: str
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    lower_bound: float

    @staticmethod
    def of(A_log, dt_bias, lower_bound) -> KernelGate:
        if lower_bound is None:
            return KernelGate('softplus', A_log, dt_bias, 0.0)
        return KernelGate('sigmoid', A_log, dt_bias, float(lower_bound))


def bounded_decay(gate: KernelGate | None) -> bool:
    """Whether every step's log-decay is >= -5: the lower-bound gate's are >= lower_bound. The
    pair kernels' builds for it skip their far-entry fallbacks (``BOUNDED_DECAY``, ``ALL_NEAR``),
    which a 16-row block's span of at most 75 < FAR_SPAN allows."""
    return gate is not None and gate.kind == 'sigmoid' and gate.lower_bound >= -5


def activate_gate(g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                  lower_bound: float | None) -> torch.Tensor:
    HV, K = g.shape[-2], g.shape[-1]
    x = g.float()
    if dt_bias is not None:
        x = x + dt_bias.view(HV, K)
    if lower_bound is None:
        return -A_log.exp()[:, None] * F.softplus(x)
    if A_log is not None:
        x = A_log.exp()[:, None] * x
    return lower_bound * torch.sigmoid(x)


def activate_beta(beta: torch.Tensor, allow_neg_eigval: bool) -> torch.Tensor:
    b = torch.sigmoid(beta.float())
    return 2 * b if allow_neg_eigval else b


def kernel_beta(out: torch.Tensor, beta: torch.Tensor, sigmoid: bool, neg_eigval: bool) -> None:
    """Writes beta as the kernels read it into ``out`` (float32, contiguous, beta's shape): the
    caller's values, or with ``sigmoid`` ``activate_beta``'s, the same bits. A non-contiguous
    beta of logits goes through ``activate_beta`` itself: on the CPU, the sigmoid of a permuted
    tensor (whose layout the result keeps) and of a contiguous one round differently."""
    if not sigmoid:
        out.copy_(beta)
    elif not beta.is_contiguous():
        out.copy_(activate_beta(beta, neg_eigval))
    else:
        torch.sigmoid(beta.float(), out=out)
        if neg_eigval:
            out.mul_(2)
