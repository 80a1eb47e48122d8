"""Gated DeltaNet (Qwen3.5, Qwen3-Next) in Triton: the chunked forward and backward, and the token-by-token recurrence.

The recurrence. Per value head, a state ``S [K, V]`` (fp32) and per token ``t``::

    S_t = e^{g_t} S_{t-1} + β_t k_t (v_t − e^{g_t} S_{t-1}ᵀ k_t)ᵀ          o_t = scale · S_tᵀ q_t

(decay, then the delta rule: ``S`` learns ``k_t → v_t`` with rate ``β_t``). Value head ``j`` reads query/key head
``j // (HV / H)`` (grouped value attention).

The chunked form. Cut the sequence into chunks of ``C = 64`` tokens (never across a document); inside a chunk
let ``Γ_i = g_1 + … + g_i`` (log decay from the chunk start) and ``S`` the state the chunk starts from. Unrolling the
recurrence over the chunk gives a unit lower-triangular system for the values the state must still learn::

    A_ij = β_i (k_i · k_j) e^{Γ_i − Γ_j}  (i > j),    T = (I + A)⁻¹          (the WY / UT transform)
    w = T (β k e^Γ),   u = T (β v)                                        (per chunk, independent of S)
    v_new = u − w S                                                        (what S does not predict yet)
    o = scale [ (q e^Γ) S + (q kᵀ ⊙ e^{Γ_i − Γ_j}, i >= j) v_new ]
    S_end = e^{Γ_C} S + (k e^{Γ_C − Γ})ᵀ v_new

so only the last line is sequential (one small matmul per chunk), and everything else is chunk-local matmuls. Every
exponent above is ``<= 0`` for ``g <= 0`` (masked before ``exp``): no overflow whatever the decay.

Forward, three launches (:mod:`.forward`): the WY kernel (per chunk and value head: ``Γ``, ``A``, ``T`` by forward
substitution in registers, ``w``, ``u``), the state pass (per document, value head and 64 state columns: stores each
chunk's starting state ``h``, ``v_new``, the final state) and the output (per chunk). ``fused_recurrent`` runs the
recurrence itself, one program per (document, value head, state columns) with the state in registers.

Backward (:mod:`.backward`). Nothing but the inputs is saved: the WY kernel (now also storing ``T``) and the state
pass run again (about one more forward) instead of ``[chunks, HV, K, V]`` of states being kept from the forward to
the backward. With ``dS`` the gradient at a chunk's end::

    dv_new = Pᵀ dO + (k e^{Γ_C − Γ}) dS                  (P = scale q kᵀ ⊙ e^{Γ_i − Γ_j}, i >= j)
    dS_start = e^{Γ_C} dS + scale (q e^Γ)ᵀ dO − wᵀ dv_new  (the sequential pass, backwards over chunks)

then per chunk: ``dq`` and ``dk`` from the two output terms and ``S_end``; ``du = dv_new`` and ``dw = −dv_new Sᵀ``;
through the transform ``d(βv) = Tᵀ du``, ``d(βke^Γ) = Tᵀ dw``, ``dT = du (βv)ᵀ + dw (βke^Γ)ᵀ`` and ``dA = −Tᵀ dT
Tᵀ`` (below the diagonal) into ``dk``, ``dβ`` and ``dΓ``; finally ``dg`` is the reverse running sum of ``dΓ``. The
initial state's gradient is ``dS_start`` of each document's first chunk.

Numerics: every matmul takes fp32 tiles (16-bit inputs are widened on load; their dots run as TF32 on the GPU, fp32
inputs follow ``torch.get_float32_matmul_precision``), the state and all intermediates are fp32, the output is in
v's dtype. ``cu_seqlens`` needs no host sync: the chunk table is built on the device with a grid bounded by
``(tokens + docs·(C − 1)) / C`` (:func:`.interface.chunk_table`). With ``use_qk_l2norm_in_kernel`` the entry points
normalise q and k in fp32 before the kernels (differentiable); the recurrent kernel does it itself when no gradient
is needed.
"""

from .interface import GatedDeltaRuleFunction, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

__all__ = ["GatedDeltaRuleFunction", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
