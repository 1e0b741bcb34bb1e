"""The kernels' entry points as ``torch.library`` custom ops, ``kda::*``: what ``torch.compile``
(``fullgraph=True``), AOT autograd and ``torch.export`` see of ``chunk_kda`` and
``fused_recurrent_kda``.

    kda::chunk_fwd          inference forward: (o, [final_state], [h])
    kda::chunk_fwd_train    training forward: (o, [final_state], saved for the backward)
    kda::chunk_bwd          its gradients, registered as chunk_fwd_train's autograd formula
    kda::fused_recurrent    the recurrence; writes ``out`` and ``final_state`` (the state pool
                            itself with ``state_in_place``) in place

Each op takes the launcher-level tensors and options explicitly (a new optional tensor is one
more ``Tensor?`` argument); outputs that may be absent are lists (a custom op cannot return
None). Each fake implementation gives every output's shape, dtype and device from the inputs'
alone. The public functions validate (Python that dynamo traces) and call these ops only while
compiling or exporting (``torch.compiler.is_compiling()``); eager calls run the same launchers
directly, as the op's dispatch costs tens of microseconds of host time a call.

Varlen calls under an op build the chunk map on the device with a fixed bound of ``max_chunks``
entries (``layout.device_chunk_layout``): no host read of ``cu_seqlens``, so a trace does not
specialize on (or break at) its values, and ``dynamic=True`` covers every T and sequence count.

Where the kernels do not run (CPU tensors without the interpreter, and bf16 in the
interpreter: ``kernel_path``) the ops run the PyTorch reference inside: traced by dynamo, its
loop over chunks would specialize on T and its varlen split read ``cu_seqlens`` on the host.
The backward there recomputes the reference forward under autograd.
"""
import functools
from typing import Optional

import torch
from torch import Tensor

from kda.ops import fused_recurrent as decode
from kda.ops.chunk.forward import chunk_kda_fwd
from kda.ops.chunk.function import SavedForBackward, training_backward, training_forward
from kda.ops.chunk.intra import InChunkMatrices, InChunkTensors
from kda.ops.chunk.backward import ForwardIntermediates
from kda.ops.chunk.layout import ChunkLayout, chunk_layout, device_chunk_layout, max_varlen_chunks
from kda.ops.gate import KernelGate, activate_beta, activate_gate, kernel_beta
from kda.ops.utils import INTERPRET, cdiv, contiguous, use_kernels
from kda.reference import chunk_kda_reference


def kernel_path(q: Tensor) -> bool:
    """Whether ``chunk_kda`` runs its kernels on tensors like ``q``: on CUDA, and in Triton's
    interpreter but for bf16 (its ``tl.dot`` multiplies bf16 bit patterns): the test of
    ``chunk_kda``'s eager path (api.py), inside the ops."""
    return use_kernels(q) and not (INTERPRET and q.dtype == torch.bfloat16)


def op_layout(q: Tensor, cu_seqlens: Optional[Tensor], chunk_size: int, max_chunks: int) -> ChunkLayout:
    """The chunk map inside an op: fixed length from the shapes, varlen built on the device."""
    B, T = q.shape[0], q.shape[1]
    if cu_seqlens is None:
        return chunk_layout(B, T, chunk_size, None, None)
    return device_chunk_layout(chunk_size, T, cu_seqlens, max_chunks)


def total_chunks(q: Tensor, cu_seqlens: Optional[Tensor], chunk_size: int, max_chunks: int) -> int:
    B, T = q.shape[0], q.shape[1]
    return B * cdiv(T, chunk_size) if cu_seqlens is None else max_chunks


def state_shape(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], state_v_first: bool) -> tuple:
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    return (N, HV, V, K) if state_v_first else (N, HV, K, V)


def reference_gate(g: Tensor, A_log, dt_bias, gate_kind: Optional[str], lower_bound: float) -> Tensor:
    """``g`` activated as the kernels' in-kernel gate ``gate_kind`` would (None: as given)."""
    if gate_kind is None:
        return g
    return activate_gate(g, A_log, dt_bias, None if gate_kind == 'softplus' else lower_bound)


def pad_chunk_states(h: Tensor, total: int) -> Tensor:
    """The reference's states entering each chunk, ``[chunks, HV, K, V]``, zero-padded to
    ``total`` entries (the device-built map's size)."""
    return torch.nn.functional.pad(h, (0, 0, 0, 0, 0, 0, 0, total - h.shape[0]))


# ---------------------------------------------------------------------------------------------
# kda::chunk_fwd: the inference forward.

@torch.library.custom_op('kda::chunk_fwd', mutates_args=())
def chunk_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Optional[Tensor],
              dt_bias: Optional[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
              scale: float, chunk_size: int, max_chunks: int, output_final_state: bool,
              state_v_first: bool, qk_l2norm: bool, gate_kind: Optional[str], lower_bound: float,
              beta_kind: str, store_states: bool) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """``(o, [final_state] if output_final_state, [h] if store_states)``. ``beta`` is the
    caller's (logits under ``beta_kind`` 'sigmoid' / 'sigmoid2'); ``g`` the raw gate under
    ``gate_kind``. ``h``: float32 ``[total chunks, HV, K, V]`` in the kernels' key-major layout
    (``total_chunks``; padding entries past the real chunks are zero)."""
    if not kernel_path(q):
        return reference_fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale,
                             chunk_size, max_chunks, output_final_state, state_v_first, qk_l2norm,
                             gate_kind, lower_bound, beta_kind, store_states)
    q, k, v, g, initial_state, cu_seqlens = contiguous(q, k, v, g, initial_state, cu_seqlens)
    layout = op_layout(q, cu_seqlens, chunk_size, max_chunks)
    gate = None if gate_kind is None else KernelGate(gate_kind, A_log, dt_bias, lower_bound)
    ready = beta_kind == 'none' and beta.dtype == torch.float32 and beta.is_contiguous()
    prepare = None if ready else functools.partial(kernel_beta, sigmoid=beta_kind != 'none',
                                                   neg_eigval=beta_kind == 'sigmoid2')
    out = chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first,
                        cu_seqlens, layout, gate, store_states=store_states, l2norm=qk_l2norm,
                        prepare_beta=prepare, zero_unwritten=True)
    final = [out.final_state] if output_final_state else []
    return out.o, final, [out.h] if store_states else []


def reference_fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, chunk_size,
                  max_chunks, output_final_state, state_v_first, qk_l2norm, gate_kind, lower_bound,
                  beta_kind, store_states):
    """``chunk_fwd`` on the PyTorch reference, with the kernels' output layout."""
    if beta_kind != 'none':
        beta = activate_beta(beta, beta_kind == 'sigmoid2')
    g = reference_gate(g, A_log, dt_bias, gate_kind, lower_bound)
    result = chunk_kda_reference(q, k, v, g, beta, scale, initial_state, output_final_state, qk_l2norm,
                                 cu_seqlens, state_v_first, chunk_size, store_states)
    o, final = result[0], [result[1]] if output_final_state else []
    if not store_states:
        return o, final, []
    h = result[2].flatten(0, 1)
    h = h.transpose(-1, -2) if state_v_first else h
    total = total_chunks(q, cu_seqlens, chunk_size, max_chunks)
    return o, final, [pad_chunk_states(h.float(), total).contiguous()]


@chunk_fwd.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, chunk_size, max_chunks,
      output_final_state, state_v_first, qk_l2norm, gate_kind, lower_bound, beta_kind, store_states):
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = q.new_empty(B, T, HV, V)
    final = [q.new_empty(state_shape(q, v, cu_seqlens, state_v_first), dtype=torch.float32)]
    total = total_chunks(q, cu_seqlens, chunk_size, max_chunks)
    h = [q.new_empty(total, HV, K, V, dtype=torch.float32)]
    return o, final if output_final_state else [], h if store_states else []


# ---------------------------------------------------------------------------------------------
# kda::chunk_fwd_train and kda::chunk_bwd: the training forward and its gradients.

def flatten_saved(saved: SavedForBackward, qk_l2norm: bool) -> list[Tensor]:
    """``SavedForBackward`` as the op returns it: ``[qn, kn, rq, rk]`` under ``qk_l2norm`` (else
    q and k are the op's inputs, which an output may not alias), the three in-chunk matrices,
    then with ``disable_recompute`` ``[gc, qt, kbar, kg, h, v_new]``."""
    flat = [saved.qn, saved.kn, saved.rq, saved.rk] if qk_l2norm else []
    flat += list(saved.matrices)
    part = saved.intermediates
    if part is not None:
        flat += [part.intra.gc, part.intra.qt, part.intra.kbar, part.intra.kg, part.h, part.v_new]
    return flat


def unflatten_saved(flat: list[Tensor], q, k, qk_l2norm: bool) -> SavedForBackward:
    """``flatten_saved``'s inverse; ``q``, ``k`` the op's inputs."""
    qn, kn, rq, rk = flat[:4] if qk_l2norm else (q, k, None, None)
    rest = flat[4:] if qk_l2norm else flat
    matrices = InChunkMatrices(*rest[:3])
    intermediates = None
    if len(rest) > 3:
        gc, qt, kbar, kg, h, v_new = rest[3:]
        intermediates = ForwardIntermediates(InChunkTensors(gc, qt, kbar, kg, *matrices), h, v_new)
    return SavedForBackward(qn, kn, rq, rk, matrices, intermediates)


@torch.library.custom_op('kda::chunk_fwd_train', mutates_args=())
def chunk_fwd_train(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Optional[Tensor],
                    dt_bias: Optional[Tensor], initial_state: Optional[Tensor],
                    cu_seqlens: Optional[Tensor], scale: float, chunk_size: int, max_chunks: int,
                    output_final_state: bool, state_v_first: bool, qk_l2norm: bool,
                    gate_kind: Optional[str], lower_bound: float, disable_recompute: bool
                    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """``(o, [final_state] if output_final_state, saved)``: ``beta`` is float32 and activated;
    ``saved`` is ``flatten_saved``'s list on the kernels, empty on the reference (whose backward
    recomputes from the inputs)."""
    if not kernel_path(q):
        g = reference_gate(g, A_log, dt_bias, gate_kind, lower_bound)
        o, final = chunk_kda_reference(q, k, v, g, beta, scale, initial_state, output_final_state,
                                       qk_l2norm, cu_seqlens, state_v_first, chunk_size)
        return o, [final] if output_final_state else [], []
    q, k, v, g, beta, initial_state, cu_seqlens = contiguous(q, k, v, g, beta, initial_state, cu_seqlens)
    layout = op_layout(q, cu_seqlens, chunk_size, max_chunks)
    out = training_forward(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                           state_v_first, cu_seqlens, layout, qk_l2norm, gate_kind, lower_bound,
                           disable_recompute, zero_unwritten=True)
    return out.o, [out.final_state] if output_final_state else [], flatten_saved(out.saved, qk_l2norm)


@chunk_fwd_train.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, chunk_size, max_chunks,
      output_final_state, state_v_first, qk_l2norm, gate_kind, lower_bound, disable_recompute):
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = q.new_empty(B, T, HV, V)
    final = [q.new_empty(state_shape(q, v, cu_seqlens, state_v_first), dtype=torch.float32)]
    final = final if output_final_state else []
    if not kernel_path(q):
        return o, final, []
    f32 = torch.float32
    saved = []
    if qk_l2norm:
        saved += [torch.empty_like(q), torch.empty_like(k), q.new_empty(q.shape[:-1], dtype=f32),
                  k.new_empty(k.shape[:-1], dtype=f32)]
    saved += [q.new_empty(B, T, HV, chunk_size), q.new_empty(B, T, HV, chunk_size, dtype=f32),
              q.new_empty(B, T, HV, chunk_size)]
    if disable_recompute:
        total = total_chunks(q, cu_seqlens, chunk_size, max_chunks)
        saved += [q.new_empty(B, T, HV, K, dtype=f32), *(q.new_empty(B, T, HV, K) for _ in range(3)),
                  q.new_empty(total, HV, K, V), q.new_empty(B, T, HV, V)]
    return o, final, saved


@torch.library.custom_op('kda::chunk_bwd', mutates_args=())
def chunk_bwd(do: Tensor, dht: Optional[Tensor], q: Optional[Tensor], k: Optional[Tensor], v: Tensor,
              g: Tensor, beta: Tensor, A_log: Optional[Tensor], dt_bias: Optional[Tensor],
              initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], saved: list[Tensor],
              scale: float, chunk_size: int, max_chunks: int, state_v_first: bool, qk_l2norm: bool,
              gate_kind: Optional[str], lower_bound: float
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """Gradients of ``chunk_fwd_train``: ``(dq, dk, dv, dg, dbeta, rest)``, ``rest`` holding
    ``dh0`` (with an initial state), ``dA_log``, ``ddt_bias`` (those given), in that order.
    ``q``, ``k`` are None where ``saved`` holds their normalized rows (kernels, ``qk_l2norm``)."""
    if not saved:
        return reference_bwd(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                             scale, chunk_size, state_v_first, qk_l2norm, gate_kind, lower_bound)
    # The inputs as the caller gave them (the forward's dense copies are not kept): the kernels
    # index with dense strides.
    q, k, v, g, beta, initial_state, cu_seqlens = contiguous(q, k, v, g, beta, initial_state, cu_seqlens)
    layout = op_layout(v, cu_seqlens, chunk_size, max_chunks)
    grads = training_backward(unflatten_saved(list(saved), q, k, qk_l2norm), v, g, beta, A_log,
                              dt_bias, scale, initial_state, state_v_first, cu_seqlens, layout,
                              qk_l2norm, gate_kind, lower_bound, do, dht)
    rest = [t for t in (grads.dh0, grads.dA_log, grads.ddt_bias) if t is not None]
    return grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta, rest


def autograd_recording():
    """A context in which autograd records again inside an op's implementation: a compiled
    graph runs the op with the autograd and ADInplaceOrView keys excluded (the op's own autograd
    formula stands for what happens inside), which ``reference_bwd`` undoes for its own
    recomputation, then restores."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    autograd = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
                | torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView))
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded - autograd)


def reference_bwd(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale,
                  chunk_size, state_v_first, qk_l2norm, gate_kind, lower_bound):
    """``chunk_bwd`` on the reference: its forward again, differentiated by autograd."""
    given = [x for x in (initial_state, A_log, dt_bias) if x is not None]
    with autograd_recording(), torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta, *given)]
        q, k, v, g, beta, *others = leaves
        h0 = others.pop(0) if initial_state is not None else None
        A, bias = (others.pop(0) if x is not None else None for x in (A_log, dt_bias))
        gg = reference_gate(g, A, bias, gate_kind, lower_bound)
        o, ht = chunk_kda_reference(q, k, v, gg, beta, scale, h0, True, qk_l2norm, cu_seqlens,
                                    state_v_first, chunk_size)
        outputs, grads = (o, ht), (do, torch.zeros_like(ht) if dht is None else dht)
        found = torch.autograd.grad(outputs, leaves, grads, allow_unused=True)
    found = [torch.zeros_like(x) if d is None else d for x, d in zip(leaves, found)]
    return found[0], found[1], found[2], found[3], found[4], found[5:]


@chunk_bwd.register_fake
def _(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, saved, scale, chunk_size,
      max_chunks, state_v_first, qk_l2norm, gate_kind, lower_bound):
    qs = q if q is not None else saved[0]
    ks = k if k is not None else saved[1]
    rest = [torch.empty_like(x) for x in (initial_state, A_log, dt_bias) if x is not None]
    return (torch.empty_like(qs), torch.empty_like(ks), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), rest)


def _setup_training(ctx, inputs, output):
    (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, chunk_size, max_chunks,
     output_final_state, state_v_first, qk_l2norm, gate_kind, lower_bound, _) = inputs
    _, _, saved = output
    # Under qk_l2norm the kernels' backward reads the saved normalized rows, not q and k.
    keep_qk = not (qk_l2norm and kernel_path(q))
    ctx.save_for_backward(q if keep_qk else None, k if keep_qk else None, v, g, beta, A_log, dt_bias,
                          initial_state, cu_seqlens, *saved)
    ctx.options = (scale, chunk_size, max_chunks, state_v_first, qk_l2norm, gate_kind, lower_bound)
    ctx.gate_params = (A_log is not None, dt_bias is not None)


def _backward_training(ctx, do, dfinal, dsaved):
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *saved = ctx.saved_tensors
    dht = dfinal[0] if dfinal and dfinal[0] is not None else None
    dq, dk, dv, dg, dbeta, rest = torch.ops.kda.chunk_bwd(
        do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, saved, *ctx.options)
    rest = list(rest)
    dh0 = rest.pop(0) if initial_state is not None else None
    dA_log = rest.pop(0) if ctx.gate_params[0] else None
    ddt_bias = rest.pop(0) if ctx.gate_params[1] else None
    return (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0) + (None,) * 10


torch.library.register_autograd('kda::chunk_fwd_train', _backward_training, setup_context=_setup_training)


def chunk_kda_traced(q, k, v, g, beta, problem, initial_state, output_final_state, qk_l2norm,
                     use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel,
                     allow_neg_eigval, cu_seqlens, chunk_size, state_v_first, disable_recompute,
                     return_intermediate_states, intermediate_states_dtype, inference: bool):
    """``chunk_kda`` after validation, while compiling: one ``kda::chunk_fwd`` (``inference``) or
    ``kda::chunk_fwd_train`` op, with what ``chunk_kda`` does around its launchers (beta's float32
    copy for training, the intermediate states' shape and dtype) as traced PyTorch ops."""
    max_chunks = 0 if cu_seqlens is None else max_varlen_chunks(problem.T, chunk_size, problem.N)
    gate_kind = None if not use_gate_in_kernel else 'softplus' if lower_bound is None else 'sigmoid'
    options = (problem.scale, chunk_size, max_chunks, output_final_state, state_v_first, qk_l2norm,
               gate_kind, float(lower_bound or 0.0))
    if not inference:
        if use_beta_sigmoid_in_kernel:
            beta = activate_beta(beta, allow_neg_eigval)
        beta = beta.to(torch.float32, memory_format=torch.contiguous_format).contiguous()
        o, final, _ = torch.ops.kda.chunk_fwd_train(q, k, v, g, beta, A_log, dt_bias, initial_state,
                                                    cu_seqlens, *options, disable_recompute)
        return o, final[0] if output_final_state else None
    o, final, h = torch.ops.kda.chunk_fwd(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *options,
        decode.beta_kind_of(use_beta_sigmoid_in_kernel, allow_neg_eigval), return_intermediate_states)
    final_state = final[0] if output_final_state else None
    if not return_intermediate_states:
        return o, final_state
    return o, final_state, chunk_states(h[0], problem.B, cu_seqlens, state_v_first,
                                        intermediate_states_dtype or o.dtype)


def chunk_states(h: Tensor, B: int, cu_seqlens, state_v_first: bool, dtype: torch.dtype) -> Tensor:
    """``return_intermediate_states``' ``h`` from the kernels' ``[total chunks, HV, K, V]``:
    ``[B, NT, ...]`` (``[1, total chunks, ...]`` varlen), value-major with ``state_v_first``,
    in ``dtype``."""
    h = h.view(B, -1, *h.shape[1:]) if cu_seqlens is None else h.unsqueeze(0)
    return (h.transpose(-1, -2) if state_v_first else h).to(dtype)


# ---------------------------------------------------------------------------------------------
# kda::fused_recurrent: the recurrence, in place.

@torch.library.custom_op('kda::fused_recurrent', mutates_args=('out', 'final_state'))
def fused_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Optional[Tensor],
                    dt_bias: Optional[Tensor], initial_state: Optional[Tensor],
                    cu_seqlens: Optional[Tensor], ssm_state_indices: Optional[Tensor], out: Tensor,
                    final_state: Optional[Tensor], scale: float, lower_bound: float, qk_l2norm: bool,
                    gate_kind: str, beta_kind: str, state_v_first: bool, state_in_place: bool) -> None:
    """Writes the outputs into ``out`` and the final states into ``final_state``. With
    ``state_in_place``, ``final_state`` is the state pool, read and written in place
    (``inplace_final_state``; slots picked by ``ssm_state_indices`` where given) and
    ``initial_state`` is None."""
    h0 = final_state if state_in_place else initial_state
    if use_kernels(q):
        q, k, v, g, beta, h0, cu_seqlens, ssm_state_indices = contiguous(
            q, k, v, g, beta, h0, cu_seqlens, ssm_state_indices)
        decode.launch_fused_recurrent(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens,
                                      ssm_state_indices, out, final_state, scale, lower_bound,
                                      qk_l2norm, gate_kind, beta_kind, state_v_first)
        return
    if gate_kind != 'none':
        g = activate_gate(g, A_log, dt_bias, None if gate_kind == 'softplus' else lower_bound)
    if beta_kind != 'none':
        beta = activate_beta(beta, beta_kind == 'sigmoid2')
    _, ht = decode._torch_path(q, k, v, g, beta, scale, h0, final_state is not None, cu_seqlens,
                               state_v_first, qk_l2norm, state_in_place, ssm_state_indices, out)
    if final_state is not None and not state_in_place:
        final_state.copy_(ht)


@fused_recurrent.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, ssm_state_indices, out, final_state,
      scale, lower_bound, qk_l2norm, gate_kind, beta_kind, state_v_first, state_in_place):
    return None


def fused_recurrent_traced(q, k, v, g, beta, A_log, dt_bias, problem, initial_state, output_final_state,
                           use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound,
                           use_beta_sigmoid_in_kernel, allow_neg_eigval, cu_seqlens, state_v_first,
                           inplace_final_state, ssm_state_indices, out):
    """``fused_recurrent_kda`` after validation, while compiling: the outputs allocated here (in
    the graph), the ``kda::fused_recurrent`` op writing them."""
    if out is None:
        out = q.new_empty(problem.B, problem.T, problem.HV, problem.V)
    if inplace_final_state:
        final_state, initial_state = initial_state, None
    elif output_final_state:
        final_state = q.new_empty(state_shape(q, v, cu_seqlens, state_v_first), dtype=torch.float32)
    else:
        final_state = None
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    torch.ops.kda.fused_recurrent(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, ssm_state_indices, out, final_state,
        problem.scale, float(lower_bound or 0.0), use_qk_l2norm_in_kernel,
        decode.gate_kind_of(use_gate_in_kernel, lower_bound),
        decode.beta_kind_of(use_beta_sigmoid_in_kernel, allow_neg_eigval), state_v_first,
        inplace_final_state)
    inputs = [x for x in (q, k, v, g, beta, A_log, dt_bias, initial_state) if x is not None]
    if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        out = torch.ops.kda.forward_only(out, inputs)
    return out, final_state if output_final_state else None


# ---------------------------------------------------------------------------------------------
# kda::forward_only and kda::refuse_backward: fused_recurrent_kda's missing backward, traced.

@torch.library.custom_op('kda::forward_only', mutates_args=())
def forward_only(o: Tensor, inputs: list[Tensor]) -> Tensor:
    """A copy of ``o`` (an op's output may not alias its input) in the autograd graph of
    ``inputs``: a backward through it raises, as through eager ``fused_recurrent_kda``'s
    ``ForwardOnly``, rather than the inputs' gradients silently missing that call's part. Its
    formula traces (``kda::refuse_backward``) and raises only when run."""
    return o.clone()


@forward_only.register_fake
def _(o, inputs):
    return torch.empty_like(o)


@torch.library.custom_op('kda::refuse_backward', mutates_args=())
def refuse_backward(do: Tensor, inputs: list[Tensor]) -> list[Tensor]:
    """``kda::forward_only``'s gradients: raises ``fused_recurrent_kda``'s error. It takes the
    output's gradient ``do`` so that it belongs to the backward graph: with the inputs alone, the
    partitioner of a compiled graph would move it into the forward."""
    raise RuntimeError(decode.NO_BACKWARD)


@refuse_backward.register_fake
def _(do, inputs):
    return [torch.empty_like(x) for x in inputs]


def _setup_forward_only(ctx, inputs, output):
    ctx.save_for_backward(*inputs[1])


def _backward_forward_only(ctx, do):
    return None, torch.ops.kda.refuse_backward(do, list(ctx.saved_tensors))


torch.library.register_autograd('kda::forward_only', _backward_forward_only,
                                setup_context=_setup_forward_only)
