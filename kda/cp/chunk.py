"""``chunk_kda`` with one packed batch split across the ranks of a process group.

Rank r holds a contiguous range of the packed tokens (``CPContext``). Its first local piece may
continue a sequence from rank r - 1; that piece's true entering state ``S_in`` is then composed
from the summaries ``(M_j, E_j)`` of the ranks before it (``summary.py``). Per rank:

* the main pass: ``chunk_kda`` over all local pieces, the continuing piece started from zeros
  (outputs ``o0``, final states; the last piece's final state is this rank's offset ``E``);
* the transition pass (only when the first piece continues): ``chunk_kda`` over that piece with
  ``v = 0`` of width K from ``S = I``: its outputs ``oM`` ``[T0, HV, K]`` and final state ``M``.

Since the recurrence is linear in ``(S_in, v)``, the exact outputs and final state of that piece are
``o = o0 + oM S_in`` and ``S_out = M S_in + E``: a rank runs each of its tokens once (plus the
continuing piece once more at width K), never again after the exchange.

Communication (``torch.distributed.all_gather`` on the context's group, float32): the offsets
``E`` (K x V per value head and rank), and the transitions ``M`` (K x K) only if some rank holds
just a middle part of one sequence; in the backward, the gradients reaching every rank's entering
state (K x V). A rank composes its entering state as the fold ``S = E_a; S = M_j S + E_j`` over the
ranks a < j < r that the sequence spans, and the backward folds the other way,
``T = dS_b; T = M_j^T T + dS_j`` for r < j < b, giving ``dE_r = T`` and ``dM_r = T S_in^T``; autograd
carries them into the two passes' final-state gradients.

Overlap: each gather is started asynchronously as soon as its summary exists. Without middle
ranks, the offsets' gather runs while the transition pass computes; with them, the transitions'
gather runs during the main pass and the offsets' gather is waited for right away. The backward's
gather is waited for before the passes' backward, which all need its result.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from kda.cp.context import CPContext
from kda.cp.summary import identity_states, merge_states
from kda.ops.validation import (
    _expect_bool,
    validate_activations,
    validate_chunk_size,
    validate_inputs,
    validate_state,
)


class _PendingGather:
    """An asynchronous ``all_gather`` of one float32 tensor from every rank of a group."""

    def __init__(self, x: torch.Tensor, group: dist.ProcessGroup, world_size: int):
        x = x.detach().to(torch.float32).contiguous()
        self.stacked = x.new_empty(world_size, *x.shape)
        self.work = dist.all_gather(list(self.stacked.unbind(0)), x, group=group, async_op=True)

    def wait(self) -> torch.Tensor:
        """``[world_size, *x.shape]``: every rank's tensor, in rank order."""
        self.work.wait()
        return self.stacked


class _EnteringState(torch.autograd.Function):
    """This rank's entering state from the gathered summaries; its backward gathers the gradients of
    every rank's entering state and returns those of this rank's ``(M, E)``.

    ``o`` and ``final`` pass through unchanged: every rank's outputs then depend on this node, so
    every rank runs its backward (the gather in it is collective) whether or not a sequence enters."""

    @staticmethod
    def forward(ctx, transition, offset, o, final, layout: CPContext, offsets: _PendingGather,
                transitions: _PendingGather | None):
        r = layout.rank
        HV, K, V = final.shape[1:]
        offsets_all = offsets.wait()
        # Without middle ranks no fold below reads a transition: the slices are empty.
        transitions_all = transitions.wait() if transitions is not None else offsets_all.new_empty(0, HV, K, K)
        if layout.continues_in[r]:
            a = layout.chain_start[r]
            state = merge_states(transitions_all[a + 1:r], offsets_all[a + 1:r], offsets_all[a])
        else:
            state = offsets_all.new_zeros(HV, K, V)
        b = layout.chain_end[r]
        ctx.layout = layout
        ctx.save_for_backward(transitions_all[r + 1:b].clone(), state if layout.middle[r] else None)
        return state, o, final

    @staticmethod
    def backward(ctx, d_state, d_o, d_final):
        layout = ctx.layout
        r = layout.rank
        later_transitions, state = ctx.saved_tensors
        d_states = _PendingGather(d_state, layout.group, layout.world_size).wait()
        d_transition = d_offset = None
        if layout.continues_out[r]:
            b = layout.chain_end[r]
            d_offset = merge_states(later_transitions.flip(0).transpose(-1, -2), d_states[r + 1:b].flip(0),
                                    d_states[b])
            if layout.middle[r]:
                d_transition = d_offset @ state.transpose(-1, -2)
        return d_transition, d_offset, d_o, d_final, None, None, None


def _validate(q, k, v, g, beta, scale, initial_state, output_final_state, layout, cu_seqlens,
              cu_seqlens_cpu, state_v_first, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log,
              dt_bias, safe_gate, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval,
              chunk_size, disable_recompute, return_intermediate_states) -> None:
    """Everything ``chunk_kda_cp`` refuses, checked before any kernel or communication."""
    if not isinstance(layout, CPContext):
        raise TypeError(f"cp_context must be a CPContext from kda.cp.build_cp_context, "
                        f"got {type(layout).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("cp_context needs an initialized torch.distributed process group")
    rank, world_size = dist.get_rank(layout.group), dist.get_world_size(layout.group)
    if (rank, world_size) != (layout.rank, layout.world_size):
        raise ValueError(f"cp_context was built for rank {layout.rank} of a group of {layout.world_size}, "
                         f"but this process is rank {rank} of its group of {world_size}")
    for name, x in (('cu_seqlens', cu_seqlens), ('cu_seqlens_cpu', cu_seqlens_cpu)):
        if x is not None:
            raise ValueError(f"{name} must be None with cp_context: the local offsets come from the context")
    _expect_bool('return_intermediate_states', return_intermediate_states)
    if return_intermediate_states:
        raise ValueError("return_intermediate_states=True is not available with cp_context: the "
                         "local chunk grid starts at the rank boundary, not at the sequence start")
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        if q.shape[0] != 1:
            raise ValueError(f"with cp_context the local tokens must be packed into B = 1, got B = {q.shape[0]}")
        if q.shape[1] != layout.local_length:
            raise ValueError(f"q holds T = {q.shape[1]} tokens, but cp_context gives rank {layout.rank} "
                             f"{layout.local_length} (rank_lengths {list(layout.rank_lengths)})")
    problem, _ = validate_inputs(q, k, v, g, beta, scale, None, output_final_state, layout.cu_seqlens,
                                 state_v_first, use_qk_l2norm_in_kernel, layout.cu_seqlens_cpu)
    validate_state('initial_state', initial_state, layout.num_starting, problem.HV, problem.K, problem.V,
                   state_v_first, q.device)
    validate_activations(problem.HV, problem.K, q.device, use_gate_in_kernel, A_log, dt_bias, safe_gate,
                         lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    validate_chunk_size(chunk_size)
    _expect_bool('disable_recompute', disable_recompute)


def chunk_kda_cp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    cp_context: CPContext,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_size: int = 64,
    state_v_first: bool = False,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
):
    """``chunk_kda`` on this rank's slice of a packed batch split across ``cp_context.group``.

    q, k ``[1, T_r, H, K]``, v ``[1, T_r, HV, V]``, g ``[1, T_r, HV, K]``, beta ``[1, T_r, HV]``: the
    rank's contiguous slice of the global packed tokens (``T_r = cp_context.local_length``).
    ``initial_state`` ``[cp_context.num_starting, HV, K, V]`` holds the initial states of the
    sequences that start on this rank, in order. Returns ``(o, final_state)``: ``o`` the rank's
    outputs ``[1, T_r, HV, V]``, ``final_state`` ``[cp_context.num_ending, HV, K, V]`` (float32) the
    final states of the sequences that end on this rank, or None. Concatenating every rank's
    ``o``, initial and final states in rank order gives exactly the single-process call's.
    ``cu_seqlens``/``cu_seqlens_cpu`` come from the context and must be None;
    ``return_intermediate_states`` is refused. Every other option is ``chunk_kda``'s.

    Collective: every rank of the group calls it with the same options and head sizes, and, when
    gradients are needed, runs the backward through its outputs. Gradients of q, k, v, g, beta and
    the initial states are those of the single-process call; A_log's and dt_bias' are this rank's
    share, to be summed over the group (as data-parallel gradient reduction does).
    """
    _validate(q, k, v, g, beta, scale, initial_state, output_final_state, cp_context, cu_seqlens,
              cu_seqlens_cpu, state_v_first, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
              safe_gate, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval, chunk_size,
              disable_recompute, return_intermediate_states)
    from kda.ops.chunk import chunk_kda
    layout = cp_context
    options = {'scale': scale, 'use_qk_l2norm_in_kernel': use_qk_l2norm_in_kernel,
               'use_gate_in_kernel': use_gate_in_kernel, 'A_log': A_log, 'dt_bias': dt_bias,
               'safe_gate': safe_gate, 'lower_bound': lower_bound,
               'use_beta_sigmoid_in_kernel': use_beta_sigmoid_in_kernel, 'allow_neg_eigval': allow_neg_eigval,
               'chunk_size': chunk_size, 'disable_recompute': disable_recompute}
    pieces = {'cu_seqlens': layout.cu_seqlens, 'cu_seqlens_cpu': layout.cu_seqlens_cpu}
    if state_v_first and initial_state is not None:
        initial_state = initial_state.transpose(-1, -2)
    if not layout.communicates:
        o, final = chunk_kda(q, k, v, g, beta, initial_state=initial_state,
                             output_final_state=output_final_state, **options, **pieces)
        return o, _user_state_layout(final, state_v_first)

    r = layout.rank
    enters, leaves, middle = layout.continues_in[r], layout.continues_out[r], layout.middle[r]
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    if enters and initial_state is not None:
        initial_state = torch.cat([initial_state.new_zeros(1, HV, K, V), initial_state])
    first = int(layout.cu_seqlens_cpu[1])

    def transition_pass() -> tuple[torch.Tensor, torch.Tensor]:
        """(oM [1, T0, HV, K], M [HV, K, K]) of the first piece."""
        o_m, m = chunk_kda(q[:, :first], k[:, :first], q.new_zeros(1, first, HV, K), g[:, :first],
                           beta[:, :first], initial_state=identity_states(1, HV, K, q.device),
                           output_final_state=True, **options)
        return o_m, m[0]

    transition = transitions = None
    if layout.any_middle:
        if enters:
            transition = transition_pass()
        sent = transition[1] if middle else q.new_zeros(HV, K, K, dtype=torch.float32)
        transitions = _PendingGather(sent, layout.group, layout.world_size)
    o, final = chunk_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                         **options, **pieces)
    offsets = _PendingGather(final[-1] if leaves else final.new_zeros(HV, K, V), layout.group, layout.world_size)
    if enters and transition is None:
        transition = transition_pass()
    state, o, final = _EnteringState.apply(transition[1] if middle else None, final[-1] if leaves else None,
                                           o, final, layout, offsets, transitions)
    if enters:
        o_m, m = transition
        head = (o[:, :first].float() + torch.einsum('bthk,hkv->bthv', o_m.float(), state)).to(o.dtype)
        o = head if first == o.shape[1] else torch.cat([head, o[:, first:]], 1)
        if output_final_state and layout.num_ending:
            final = torch.cat([(m @ state + final[0])[None], final[1:]])
    if not output_final_state:
        return o, None
    return o, _user_state_layout(final[:layout.num_ending], state_v_first)


def _user_state_layout(state: torch.Tensor | None, state_v_first: bool) -> torch.Tensor | None:
    if state is None or not state_v_first:
        return state
    return state.transpose(-1, -2).contiguous()
