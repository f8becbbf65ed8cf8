"""The gated delta rule (Gated DeltaNet's recurrence), chunked, in plain PyTorch.

Per head, a state S [key_dim, value_dim] is carried along the sequence. At step t it decays
by exp(g_t) (g_t <= 0), then moves towards storing value v_t under key k_t with step size
beta_t (the delta rule: it writes only what it does not already predict), and the output
reads it with the query:

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

Step by step that is a sequential loop over tokens. The chunked form below runs the tokens
of a chunk of C at once with matrix products: within a chunk the corrections
u_r = beta_r (v_r - S_{r-1}^T k_r) satisfy a unit lower-triangular system (each correction
depends on the earlier ones of its chunk), solved in one triangular solve; only the state
crosses chunk boundaries, one small loop step per chunk. Work is O(T C (d_k + d_v)) +
O(T d_k d_v): linear in the sequence length T.

Document boundaries restart the state: at a token that begins a document the state is zero
before its update. In chunked form a reset cuts every decay product that spans it, which is
a mask on the within-chunk decays, on the state read and on what reaches the chunk's end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def document_starts(documents: torch.Tensor) -> torch.Tensor:
    """[b, T] document numbers -> [b, T] bool, true where a token begins a new document
    (never at position 0: whether the first token restarts is the caller's to say)."""
    starts = torch.zeros_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return starts


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    resets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over q, k [b, h, T, d_k], v [b, h, T, d_v], log-decays g and
    step sizes beta [b, h, T], computed ``chunk_size`` tokens at a time.

    ``initial_state`` [b, h, d_k, d_v] is the state before the first token (zero if None);
    ``resets`` [b, T] bool marks tokens whose document begins there (the state is zero
    before their update). Returns the outputs [b, h, T, d_v] and the state after the last
    token [b, h, d_k, d_v]. Queries are used as given (scale them before). The arithmetic is
    in float32 at least; outputs come back in v's dtype, the state in that wider dtype.
    """
    b, h, T, dk = k.shape
    dv = v.shape[-1]
    out_dtype = v.dtype
    wide = torch.promote_types(v.dtype, torch.float32)
    q, k, v, g, beta = (x.to(wide) for x in (q, k, v, g, beta))
    C = chunk_size
    pad = (-T) % C
    if pad:  # padded steps: zero key and step size, no decay, so the state passes unchanged
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (T + pad) // C
    q, k, v = (x.reshape(b, h, n, C, -1) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, C), beta.reshape(b, h, n, C)

    cum = g.cumsum(-1)  # log of the decay from the chunk's start through each token
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if resets is None:
        same = causal  # [C, C]: pair (r, j) with j <= r shares a document
        fresh = torch.ones(1, dtype=torch.bool, device=q.device)  # no reset yet at r
        ends = torch.ones(1, dtype=torch.bool, device=q.device)  # j's document reaches the end
    else:
        flags = F.pad(resets, (0, pad)).reshape(b, 1, n, C).to(torch.int64)
        segment = flags.cumsum(-1)  # which document piece of its chunk a token is in
        same = causal & (segment.unsqueeze(-1) == segment.unsqueeze(-2))
        fresh = segment == 0
        ends = segment == segment[..., -1:]
    # exp of differences only where they are <= 0 (masked pairs would overflow).
    diff = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~same, float("-inf"))
    decay = diff.exp()  # [b, h, n, C, C]: decay from after token j through token r, or 0
    read = cum.exp() * fresh  # [b, h, n, C]: decay of the chunk's initial state at token r
    to_end = (cum[..., -1:] - cum).exp() * ends  # decay from after token j to the chunk's end
    carry = cum[..., -1].exp() * fresh[..., -1]  # decay of the initial state to the end

    # Corrections u solve (I + A) u = beta v - beta read k S0, A strictly lower triangular.
    kk = k @ k.transpose(-1, -2)
    system = torch.eye(C, dtype=wide, device=q.device) + (beta.unsqueeze(-1) * kk * decay).tril(-1)
    bv = beta.unsqueeze(-1) * v
    bk = (beta * read).unsqueeze(-1) * k
    solved = torch.linalg.solve_triangular(system, torch.cat([bv, bk], -1), upper=False)
    u_free, u_state = solved[..., :dv], solved[..., dv:]  # u = u_free - u_state @ S0
    attn = (q @ k.transpose(-1, -2)) * decay  # within the chunk, token j <= r
    q_read = q * read.unsqueeze(-1)
    k_end = k * to_end.unsqueeze(-1)

    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(wide)
    outs = []
    for i in range(n):
        u = u_free[:, :, i] - u_state[:, :, i] @ state
        outs.append(q_read[:, :, i] @ state + attn[:, :, i] @ u)
        state = carry[:, :, i, None, None] * state + k_end[:, :, i].transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2).reshape(b, h, n * C, dv)[:, :, :T]
    return out.to(out_dtype), state
