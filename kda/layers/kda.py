"""``KimiDeltaAttention``: Kimi Linear's KDA layer on this library's kernels, with the constructor,
defaults and parameter names of FLA's ``fla.layers.KimiDeltaAttention`` (an FLA state_dict loads
unchanged). For hidden states ``x`` and heads ``h`` (query/key) and ``hv`` (value)::

    q, k, v = silu(conv(q_proj x)), silu(conv(k_proj x)), silu(conv(v_proj x))    (short convs)
    g    = f_proj x = W_f1 (W_f0 x)          the raw gate, [HV, K]: activated in the kernels as
           -exp(A_log) softplus(g + dt_bias)   or   lower_bound sigmoid(exp(A_log) (g + dt_bias))
    beta = sigmoid(b_proj x)   (times 2 with allow_neg_eigval)
    o    = KDA(l2norm(q), l2norm(k), v, g, beta)                 (chunk_kda / fused_recurrent_kda)
    y    = o_proj( rmsnorm(o) * o_norm.weight * sigmoid(g_proj x) )       per value head

Training and prefill use ``chunk_kda``; inference on at most 64 tokens ``fused_recurrent_kda``
(as FLA); a one-token step from a cache, without autograd, the fused decode step
(``kda.ops.decode_step``). docs/layer.md is the user's guide.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from kda.layers.cache import KDACache, LayerState
from kda.ops.chunk import chunk_kda
from kda.ops.decode_step import DecodeWorkspace, kda_decode_step
from kda.ops.fused_recurrent import fused_recurrent_kda
from kda.ops.gated_norm import gated_rms_norm
from kda.ops.short_conv import MAX_CONV_SIZE, short_conv
from kda.ops.validation import MAX_HEAD_DIM

MODES = ('chunk', 'fused_recurrent')
# Inference calls on at most this many tokens a sequence take the token recurrence (as FLA).
RECURRENT_MAX_TOKENS = 64


class ShortConvolution(nn.Conv1d):
    """Depthwise causal convolution with SiLU over ``[B, T, D]`` inputs (``kda.ops.short_conv``);
    parameters as ``nn.Conv1d(D, D, W, groups=D)``: ``weight`` ``[D, 1, W]``, optional ``bias``."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False, device=None, dtype=None):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, padding=kernel_size - 1,
                         bias=bias, device=device, dtype=dtype)

    def forward(self, x, cache=None, output_final_state=False, cu_seqlens=None):
        """``(y, final window)``; ``cache`` is the window ``[N, D, W]`` before the tokens."""
        return short_conv(x, self.weight, self.bias, cache, output_final_state, cu_seqlens=cu_seqlens)


class GatedRMSNorm(nn.Module):
    """``rmsnorm(x) * weight * sigmoid(gate)`` over the last dimension (``kda.ops.gated_norm``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x, gate):
        return gated_rms_norm(x, gate, self.weight, self.eps)


def _positive_int(name, x):
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if x < 1:
        raise ValueError(f"{name} must be positive, got {x}")


def _bool(name, x):
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """``x`` with ``softplus(x) = y`` (y > 0): ``y + log(1 - exp(-y))``."""
    return y + torch.log(-torch.expm1(-y))


class KimiDeltaAttention(nn.Module):
    """The KDA layer (see the module docstring). Arguments as FLA's layer:

    hidden_size, head_dim (K), num_heads (H), num_v_heads (HV, default H; a multiple of H),
    expand_v (V = head_dim * expand_v), mode ('chunk' or 'fused_recurrent', the kernel of
    inference calls on more than 64 tokens), use_short_conv, conv_size, conv_bias,
    allow_neg_eigval, safe_gate, lower_bound, layer_idx (its key in a ``KDACache``), norm_eps.
    Unknown keyword arguments are refused (``TypeError``).
    """

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 1,
        head_dim: int = 128,
        num_heads: int = 16,
        num_v_heads: int | None = None,
        mode: str = 'chunk',
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        safe_gate: bool = False,
        lower_bound: float | None = None,
        conv_size: int = 4,
        conv_bias: bool = False,
        layer_idx: int | None = None,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        self._validate(hidden_size, expand_v, head_dim, num_heads, num_v_heads, mode, use_short_conv,
                       allow_neg_eigval, safe_gate, lower_bound, conv_size, conv_bias, layer_idx, norm_eps)
        self.hidden_size, self.expand_v, self.mode = hidden_size, expand_v, mode
        self.head_dim = self.head_k_dim = head_dim
        self.head_v_dim = round(head_dim * expand_v)
        self.num_heads, self.num_v_heads = num_heads, num_v_heads
        self.key_dim = num_heads * head_dim
        self.value_dim = num_v_heads * self.head_v_dim
        self.gate_dim = num_v_heads * head_dim
        self.use_short_conv, self.conv_size, self.conv_bias = use_short_conv, conv_size, conv_bias
        self.allow_neg_eigval, self.safe_gate = allow_neg_eigval, safe_gate
        self.lower_bound = None if lower_bound is None else float(lower_bound)
        self.layer_idx, self.norm_eps = layer_idx, norm_eps

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias)
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias)
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, bias=conv_bias)
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, self.head_v_dim, bias=False),
                                    nn.Linear(self.head_v_dim, self.gate_dim, bias=False))
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.A_log = nn.Parameter(torch.zeros(num_v_heads) if safe_gate
                                  else torch.empty(num_v_heads).uniform_(1, 16).log())
        self.A_log._no_weight_decay = True
        # dt log-uniform in [1e-3, 1e-1] (at least 1e-4), stored as softplus^-1(dt)
        dt = torch.exp(torch.rand(self.gate_dim) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
        self.dt_bias = nn.Parameter(inverse_softplus(dt.clamp(min=1e-4)))
        self.dt_bias._no_weight_decay = True
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, self.head_v_dim, bias=False),
                                    nn.Linear(self.head_v_dim, self.value_dim, bias=True))
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    @staticmethod
    def _validate(hidden_size, expand_v, head_dim, num_heads, num_v_heads, mode, use_short_conv,
                  allow_neg_eigval, safe_gate, lower_bound, conv_size, conv_bias, layer_idx, norm_eps):
        for name, x in (('hidden_size', hidden_size), ('head_dim', head_dim), ('num_heads', num_heads),
                        ('num_v_heads', num_v_heads), ('conv_size', conv_size)):
            _positive_int(name, x)
        for name, x in (('use_short_conv', use_short_conv), ('allow_neg_eigval', allow_neg_eigval),
                        ('safe_gate', safe_gate), ('conv_bias', conv_bias)):
            _bool(name, x)
        if isinstance(expand_v, bool) or not isinstance(expand_v, (int, float)):
            raise TypeError(f"expand_v must be a number, got {type(expand_v).__name__}")
        head_v_dim = head_dim * expand_v
        if not (math.isfinite(head_v_dim) and head_v_dim >= 1 and abs(head_v_dim - round(head_v_dim)) < 1e-5):
            raise ValueError(f"expand_v = {expand_v} must make head_dim * expand_v a positive integer, "
                             f"got {head_v_dim} with head_dim = {head_dim}")
        if head_dim > MAX_HEAD_DIM or round(head_v_dim) > MAX_HEAD_DIM:
            raise ValueError(f"head_dim and head_dim * expand_v must be at most {MAX_HEAD_DIM}, "
                             f"got {head_dim} and {round(head_v_dim)}")
        if num_v_heads % num_heads:
            raise ValueError(f"num_v_heads = {num_v_heads} must be a multiple of num_heads = {num_heads}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if conv_size > MAX_CONV_SIZE:
            raise ValueError(f"conv_size must be at most {MAX_CONV_SIZE}, got {conv_size}")
        if lower_bound is not None:
            if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
                raise TypeError(f"lower_bound must be a float or None, got {type(lower_bound).__name__}")
            if not -5 <= lower_bound < 0:
                raise ValueError(f"lower_bound must lie in [-5, 0), got {lower_bound}")
        if safe_gate and lower_bound is None:
            raise ValueError("safe_gate=True requires lower_bound (the bound it promises)")
        if layer_idx is not None and (isinstance(layer_idx, bool) or not isinstance(layer_idx, int)):
            raise TypeError(f"layer_idx must be an int or None, got {type(layer_idx).__name__}")
        if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or not (
                math.isfinite(norm_eps) and norm_eps > 0):
            raise ValueError(f"norm_eps must be a positive finite number, got {norm_eps!r}")

    @property
    def cache_key(self) -> int:
        """This layer's entry in a ``KDACache``: ``layer_idx``, or 0 without one."""
        return 0 if self.layer_idx is None else self.layer_idx

    # ----------------------------------------------------------------------------------------

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: KDACache | None = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        *,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None, KDACache | None]:
        """``(y, None, cache)``, as FLA's layer.

        hidden_states: ``[B, T, hidden_size]``. attention_mask: ``[B, T]`` of 0/1 (1 = token),
        padding anywhere; the layer computes on the tokens alone and returns zeros at padding.
        cu_seqlens: packed sequences in ``B = 1`` (not with attention_mask). past_key_values: a
        ``KDACache``; its entry for this layer (if any) is the state before the tokens. With
        ``use_cache`` the state after them is stored there (a new cache when None is given)
        and the cache returned. ``output_attentions`` is accepted for FLA's signature; there are
        no attention weights (None).
        """
        state = self._validate_call(hidden_states, attention_mask, past_key_values, use_cache, cu_seqlens)
        if use_cache and past_key_values is None:
            past_key_values = KDACache()
        if use_cache and self._fused_step_applies(hidden_states, attention_mask, cu_seqlens, state):
            return self._decode_step(hidden_states, state), None, past_key_values
        B, T, _ = hidden_states.shape
        x, tokens = hidden_states, None
        if attention_mask is not None:
            x, tokens, cu_seqlens = unpad(hidden_states, attention_mask)
        o, new_state = self._mix(x, state, use_cache, cu_seqlens)
        if tokens is not None:
            o = pad(o, tokens, B, T)
        if use_cache:
            past_key_values.update(self.cache_key, new_state)
        return o, None, past_key_values

    def _validate_call(self, hidden_states, attention_mask, past_key_values, use_cache, cu_seqlens):
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
        if hidden_states.dim() != 3 or hidden_states.shape[2] != self.hidden_size:
            raise ValueError(f"hidden_states must be [B, T, {self.hidden_size}], got {list(hidden_states.shape)}")
        _bool('use_cache', use_cache)
        B, T, _ = hidden_states.shape
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor):
                raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
            if tuple(attention_mask.shape) != (B, T):
                raise ValueError(f"attention_mask must be a [B, T] = [{B}, {T}] 0/1 padding mask, "
                                 f"got {list(attention_mask.shape)}")
            if cu_seqlens is not None:
                raise ValueError("pass attention_mask or cu_seqlens, not both")
        N = B
        if cu_seqlens is not None:
            if not isinstance(cu_seqlens, torch.Tensor):
                raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
            N = cu_seqlens.numel() - 1
        if past_key_values is None:
            return None
        if not isinstance(past_key_values, KDACache):
            raise TypeError(f"past_key_values must be a KDACache or None, got {type(past_key_values).__name__}")
        state = past_key_values[self.cache_key]
        if state is not None:
            expect = (N, self.num_v_heads, self.head_k_dim, self.head_v_dim)
            if tuple(state.recurrent_state.shape) != expect:
                raise ValueError(f"the cached state of layer {self.cache_key} is for "
                                 f"{list(state.recurrent_state.shape)}, this call needs {list(expect)} "
                                 f"([N, HV, K, V] with N = {N} sequences)")
            if (state.conv_states is None) == self.use_short_conv:
                raise ValueError(f"the cached state of layer {self.cache_key} "
                                 f"{'lacks' if self.use_short_conv else 'has'} convolution windows")
        return state

    def _fused_step_applies(self, hidden_states, attention_mask, cu_seqlens, state) -> bool:
        """One token per sequence from a cache, no mask, nothing to differentiate (the caller
        asked for the cache to be updated: the step writes its states in place)."""
        if state is None or hidden_states.shape[1] != 1 or attention_mask is not None or cu_seqlens is not None:
            return False
        if torch.is_grad_enabled() and (hidden_states.requires_grad or any(p.requires_grad for p in self.parameters())):
            return False
        tensors = [state.recurrent_state] + list(state.conv_states or ())
        return not any(t.requires_grad for t in tensors)

    def _decode_step(self, x, state: LayerState) -> torch.Tensor:
        B = x.shape[0]
        if state.workspace is None and self.use_short_conv:
            state.workspace = DecodeWorkspace.empty(B, self.key_dim, self.value_dim, x.device)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d) if self.use_short_conv else None
        o = kda_decode_step(
            self.q_proj(x), self.k_proj(x), self.v_proj(x), self.f_proj(x), self.b_proj(x), self.g_proj(x),
            state.recurrent_state, A_log=self.A_log.float(), dt_bias=self.dt_bias.float(),
            norm_weight=self.o_norm.weight, norm_eps=self.norm_eps,
            conv_states=state.conv_states,
            conv_weights=None if convs is None else tuple(c.weight for c in convs),
            conv_biases=None if convs is None or not self.conv_bias else tuple(c.bias for c in convs),
            lower_bound=self.lower_bound, allow_neg_eigval=self.allow_neg_eigval, workspace=state.workspace)
        return self.o_proj(o)

    def _mix(self, x, state: LayerState | None, use_cache: bool, cu_seqlens):
        """The layer on unpadded ``x`` ``[B, T, hidden]``: ``(y, LayerState or None)``."""
        B, T, _ = x.shape
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        conv_states = None
        if self.use_short_conv:
            windows = state.conv_states if state is not None else (None, None, None)
            q, cq = self.q_conv1d(self.q_proj(x), windows[0], use_cache, cu_seqlens)
            k, ck = self.k_conv1d(self.k_proj(x), windows[1], use_cache, cu_seqlens)
            v, cv = self.v_conv1d(self.v_proj(x), windows[2], use_cache, cu_seqlens)
            conv_states = (cq, ck, cv) if use_cache else None
        else:
            q, k, v = (nn.functional.silu(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = q.view(B, T, H, K), k.view(B, T, H, K)
        v = v.view(B, T, HV, V)
        g = self.f_proj(x).view(B, T, HV, K)
        beta = self.b_proj(x)
        options = dict(
            initial_state=None if state is None else state.recurrent_state, output_final_state=use_cache,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=self.A_log.float(),
            dt_bias=self.dt_bias.float(), lower_bound=self.lower_bound, safe_gate=self.safe_gate,
            use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval, cu_seqlens=cu_seqlens)
        if self.training or (self.mode == 'chunk' and T > RECURRENT_MAX_TOKENS):
            o, ht = chunk_kda(q, k, v, g, beta, **options)
        else:
            o, ht = fused_recurrent_kda(q, k, v, g, beta, **options)
        o = self.o_norm(o, self.g_proj(x).view(B, T, HV, V))
        y = self.o_proj(o.reshape(B, T, HV * V))
        return y, (LayerState(conv_states, ht) if use_cache else None)


def unpad(hidden_states, attention_mask):
    """``(tokens packed into [1, total, hidden], their flat indices, cu_seqlens)``; a row without
    tokens is a sequence of length 0 (its state passes through)."""
    mask = attention_mask.bool()
    tokens = mask.flatten().nonzero().flatten()
    lengths = mask.sum(1)
    cu_seqlens = torch.zeros(mask.shape[0] + 1, dtype=torch.int64, device=hidden_states.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    return hidden_states.flatten(0, 1)[tokens][None], tokens, cu_seqlens


def pad(y, tokens, B, T):
    """``y`` ``[1, total, hidden]`` back to ``[B, T, hidden]``, zeros at padding."""
    out = y.new_zeros(B * T, y.shape[-1])
    out = out.index_copy(0, tokens, y[0])
    return out.view(B, T, -1)
