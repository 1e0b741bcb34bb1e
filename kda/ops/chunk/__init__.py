"""``chunk_kda``: KDA by the chunkwise-parallel algorithm, training and prefill.

The sequence is cut into chunks of ``BT`` tokens (``layout``). Forward: the in-chunk stage
(``intra``: cumulative decay, decayed keys and queries, the in-chunk matrices Aqk, A' and
M = (I + diag(beta) A')^-1), then one sweep over the chunks that carries the state and forms the
outputs (``forward``); for one long sequence whose sweep leaves SMs room, both in time segments
(``schedule``). Backward (``backward``): the in-chunk tensors again (the forward's matrices
kept), the state carry, the state-gradient sweep and the per-chunk gradients. ``function``: the
autograd Function; ``api``: validation and the public ``chunk_kda``. Launch configurations:
``tuning`` (the tables) and ``launch`` (the policy over them).
"""
from kda.ops.chunk.api import chunk_kda

__all__ = ['chunk_kda']
