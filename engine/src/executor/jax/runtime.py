# ---------------------------------------------------------------------------------------------
# autopar's JAX runtime: the same in every exported plan. The plan-specific part (meshes,
# shardings, the model's chunks and the schedule) and the ops are above; this part makes the
# synthetic data and weights (bit-identical to autopar's CPU executor), the pipeline driver and
# Adam.
# ---------------------------------------------------------------------------------------------

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
LR, BETA1, BETA2, ADAM_EPS = np.float32(1e-3), np.float32(0.9), np.float32(0.95), np.float32(1e-8)


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
        self.meshes = [stage_mesh(s, single) for s in range(len(MESHES))]
        self.sharders = [Sharder(m) for m in self.meshes]
        self.params = []
        self.moments = []
        for s, names in enumerate(STAGE_PARAMETERS):
            p = {n: self.put(initial_parameter(seed, n), s, SPECS.get(n)) for n in names}
            self.params.append(p)
            # Adam's moments, placed as the optimizer states are (as the weight, unless ZeRO).
            zeros = {n: jnp.zeros(p[n].shape, p[n].dtype, device=NamedSharding(
                         self.meshes[s], P(*(STATE_SPECS.get(n, SPECS.get(n)) or ())))) for n in names}
            self.moments.append({n: (zeros[n], zeros[n]) for n in names})
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
