# ---------------------------------------------------------------------------------------------
# autopar's JAX runtime: the same in every exported plan. The plan-specific part (meshes,
# shardings, the model's chunks and the schedule) is above; this part defines the ops in
# jax.numpy, the synthetic data and weights (bit-identical to autopar's CPU executor), the
# pipeline driver and Adam.
# ---------------------------------------------------------------------------------------------

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
LR, BETA1, BETA2, ADAM_EPS = np.float32(1e-3), np.float32(0.9), np.float32(0.95), np.float32(1e-8)
NORM_EPS = np.float32(1e-5)
ROPE_THETA = np.float32(10000.0)


def noise(*parts):
    """Values in [-1, 1) from a seed and a position (splitmix64; parts may be arrays)."""
    shape = np.broadcast_shapes(*[np.shape(p) for p in parts])
    z = np.full(shape, GOLDEN, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for p in parts:
            z = z + np.asarray(p, dtype=np.uint64) + GOLDEN
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)).astype(np.float32) / np.float32(1 << 24) * np.float32(2) - np.float32(1)


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


def storage_index(parts, pieces):
    """Where each stored element of an axis made of `parts` split over `pieces` devices comes
    from: piece r holds slice r of every part, contiguously."""
    index, offsets = [], np.cumsum([0] + list(parts))
    for r in range(pieces):
        for o, p in zip(offsets, parts):
            index.extend(range(o + r * p // pieces, o + (r + 1) * p // pieces))
    return np.array(index)


def to_storage(name, whole):
    if name not in STORAGE:
        return whole
    axis, parts, pieces = STORAGE[name]
    return np.take(whole, storage_index(parts, pieces), axis=axis)


def to_whole(name, stored):
    if name not in STORAGE:
        return stored
    axis, parts, pieces = STORAGE[name]
    return np.take(stored, np.argsort(storage_index(parts, pieces)), axis=axis)


def initial_parameter(seed, name):
    value, shape, init = PARAMETERS[name]
    u = noise(seed, 1, value, np.arange(int(np.prod(shape)), dtype=np.uint64)).reshape(shape)
    if init == "weight":
        w = u * np.float32(0.02)
    elif init == "gain":
        w = np.float32(1) + u * np.float32(0.1)
    else:
        w = u * np.float32(0.1)
    return to_storage(name, w)


def input_batch(seed, step, microbatch, name):
    """Micro-batch `microbatch` of fed input `name`, every data-parallel replica's: [dp, mb, ...]."""
    value, shape, bound = INPUTS[name]
    per_seq = int(np.prod(shape[1:]))
    mb = shape[0]
    seq = np.array([[(d * MICROBATCHES + microbatch) * mb + i for i in range(mb)] for d in range(DP)],
                   dtype=np.uint64)[:, :, None]
    e = np.arange(per_seq, dtype=np.uint64)[None, None, :]
    u = noise(seed, 2, step, value, seq, e)
    if bound is not None:
        x = np.minimum(((u + np.float32(1)) * np.float32(0.5) * np.float32(bound)).astype(np.int64), bound - 1)
        x = x.astype(np.int32)
    else:
        x = u
    x = x.reshape((DP,) + tuple(shape))
    if CP > 1 and len(shape) >= 2:
        x = x[:, :, positions(shape[1])]
    return x


# ---- ops, on one data-parallel replica's whole tensors ----

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
    i = next(i for i in range(x.ndim) if int(np.prod(x.shape[i:])) == k)
    x = x.reshape(x.shape[:i] + (k,))
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


# ---- meshes and shardings ----

def stage_mesh(stage, single):
    if single:
        return Mesh(np.array(jax.devices()[:1]).reshape((1,) * (1 + len(MESHES[stage]))),
                    ("data",) + tuple(f"m{a}" for a in range(len(MESHES[stage]))))
    first = DP * sum(int(np.prod(m)) for m in MESHES[:stage])
    count = DP * int(np.prod(MESHES[stage]))
    devices = jax.devices()
    if len(devices) < first + count:
        raise SystemExit(f"the plan needs {sum(DP * int(np.prod(m)) for m in MESHES)} devices; "
                         f"JAX sees {len(devices)}")
    return Mesh(np.array(devices[first:first + count]).reshape((DP,) + tuple(MESHES[stage])),
                ("data",) + tuple(f"m{a}" for a in range(len(MESHES[stage]))))


def named_jit(fn, name):
    """`jax.jit(fn)` compiled as module `jit_<name>` (the HLO dumps are named after it)."""
    fn.__name__ = fn.__qualname__ = name
    return jax.jit(fn)


class Sharder:
    """Sharding constraints of one stage's chunks, inside the replica-mapped function."""

    def __init__(self, mesh):
        self.mesh = mesh

    def __call__(self, x, spec):
        if spec is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(*spec)))


def replicas(spec):
    """The sharding of a value with its replicas stacked on a leading data-parallel axis."""
    return P("data", *(spec or ()))


# ---- the pipeline ----

class Pipeline:
    def __init__(self, seed, single):
        self.single = single
        self.meshes = [stage_mesh(s, single) for s in range(len(MESHES))]
        self.sharders = [Sharder(m) for m in self.meshes]
        self.params = []
        self.moments = []
        for s, names in enumerate(STAGE_PARAMETERS):
            p = {n: self.put(initial_parameter(seed, n), s, SPECS.get(n)) for n in names}
            self.params.append(p)
            self.moments.append({n: (jnp.zeros_like(self.put(p[n], s, STATE_SPECS.get(n))),
                                     jnp.zeros_like(self.put(p[n], s, STATE_SPECS.get(n))))
                                 for n in names})
        self.updates = 0
        self.forward = [self.make_forward(c) for c in range(len(CHUNKS))]
        self.backward = [named_jit(lambda vjp, dy: vjp(dy), f"backward_{c}") for c in range(len(CHUNKS))]
        self.update = [self.make_update(s) for s in range(len(MESHES))]

    def put(self, x, stage, spec, stacked=False):
        spec = replicas(spec) if stacked else P(*(spec or ()))
        return jax.device_put(x, NamedSharding(self.meshes[stage], spec))

    def make_forward(self, c):
        fn, stage = CHUNKS[c], CHUNK_STAGE[c]
        sharder = self.sharders[stage]

        def replica(p, recv, fed):
            return fn(p, recv, fed, sharder)

        mapped = jax.vmap(replica, in_axes=(0, 0, 0), spmd_axis_name="data")

        def forward(p, recv, fed):
            # Every replica differentiates its own copy of the weights, so that gradients stay
            # on their replica until the step's reduction.
            stacked = {n: jnp.broadcast_to(w, (DP,) + w.shape) for n, w in p.items()}
            stacked = {n: sharder(w, replicas(SPECS.get(n))) for n, w in stacked.items()}
            return jax.vjp(lambda q, r: mapped(q, r, fed), stacked, recv)

        return named_jit(forward, f"forward_{c}")

    def make_update(self, stage):
        sharder = self.sharders[stage]

        def update(p, m, v, g, t):
            c1 = 1 - BETA1 ** t
            c2 = 1 - BETA2 ** t
            new_p, new_m, new_v = {}, {}, {}
            for n in p:
                state = STATE_SPECS.get(n, SPECS.get(n))
                # The replicas' gradients summed: an all-reduce, or a reduce-scatter where the
                # states are sharded further than the weight (ZeRO).
                gn = sharder(g[n].sum(axis=0), state)
                pn = sharder(p[n], state)
                mn = BETA1 * m[n] + (1 - BETA1) * gn
                vn = BETA2 * v[n] + (1 - BETA2) * gn * gn
                pn = pn - LR * (mn / c1) / (jnp.sqrt(vn / c2) + ADAM_EPS)
                new_p[n] = sharder(pn, SPECS.get(n))
                new_m[n], new_v[n] = mn, vn
            return new_p, new_m, new_v

        return named_jit(update, f"update_{stage}")

    def fed(self, seed, step, c, microbatch):
        s = CHUNK_STAGE[c]
        return {n: self.put(input_batch(seed, step, microbatch, n), s, SPECS.get(n), stacked=True)
                for n in CHUNK_INPUTS[c]}

    def step(self, seed, step):
        saved, outputs, grads_in = {}, {}, {}
        grads = [{} for _ in MESHES]
        losses = []
        for kind, c, mb in ORDER:
            s = CHUNK_STAGE[c]
            if kind == "F":
                recv = {}
                for mine, theirs in zip(CHUNK_RECV[c], CHUNK_RECV_FROM[c]):
                    recv[mine] = self.put(outputs.pop((c - 1, mb, theirs)), s, SPECS.get(mine), stacked=True)
                fed = self.fed(seed, step, c, mb)
                p = {n: self.params[s][n] for n in CHUNK_PARAMETERS[c]}
                out, vjp = self.forward[c](p, recv, fed)
                saved[(c, mb)] = vjp
                if c == len(CHUNKS) - 1:
                    losses.append(out[LOSS])
                else:
                    for n, x in out.items():
                        outputs[(c, mb, n)] = x
            else:
                vjp = saved.pop((c, mb))
                if c == len(CHUNKS) - 1:
                    dy = {LOSS: jnp.full((DP,), 1.0 / (MICROBATCHES * DP), dtype=jnp.float32)}
                else:
                    dy = {}
                    for mine, theirs in zip(CHUNK_RECV[c + 1], CHUNK_RECV_FROM[c + 1]):
                        dy[theirs] = self.put(grads_in.pop((c + 1, mb, mine)), s, SPECS.get(theirs), stacked=True)
                dp, dx = self.backward[c](vjp, dy)
                for n, g in dx.items():
                    grads_in[(c, mb, n)] = g
                for n, g in dp.items():
                    grads[s][n] = g if n not in grads[s] else grads[s][n] + g
        # A weight that several stages hold (tied embeddings) gets the sum of their gradients.
        for name, stages in TIED.items():
            total = None
            for s in stages:
                g = self.put(grads[s][name], stages[0], SPECS.get(name), stacked=True)
                total = g if total is None else total + g
            for s in stages:
                grads[s][name] = self.put(total, s, SPECS.get(name), stacked=True)
        self.updates += 1
        t = np.float32(self.updates)
        for s in range(len(MESHES)):
            m = {n: mv[0] for n, mv in self.moments[s].items()}
            v = {n: mv[1] for n, mv in self.moments[s].items()}
            self.params[s], m, v = self.update[s](self.params[s], m, v, grads[s], t)
            self.moments[s] = {n: (m[n], v[n]) for n in m}
        jax.block_until_ready(self.params)
        loss = float(sum(np.asarray(x).sum() for x in losses)) / (MICROBATCHES * DP)
        return loss, grads


def dump(path, losses, grads, params):
    """Losses, first-step gradients (summed over replicas) and the weights after the first
    update, whole and in the model's order."""
    index, offset = [], 0
    with open(path + ".bin", "wb") as f:
        for kind, tree in (("grad", grads), ("param", params)):
            seen = set()
            for stage in tree:
                for name, x in stage.items():
                    if name in seen:
                        continue
                    seen.add(name)
                    x = np.asarray(x, dtype=np.float32)
                    whole = to_whole(name, x.sum(axis=0) if kind == "grad" else x)
                    f.write(whole.astype("<f4").tobytes())
                    index.append({"kind": kind, "name": name, "shape": list(whole.shape), "offset": offset})
                    offset += whole.size
    with open(path + ".json", "w") as f:
        json.dump({"losses": losses, "tensors": index}, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="seed of weights and data")
    ap.add_argument("--single", action="store_true", help="run every stage on one device")
    ap.add_argument("--dump", metavar="PATH", help="write losses, first-step gradients and weights to PATH.json/.bin")
    ap.add_argument("--hlo", metavar="DIR",
                    help="write every function's HLO after XLA's SPMD partitioner into DIR (read before JAX starts)")
    args = ap.parse_args()
    if os.environ.get("AUTOPAR_JAX_DISTRIBUTED"):
        jax.distributed.initialize()
    if args.dump:
        jax.config.update("jax_default_matmul_precision", "highest")
    pipe = Pipeline(args.seed, args.single)
    print(json.dumps({"event": "start", "backend": jax.default_backend(), "devices": len(jax.devices()),
                      "jax": jax.__version__, "single": args.single}), flush=True)
    losses = []
    for step in range(args.steps):
        start = time.perf_counter()
        loss, grads = pipe.step(args.seed, step)
        elapsed = time.perf_counter() - start
        losses.append(loss)
        print(json.dumps({"event": "step", "step": step, "loss": loss, "time_s": elapsed}), flush=True)
        if step == 0:
            first = (grads, [dict(p) for p in pipe.params])
    if args.dump:
        dump(args.dump, losses, *first)


if __name__ == "__main__":
    main()
