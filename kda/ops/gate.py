"""The gate and beta activations of API.md, applied before the recurrence.

    g = -exp(A_log[h]) * softplus(g_raw + dt_bias[h])                  (no lower bound)
    g = lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias[h]))    (lower bound; without A_log
                                                                        the factor exp(A_log) is 1)
    beta = sigmoid(beta_raw)   or   2 * sigmoid(beta_raw)   (allow_neg_eigval)

These are elementwise PyTorch ops, differentiable by autograd, computed in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
