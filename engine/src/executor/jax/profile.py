# ---------------------------------------------------------------------------------------------
# autopar's JAX profiler: times, through XLA on the devices JAX sees, the kernels and
# collectives of `autopar profile run --backend jax`. Reads the entries (JSON) from the file
# named by its first argument and writes one result per entry to the file named by its second:
# {"seconds": t} or {"skipped": why}.
# ---------------------------------------------------------------------------------------------

CP = 1


def operands(specs, key):
    """Operands of the given shapes: normal noise, or integers below their bound."""
    out = []
    for i, spec in enumerate(specs):
        key, sub = jax.random.split(key)
        shape = tuple(spec["shape"])
        if spec.get("bound") is not None:
            out.append(jax.random.randint(sub, shape, 0, spec["bound"], dtype=jnp.int32))
        else:
            out.append(jax.random.normal(sub, shape, dtype=jnp.float32))
    return out


def kernel_fn(kernel, out_shapes):
    """The forward function of a kernel as autopar's lowering names it."""
    name, args = (kernel, {}) if isinstance(kernel, str) else next(iter(kernel.items()))
    if name == "embedding":
        return lambda ids, table: embedding(ids, table)
    if name == "mat_mul":
        tb = args["transpose_b"]
        if args["bias"]:
            return lambda x, w, b: matmul(x, w, tb) + b
        return lambda x, w: matmul(x, w, tb)
    if name == "bias_add":
        return lambda x, b: x + b
    if name == "batch_mat_mul":
        return lambda a, b: batch_matmul(a, b, args["transpose_b"])
    if name == "softmax":
        return lambda x: causal_softmax(x, np.float32(args["scale"]))
    if name == "attention":
        return lambda q, k, v: attention(q, k, v, np.float32(args["scale"]))
    if name == "slice":
        def cut(x):
            heads = [o[1] if len(o) == x.ndim + 1 else None for o in out_shapes]
            return split(x, args["parts"], heads=heads)
        return cut
    if name == "transpose":
        return lambda x: jnp.swapaxes(x, args["a"], args["b"])
    simple = {"layer_norm": layer_norm, "rms_norm": rms_norm, "gelu": gelu, "silu": silu,
              "swi_glu": swiglu, "add": jnp.add, "mul": jnp.multiply, "identity": lambda x: x,
              "rope": rope, "cross_entropy": cross_entropy}
    if name in simple:
        return simple[name]
    raise KeyError(f"no JAX kernel for `{name}`")


def timed(fn, *args):
    """Median seconds of `fn(*args)` after one warm-up (compilation): at least MIN_RUNS runs
    and MIN_TIME s of them, at most MAX_RUNS."""
    jax.block_until_ready(fn(*args))
    samples = []
    while len(samples) < MAX_RUNS and (len(samples) < MIN_RUNS or sum(samples) < MIN_TIME):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def collective(entry):
    name, ranks, elements = entry["collective"], entry["ranks"], entry["bytes"] // 4
    if len(jax.devices()) < ranks:
        raise KeyError(f"{ranks} ranks, JAX sees {len(jax.devices())} devices")
    mesh = Mesh(np.array(jax.devices()[:ranks]), ("r",))
    whole = elements // ranks * ranks
    per = whole // ranks
    body = {
        "all_reduce": lambda x: jax.lax.psum(x, "r"),
        "reduce_scatter": lambda x: jax.lax.psum_scatter(x, "r", scatter_dimension=1, tiled=True),
        "all_gather": lambda x: jax.lax.all_gather(x, "r", axis=1, tiled=True),
        "all_to_all": lambda x: jax.lax.all_to_all(x, "r", 1, 1, tiled=True),
    }[name]
    # The payload is the reduced tensor, or the gathered result: every rank holds `whole`
    # elements, or `per` before an all-gather.
    width = per if name == "all_gather" else whole
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("r"), out_specs=P("r")))
    x = jax.device_put(jnp.ones((ranks, width), jnp.float32), NamedSharding(mesh, P("r")))
    return timed(fn, x)


def kernel(entry, key):
    work = entry["work"]
    if work == "forward":
        fn = jax.jit(kernel_fn(entry["kernel"], entry["out_shapes"]))
        return timed(fn, *operands(entry["inputs"], key))
    if work == "backward":
        x = operands(entry["inputs"], key)
        floats = [i for i, s in enumerate(entry["inputs"]) if s.get("bound") is None]
        f = kernel_fn(entry["kernel"], entry["out_shapes"])

        def of_floats(*fs):
            args = list(x)
            for i, v in zip(floats, fs):
                args[i] = v
            return f(*args)

        y, vjp = jax.vjp(of_floats, *[x[i] for i in floats])
        dy = jax.tree_util.tree_map(lambda t: jnp.ones_like(t), y)
        return timed(jax.jit(lambda v, d: v(d)), vjp, dy)
    if work == "weight_grad":
        m, k, n = entry["mkn"]
        x, dy = operands([{"shape": [m, k]}, {"shape": [m, n]}], key)
        if entry["bias"]:
            return timed(jax.jit(lambda x, d: (x.T @ d, d.sum(axis=0))), x, dy)
        return timed(jax.jit(lambda x, d: x.T @ d), x, dy)
    if work == "batch_grad_b":
        a, d = operands([{"shape": entry["a"]}, {"shape": entry["d"]}], key)
        b_shape = tuple(entry["b_shape"])

        def grad_b(a, d):
            g = jnp.matmul(jnp.swapaxes(a, -1, -2), d)
            if entry["transpose_b"]:
                g = jnp.swapaxes(g, -1, -2)
            # Grouped operands: the heads sharing one of b sum their gradients.
            lead = b_shape[:-2]
            g = g.reshape(tuple(x for b, a_ in zip(lead, a.shape[:-2]) for x in (b, a_ // b)) + g.shape[-2:])
            return g.sum(axis=tuple(range(1, 2 * len(lead), 2)))
        return timed(jax.jit(grad_b), a, d)
    raise KeyError(f"unknown work `{work}`")


def profile_main():
    entries = json.load(open(sys.argv[1]))
    key = jax.random.PRNGKey(0)
    device = jax.devices()[0]
    results = []
    for entry in entries:
        try:
            seconds = collective(entry) if "collective" in entry else kernel(entry, key)
            results.append({"seconds": seconds})
        except (KeyError, ValueError, TypeError, NotImplementedError) as e:
            results.append({"skipped": f"XLA: {e}"})
    with open(sys.argv[2], "w") as f:
        json.dump({"platform": device.platform, "device_kind": device.device_kind,
                   "jax": jax.__version__, "results": results}, f)


if __name__ == "__main__":
    profile_main()
