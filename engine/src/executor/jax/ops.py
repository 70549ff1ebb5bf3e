# ---------------------------------------------------------------------------------------------
# autopar's JAX ops: the model's ops in jax.numpy on one data-parallel replica's whole tensors,
# as autopar's CPU executor computes them. Shared by exported plans and `profile run --backend
# jax`.
# ---------------------------------------------------------------------------------------------

NORM_EPS = np.float32(1e-5)
ROPE_THETA = np.float32(10000.0)


def zigzag_position(j, s, cp):
    """The true position of stored row j of a sequence of s split over cp ranks in
    Megatron-Core's load-balanced order (rank r holds chunks r and 2cp-1-r)."""
    chunk = s // max(2 * cp, 1)
    if cp <= 1 or chunk == 0:
        return j
    u, within = j // chunk, j % chunk
    rank = u // 2
    true_chunk = rank if u % 2 == 0 else 2 * cp - 1 - rank
    return true_chunk * chunk + within


def positions(s):
    return np.array([zigzag_position(j, s, CP) for j in range(s)], dtype=np.int32)


def embedding(ids, table, shard=None, grad_spec=None, table_spec=None):
    """Row gather. Its gradient is read as `grad_spec` and added into the table's rows where
    they are (`table_spec`): with the table split by rows, every device adds into its own
    rows, as Megatron-LM's vocabulary-parallel embedding does, instead of XLA's default of
    adding into a whole table and reducing it."""

    @jax.custom_vjp
    def gather(ids, table):
        return jnp.take(table, ids, axis=0, mode="clip")

    def forward(ids, table):
        return gather(ids, table), (ids, table)

    def backward(saved, dy):
        ids, table = saved
        if shard is not None:
            dy = shard(dy, grad_spec)
        grad = jnp.zeros_like(table).at[ids].add(dy)
        return None, grad if shard is None else shard(grad, table_spec)

    gather.defvjp(forward, backward)
    return gather(ids, table)


def matmul(x, w, transpose_b=False):
    # x's trailing axes make the reduction (the attention core's [b, s, heads, d] output).
    k = w.shape[1] if transpose_b else w.shape[0]
    i = next((i for i in range(x.ndim) if int(np.prod(x.shape[i:])) == k), None)
    x = x.reshape(x.shape[:i] + (k,)) if i is not None else x.reshape(-1, k)
    return jnp.matmul(x, w.T if transpose_b else w)


def batch_matmul(a, b, transpose_b=False):
    # b's leading axes may divide a's: consecutive heads of a share one of b (grouped queries).
    for ax in range(a.ndim - 2):
        if b.shape[ax] != a.shape[ax]:
            b = jnp.repeat(b, a.shape[ax] // b.shape[ax], axis=ax)
    return jnp.matmul(a, jnp.swapaxes(b, -1, -2) if transpose_b else b)


def layer_norm(x, gain, bias):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + NORM_EPS) * gain + bias


def rms_norm(x, gain):
    var = jnp.mean(x * x, axis=-1, keepdims=True)
    return x / jnp.sqrt(var + NORM_EPS) * gain


def causal_softmax(x, scale):
    rows, cols = x.shape[-2], x.shape[-1]
    live = np.arange(cols)[None, :] <= np.arange(rows)[:, None]
    z = jnp.where(live, x * scale, -jnp.inf)
    return jax.nn.softmax(z, axis=-1)


def gelu(x):
    return 0.5 * x * (1 + jnp.tanh(np.float32(0.7978846) * (x + np.float32(0.044715) * x * x * x)))


def silu(x):
    return x * jax.nn.sigmoid(x)


def swiglu(x, pieces=1):
    # `pieces` devices each hold a slice of both halves, stored contiguously.
    w = x.shape[-1]
    x = x.reshape(x.shape[:-1] + (pieces, w // pieces))
    f = w // pieces // 2
    y = silu(x[..., :f]) * x[..., f:]
    return y.reshape(y.shape[:-2] + (w // 2,))


def rope(x):
    s, d = x.shape[-2], x.shape[-1]
    half = d // 2
    freq = ROPE_THETA ** (np.float32(-2.0) * np.arange(half, dtype=np.float32) / np.float32(d))
    angle = positions(s).astype(np.float32)[:, None] * freq[None, :]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def attention(q, k, v, scale, causal=True):
    """q [b, h, s, d], k and v [b, g, s, d] -> token-major [b, s, h, d]."""
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    scores = jnp.matmul(q, jnp.swapaxes(k, -1, -2)) * scale
    if causal:
        pos = positions(q.shape[2])
        scores = jnp.where(pos[None, :] <= pos[:, None], scores, -jnp.inf)
    out = jnp.matmul(jax.nn.softmax(scores, axis=-1), v)
    return jnp.swapaxes(out, 1, 2)


def ring_attention(q, k, v, scale, shard, axes, causal=True):
    """Attention of q [b, h, s, d] against k, v [b, g, s, d], each split along the sequence
    over mesh axes `axes` (the context-parallel ranks): every rank keeps its queries and passes
    its key/value block round the ring, one step per rank (ring attention, Megatron-Core's
    `AttnFuncWithCPAndKVP2P`), merging blocks through each row's log-sum-exp. The backward
    passes each block with its gradient and brings the gradients home after the last step, as
    autopar's CPU executor does: 2 n - 1 collective permutes per call on n ranks. Returns the
    token-major [b, s, h, d]."""
    mesh = shard.mesh
    n = int(np.prod([mesh.shape[a] for a in axes]))
    s = q.shape[2]
    table = np.asarray(positions(s))
    ring = [(i, (i + 1) % n) for i in range(n)]

    def shift(x):
        return jax.lax.ppermute(x, axes, ring) if n > 1 else x

    def mask_of(rank, step, sl):
        qpos = jax.lax.dynamic_slice(table, (rank * sl,), (sl,))
        owner = (rank + n - step) % n
        kpos = jax.lax.dynamic_slice(table, (owner * sl,), (sl,))
        return kpos[None, :] <= qpos[:, None]

    def scores(q, k, rank, step):
        x = jnp.matmul(q, jnp.swapaxes(k, -1, -2)) * scale
        if causal:
            x = jnp.where(mask_of(rank, step, q.shape[2]), x, -jnp.inf)
        return x

    def heads(x, group):
        return jnp.repeat(x, group, axis=1)

    def fold(x, group):
        return x.reshape((x.shape[0], x.shape[1] // group, group) + x.shape[2:]).sum(axis=2)

    def forward(q, k, v):
        rank = jax.lax.axis_index(axes) if n > 1 else 0
        group = q.shape[1] // k.shape[1]
        out = jnp.zeros(q.shape, q.dtype)
        lse = jnp.full(q.shape[:-1], -jnp.inf, q.dtype)
        kv = jnp.stack([k, v])
        for step in range(n):
            if step > 0:
                kv = shift(kv)
            x = scores(q, heads(kv[0], group), rank, step)
            merged = jnp.logaddexp(lse, jax.nn.logsumexp(x, axis=-1))
            out = out * jnp.exp(lse - merged)[..., None] + jnp.matmul(
                jnp.exp(x - merged[..., None]), heads(kv[1], group))
            lse = merged
        return out, lse

    @jax.custom_vjp
    def local(q, k, v):
        return forward(q, k, v)[0]

    def local_fwd(q, k, v):
        out, lse = forward(q, k, v)
        return out, (q, k, v, out, lse)

    def local_bwd(saved, dout):
        q, k, v, out, lse = saved
        rank = jax.lax.axis_index(axes) if n > 1 else 0
        group = q.shape[1] // k.shape[1]
        delta = jnp.sum(dout * out, axis=-1)
        dq = jnp.zeros_like(q)
        state = jnp.stack([k, v, jnp.zeros_like(k), jnp.zeros_like(v)])
        for step in range(n):
            if step > 0:
                state = shift(state)
            kb, vb = heads(state[0], group), heads(state[1], group)
            p = jnp.exp(scores(q, kb, rank, step) - lse[..., None])
            dv = jnp.matmul(jnp.swapaxes(p, -1, -2), dout)
            ds = scale * p * (jnp.matmul(dout, jnp.swapaxes(vb, -1, -2)) - delta[..., None])
            dq = dq + jnp.matmul(ds, kb)
            dk = jnp.matmul(jnp.swapaxes(ds, -1, -2), q)
            state = state.at[2].add(fold(dk, group)).at[3].add(fold(dv, group))
        grads = shift(state[2:]) if n > 1 else state[2:]
        return dq, grads[0], grads[1]

    local.defvjp(local_fwd, local_bwd)
    seq = P(None, None, axes, None)

    def body(q, k, v):
        return jnp.swapaxes(local(q, k, v), 1, 2)

    return jax.shard_map(body, mesh=mesh, in_specs=(seq, seq, seq), out_specs=P(None, axes, None, None),
                         axis_names=set(axes), check_vma=False)(q, k, v)


def cross_entropy(logits, labels):
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(lse - target)


def split(x, parts, pieces=1, heads=None):
    """The last axis cut into `parts` (stored `pieces`-wise); a part with an entry in `heads`
    is viewed as [b, n, s, d]."""
    w = x.shape[-1]
    x = x.reshape(x.shape[:-1] + (pieces, w // pieces))
    out, at = [], 0
    for i, p in enumerate(parts):
        y = x[..., at // pieces:(at + p) // pieces].reshape(x.shape[:-2] + (p,))
        if heads and heads[i]:
            n = heads[i]
            y = jnp.swapaxes(y.reshape(y.shape[:-1] + (n, p // n)), 1, y.ndim - 1)
        out.append(y)
        at += p
    return out


def moe_router(scores, k):
    """Megatron-Core's default router: each token's k highest scores (ties to the lower
    expert), its gates the softmax of those scores. Gates [.., k] and experts [.., k]."""
    top, experts = jax.lax.top_k(scores, k)
    return jax.nn.softmax(top, axis=-1), experts


def moe_slots(experts, gates, count, capacity, drop):
    """The slot of every (token, choice) in its expert's buffer, in token order, and whether it
    is kept. Past the capacity, a plan that drops tokens keeps the highest gates (ties to the
    earlier token, Megatron-Core's `--moe-token-drop-policy probs`); a dropless plan sized its
    buffers for every token, and what would not fit is left out (autopar's CPU executor stops
    with an error there)."""
    flat = experts.reshape(-1)
    n = flat.shape[0]
    order = jnp.arange(n)
    if drop:
        g = jax.lax.stop_gradient(gates).reshape(-1)
        # Rank within its expert by gate, highest first, the earlier token on a tie.
        ranked = jnp.lexsort((order, -g, flat))
        start = jnp.searchsorted(flat[ranked], jnp.arange(count))
        rank = jnp.zeros(n, jnp.int32).at[ranked].set(order - start[flat[ranked]])
        kept = rank < capacity
    else:
        kept = jnp.ones(n, bool)
    onehot = jax.nn.one_hot(flat, count, dtype=jnp.int32) * kept[:, None]
    slot = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), flat[:, None], axis=1)[:, 0] - 1
    return slot, kept & (slot < capacity)


def moe_dispatch(x, experts, gates, shape, drop):
    """Tokens [.., h] copied into their chosen experts' buffers [E, C, h]."""
    count, capacity, h = shape
    k = experts.shape[-1]
    slot, kept = moe_slots(experts, gates, count, capacity, drop)
    tokens = jnp.repeat(x.reshape(-1, h), k, axis=0) * kept[:, None]
    where = jnp.where(kept, slot, capacity)
    return jnp.zeros(shape, x.dtype).at[experts.reshape(-1), where].add(tokens, mode="drop")


def moe_combine(y, gates, experts, drop):
    """Every token's gate-weighted sum of its experts' outputs y [E, C, h]."""
    count, capacity, h = y.shape
    k = experts.shape[-1]
    slot, kept = moe_slots(experts, gates, count, capacity, drop)
    picked = y[experts.reshape(-1), jnp.clip(slot, 0, capacity - 1)] * kept[:, None]
    out = (picked.reshape(-1, k, h) * gates.reshape(-1, k, 1)).sum(axis=1)
    return out.reshape(experts.shape[:-1] + (h,))


