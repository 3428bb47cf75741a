"""The Gated DeltaNet layer of the hybrid families (Qwen3-Next, Qwen3.5) over the ragged step, with its state slots.

A layer's memory of a sequence is its state slot: the last ``W = conv_kernel - 1`` inputs of the causal depthwise
convolution (``conv`` f32[slots, W, conv_dim]) and the delta rule's matrix per value head (``rec`` f32[slots,
Hv, Dk, Dv]). In the ragged step each sequence's rows are contiguous; the slot of sequence ``s`` is
``slots[s]`` (the last column of its page-table row, ``decoder.forward``). A sequence whose first row is at
position 0 starts from zeros, so a slot is never cleared on the host: it is overwritten by its next owner's first
step. Slot 0 is scratch: padding sequences write there.

Prefill runs the delta rule in its chunked form (``chunked_delta_rule``: chunks of ``CHUNK`` rows, the state
carried over chunks by a scan; one compiled shape per token bucket whatever the mix of sequences); decode steps
(one row per sequence) run the recurrent form (``recurrent_step``) for every slot at once. ``delta_rule_reference``
is the spec both are tested against: the token-by-token recurrence of the gated delta rule.

Shapes: T rows of the step, S sequence slots of the step, C hidden size, Hk key heads of Dk, Hv value heads of Dv,
W the convolution's state width, X conv_dim (q, k and v channels).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.config import ModelConfig
from jaxserve.models.modules import Linear

CHUNK = 16  # rows per chunk of the chunked delta rule


def _param(shape, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=(None,) * len(shape))  # replicated over the mesh


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / |x| over the last axis (eps inside the root, as the reference kernels do); f32 in, f32 out."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm of ``x`` (dt[..., Dv]) by a plain ``weight`` (dt[Dv]), then times silu(gate) in f32; dt[..., Dv]."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = weight * xf.astype(x.dtype)
    return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def recurrent_step(state, q, k, v, g, beta):
    """One token of the gated delta rule for a batch of states: state f32[B, Hv, Dk, Dv]; q, k f32[B, Hv, Dk]
    (normalised, q scaled); v f32[B, Hv, Dv]; g, beta f32[B, Hv]. Returns (the new state, out f32[B, Hv, Dv])."""
    state = state * jnp.exp(g)[..., None, None]
    kv_mem = jnp.einsum("bhkv,bhk->bhv", state, k)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return state, jnp.einsum("bhkv,bhk->bhv", state, q)


def delta_rule_reference(q, k, v, g, beta, init):
    """The spec: the recurrence token by token over one sequence. q, k f32[T, Hv, Dk]; v f32[T, Hv, Dv]; g, beta
    f32[T, Hv]; init f32[Hv, Dk, Dv]. Returns (out f32[T, Hv, Dv], final state)."""

    def body(state, xs):
        state, out = recurrent_step(state[None], *(a[None] for a in xs))
        return state[0], out[0]

    final, out = jax.lax.scan(body, init, (q, k, v, g, beta))
    return out, final


def _unit_lower_inverse(a: jax.Array) -> jax.Array:
    """(I + a)^-1 for strictly lower triangular a f32[..., c, c] (c a power of two): a is nilpotent, so
    1 / (1 + a) = (1 - a)(1 + a^2)(1 + a^4)...; a few matmuls, which compile and run faster than a triangular
    solve."""
    eye = jnp.eye(a.shape[-1], dtype=a.dtype)
    inv, power = eye - a, a
    for _ in range(a.shape[-1].bit_length() - 2):
        power = power @ power
        inv = inv @ (eye + power)
    return inv


def chunked_delta_rule(q, k, v, g, beta, seq, init):
    """The gated delta rule over the packed rows of many sequences, in chunks of ``CHUNK`` rows.

    Within a chunk the rows of one sequence interact through the WY form of the delta rule (a triangular solve);
    rows of different sequences never do (the pairwise mask). The state carried from chunk to chunk is one per
    step slot (``num_seqs_state`` of them, f32[S, Hv, Dk, Dv], starting from ``init``): each row reads and writes
    its own sequence's.

    Args:
      q, k: f32[T, Hv, Dk] (normalised; q scaled). v: f32[T, Hv, Dv]. g, beta: f32[T, Hv].
      seq: i32[T] each row's slot of the step (rows of no sequence: any, with ``beta`` 0 and ``g`` 0).
      init: f32[S, Hv, Dk, Dv] each step slot's state before the step (zeros for a sequence that starts).
    Returns:
      (out f32[T, Hv, Dv], the final states f32[S, Hv, Dk, Dv]).
    """
    t, hv, dk = k.shape
    dv = v.shape[-1]
    n = -(-t // CHUNK)
    pad = n * CHUNK - t
    padrows = lambda a, fill=0: jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1), constant_values=fill)  # noqa: E731
    q, k, v, g, beta = (padrows(a) for a in (q, k, v, g, beta))
    seq = padrows(seq, -1)
    chunks = lambda a: a.reshape(n, CHUNK, *a.shape[1:])  # noqa: E731
    q, k, v, g, beta, seq = map(chunks, (q, k, v, g, beta, seq))
    tri = jnp.tril(jnp.ones((CHUNK, CHUNK), bool))  # bool[c, c]  (row i, column j): j <= i
    strict = jnp.tril(jnp.ones((CHUNK, CHUNK), bool), -1)

    def body(states, xs):
        qc, kc, vc, gc, bc, sc = xs  # f32[c, Hv, Dk] ... i32[c]
        same = sc[:, None] == sc[None, :]  # bool[c, c]: rows of one sequence
        # Cumulative log decay per row within its own sequence's part of the chunk (the decay since the chunk's
        # first row of that sequence).
        gcum = jnp.einsum("ij,jh->ih", (tri & same).astype(jnp.float32), gc)  # f32[c, Hv]
        # The state each row starts from: its sequence's state at the chunk start.
        s0 = states[jnp.maximum(sc, 0)]  # f32[c, Hv, Dk, Dv]
        decay = jnp.where((tri & same)[:, :, None], jnp.exp(jnp.minimum(gcum[:, None] - gcum[None, :], 0.0)), 0.0)
        # WY form: u_i = beta_i (v_i - exp(gcum_i) k_i S0 - sum_{j<i} decay_ij (k_i.k_j) u_j)
        kk = jnp.einsum("ihd,jhd->hij", kc, kc)  # f32[Hv, c, c]
        a = (jnp.where(strict[None], 1.0, 0.0) * jnp.transpose(decay, (2, 0, 1)) * kk) * bc.T[:, :, None]
        rhs = bc[:, :, None] * (vc - jnp.exp(gcum)[:, :, None] * jnp.einsum("ihkv,ihk->ihv", s0, kc))  # f32[c,Hv,Dv]
        u = jnp.einsum("hij,jhv->hiv", _unit_lower_inverse(a), rhs)  # f32[Hv, c, Dv]
        # Outputs: o_i = exp(gcum_i) q_i S0 + sum_{j<=i} decay_ij (q_i.k_j) u_j
        qk = jnp.einsum("ihd,jhd->hij", qc, kc) * jnp.transpose(decay, (2, 0, 1))  # f32[Hv, c, c]
        out = (jnp.exp(gcum)[:, :, None] * jnp.einsum("ihkv,ihk->ihv", s0, qc)
               + jnp.transpose(jnp.einsum("hij,hjv->hiv", qk, u), (1, 0, 2)))  # f32[c, Hv, Dv]
        # New state of each sequence present: S0 * exp(total) + sum_j exp(total - gcum_j) k_j u_j^T over its rows.
        onehot = (sc[:, None] == jnp.arange(states.shape[0])[None, :]).astype(jnp.float32)  # f32[c, S]
        total = jnp.einsum("is,ih->sh", onehot, gc)  # f32[S, Hv]: sum of g over its rows
        present = onehot.sum(0) > 0  # bool[S]
        tail = jnp.exp(jnp.einsum("is,sh->ih", onehot, total) - gcum)  # f32[c, Hv]: decay from row j to the end
        upd = jnp.einsum("is,ihk,hiv->shkv", onehot, kc * tail[:, :, None], u)  # f32[S, Hv, Dk, Dv]
        new = states * jnp.exp(total)[:, :, None, None] + upd
        return jnp.where(present[:, None, None, None], new, states), out

    states, out = jax.lax.scan(body, init, (q, k, v, g, beta, seq))
    return out.reshape(n * CHUNK, hv, dv)[:t], states


class ConvWeight(nnx.Module):
    def __init__(self, channels: int, width: int, dtype):
        self.weight = _param((channels, 1, width), dtype)  # dt[X, 1, K]: the checkpoint's depthwise Conv1d layout


class GatedNorm(nnx.Module):
    def __init__(self, dim: int, dtype):
        self.weight = _param((dim,), dtype)  # dt[Dv]


class GatedDeltaNet(nnx.Module):
    """Projections in (fused, Qwen3-Next; or separate, Qwen3.5), the short causal convolution and silu, the gated
    delta rule, its gated RMSNorm, the projection out. Parameter names are the checkpoints'."""

    def __init__(self, cfg: ModelConfig, dtype):

        la, h = cfg.linear_attention, cfg.hidden_size
        lin = lambda i, o: Linear(i, o, bias=False, dtype=dtype, axes=(None, None))  # noqa: E731
        if la.fused_projections:
            self.in_proj_qkvz = lin(h, 2 * la.key_dim + 2 * la.value_dim)
            self.in_proj_ba = lin(h, 2 * la.num_v_heads)
        else:
            self.in_proj_qkv = lin(h, la.conv_dim)
            self.in_proj_z = lin(h, la.value_dim)
            self.in_proj_b = lin(h, la.num_v_heads)
            self.in_proj_a = lin(h, la.num_v_heads)
        self.conv1d = ConvWeight(la.conv_dim, la.conv_kernel, dtype)
        self.dt_bias = _param((la.num_v_heads,), dtype)
        self.A_log = _param((la.num_v_heads,), dtype)
        self.norm = GatedNorm(la.head_v_dim, dtype)
        self.out_proj = lin(la.value_dim, h)
        self.la, self.eps = la, cfg.rms_norm_eps

    def _project(self, x):
        """x dt[T, C] -> (mixed qkv dt[T, X], z dt[T, Hv, Dv], b dt[T, Hv], a dt[T, Hv])."""
        la, t = self.la, x.shape[0]
        r = la.num_v_heads // la.num_k_heads
        if not la.fused_projections:
            return (self.in_proj_qkv(x), self.in_proj_z(x).reshape(t, la.num_v_heads, la.head_v_dim),
                    self.in_proj_b(x), self.in_proj_a(x))
        qkvz = self.in_proj_qkvz(x).reshape(t, la.num_k_heads, 2 * la.head_k_dim + 2 * r * la.head_v_dim)
        ba = self.in_proj_ba(x).reshape(t, la.num_k_heads, 2 * r)
        dk, rv = la.head_k_dim, r * la.head_v_dim
        q, k, v, z = (qkvz[..., :dk], qkvz[..., dk:2 * dk], qkvz[..., 2 * dk:2 * dk + rv], qkvz[..., 2 * dk + rv:])
        mixed = jnp.concatenate([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], axis=-1)
        return (mixed, z.reshape(t, la.num_v_heads, la.head_v_dim), ba[..., :r].reshape(t, -1),
                ba[..., r:].reshape(t, -1))

    def __call__(self, x, conv_state=None, rec_state=None, md=None, slots=None, decode: bool = False):
        """x: dt[T, C] rows of a ragged step; ``md`` its metadata (one replica: cu_q_lens i32[S + 1], kv_lens
        i32[S], num_seqs i32[1]) and ``slots`` i32[S] each sequence's state slot; the states f32[slots, W, X] and
        f32[slots, Hv, Dk, Dv]. Without ``md``: one whole sequence from zeros (the full-sequence path), states
        untouched. Returns (dt[T, C], conv_state, rec_state)."""
        la, t, w = self.la, x.shape[0], self.la.conv_kernel - 1
        mixed, z, b, a = self._project(x)
        if md is None:  # one sequence from its start
            seq = jnp.zeros(t, jnp.int32)
            off = jnp.arange(t, dtype=jnp.int32)
            valid = jnp.ones(t, bool)
            conv0 = jnp.zeros((1, w, la.conv_dim), jnp.float32)
            rec0 = jnp.zeros((1, *la.recurrent_state_shape()), jnp.float32)
            cu = jnp.array([0, t], jnp.int32)
            q_lens = cu[1:] - cu[:-1]
        else:
            cu, n = md.cu_q_lens, md.num_seqs[0]
            s = md.kv_lens.shape[0]
            rows = jnp.arange(t, dtype=jnp.int32)
            seq = jnp.clip(jnp.searchsorted(cu[1:], rows, side="right"), 0, s - 1).astype(jnp.int32)
            valid = rows < cu[n]
            off = rows - cu[seq]
            q_lens = cu[1:] - cu[:-1]  # i32[S]
            fresh = (md.kv_lens - q_lens) <= 0  # bool[S]: the step starts the sequence
            # A negative slot (a step verifying drafts) reads the state but writes the scratch slot: the state
            # does not advance until the accepted tokens are replayed (scheduler._update_speculated).
            keep = slots >= 0
            slots = jnp.abs(slots)
            conv0 = jnp.where(fresh[:, None, None], 0.0, conv_state[slots])  # f32[S, W, X]
            rec0 = jnp.where(fresh[:, None, None, None], 0.0, rec_state[slots])  # f32[S, Hv, Dk, Dv]
        xf = mixed.astype(jnp.float32)  # f32[T, X]
        # Each row's convolution window: its own earlier rows, else the sequence's saved inputs.
        weight = self.conv1d.weight[...][:, 0, :].astype(jnp.float32)  # f32[X, K]

        def window_value(rel, row, sq):  # rel: position in the step of the input; row: its row if rel >= 0
            return jnp.where((rel >= 0)[:, None], xf[jnp.clip(row, 0, t - 1)],
                             conv0[sq, jnp.clip(w + rel, 0, w - 1)])

        conv = jnp.zeros_like(xf)
        for k in range(w + 1):  # lag w - k
            lag = w - k
            conv = conv + weight[:, k][None] * window_value(off - lag, jnp.arange(t) - lag, seq)
        conv = jax.nn.silu(conv).astype(x.dtype)  # dt[T, X]
        q = conv[:, : la.key_dim].reshape(t, la.num_k_heads, la.head_k_dim)
        k = conv[:, la.key_dim: 2 * la.key_dim].reshape(t, la.num_k_heads, la.head_k_dim)
        v = conv[:, 2 * la.key_dim:].reshape(t, la.num_v_heads, la.head_v_dim)
        beta = jax.nn.sigmoid(b)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))  # f32[T, Hv]
        r = la.num_v_heads // la.num_k_heads
        q = l2norm(jnp.repeat(q, r, axis=1).astype(jnp.float32)) * la.head_k_dim ** -0.5  # f32[T, Hv, Dk]
        k = l2norm(jnp.repeat(k, r, axis=1).astype(jnp.float32))
        v = v.astype(jnp.float32)
        beta = jnp.where(valid[:, None], beta.astype(jnp.float32), 0.0)  # rows of no sequence leave states alone
        g = jnp.where(valid[:, None], g, 0.0)
        if decode and md is not None:  # one row per sequence slot: the recurrent form, every slot at once
            final, out = recurrent_step(rec0, q, k, v, g, beta)
        else:
            out, final = chunked_delta_rule(q, k, v, g, beta, seq, rec0)
        core = gated_rms_norm(out.astype(x.dtype), z, self.norm.weight[...], self.eps)  # dt[T, Hv, Dv]
        y = self.out_proj(core.reshape(t, la.value_dim))
        if md is None:
            return y, conv_state, rec_state
        # The states after the step: the last W inputs of each sequence, and its delta-rule state.
        last = cu[1:] - 1  # i32[S]: each sequence's last row
        idx = jnp.arange(w)
        rel = q_lens[:, None] - w + idx[None, :]  # i32[S, W]
        sq = jnp.broadcast_to(jnp.arange(q_lens.shape[0])[:, None], rel.shape)
        new_conv = jnp.where((rel >= 0)[..., None], xf[jnp.clip(last[:, None] - (w - 1) + idx[None, :], 0, t - 1)],
                             conv0[sq, jnp.clip(w + rel, 0, w - 1)])  # f32[S, W, X]
        has_rows = q_lens > 0
        new_conv = jnp.where(has_rows[:, None, None], new_conv, conv0)
        target = jnp.where(has_rows & keep, slots, 0)  # padding and verifying sequences write the scratch slot
        conv_state = conv_state.at[target].set(new_conv.astype(conv_state.dtype))
        rec_state = rec_state.at[target].set(final.astype(rec_state.dtype))
        return y, conv_state, rec_state
