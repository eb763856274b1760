"""The JAX half of ``experiments/muon_bench.py``: distributed Muon on a device mesh, side by side in one run.

The matrices of ``experiments._muon_case`` (the same as the torch half) are optimized from the same
values with the same gradients by

- ours, sequential / overlapped: ``scale_by_muon(plan=muon_plan(layouts, "fsdp", in_flight=None / k))`` on
  the FSDP unit shards, inside one jitted ``shard_map`` step (each matrix gathered to its NS device by the
  core's plan, Newton-Schulz there only, scattered back);
- the GSPMD workaround a JAX user runs today: every parameter sharded ``P("fsdp", None)`` under ``jit``,
  each momentum constrained to fully replicated (an all-gather of every matrix on every device),
  Newton-Schulz on every device, then constrained back to ``P("fsdp", None)`` (a local slice);
- single-device Muon: the same optax chain on the full arrays on one device (the reference).

Each round runs one optimizer step of every variant (the order rotates from round to round), so machine
load hits all alike; step times are medians over the rounds after warm-up rounds, and the ratio is the
median of the per-round ratios against the workaround. Bytes: what each device receives per step, from the
core's transfer plans (ours: ``ragged.transfers`` to and from the NS device; the workaround: from its row
shards to replicated), and the collectives of each compiled program (HLO). Memory: ``memory_analysis()`` of
each compiled program (per device). Equality: the parameters after all rounds, against single-device Muon.

Run it in a process of its own (XLA reads its flags when jax is imported; ``muon_bench`` launches it):

    python -m experiments._muon_bench_jax --devices 8                  # 8 host CPU devices
    python -m experiments._muon_bench_jax --platform gpu --devices 1   # one GPU
"""

import argparse
import os

_ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
_ARGS.add_argument("--devices", type=int, default=8)
_ARGS.add_argument("--platform", default="cpu", choices=("cpu", "gpu"))
_ARGS.add_argument("--rounds", type=int, default=9)
_ARGS.add_argument("--warmup", type=int, default=3, help="rounds run first and not timed (XLA:CPU's "
                   "first two calls of a program are slow)")
_ARGS.add_argument("--in-flight", type=int, default=2)
_ARGS.add_argument("--ns-dtype", default="float32", choices=("float32", "bfloat16"))
_ARGS.add_argument("--out", required=True, help="path prefix of the .md and .json results")
ARGS = _ARGS.parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.platform == "cpu":
    # N host devices, one thread each (XLA's intra-op pool would oversubscribe a few cores; as jax_vs_gspmd).
    _FLAGS = [f"--xla_force_host_platform_device_count={ARGS.devices}", "--xla_cpu_multi_thread_eigen=false"]
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_FLAGS]).strip()
if ARGS is not None:
    os.environ["JAX_PLATFORMS"] = {"cpu": "cpu", "gpu": "cuda"}[ARGS.platform]
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # report what the step needs, not 75%

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ragged  # noqa: E402
import ragged.muon  # noqa: E402
from experiments._hlo import collective_bytes, memory  # noqa: E402
from experiments._muon_case import LR, MOMENTUM, matrices  # noqa: E402
from experiments._muon_case import layouts as plan_layouts  # noqa: E402
from jax_backend import full_params, make_mesh, shard_map, shard_params  # noqa: E402
from jax_backend.optim import muon_plan, newton_schulz, scale_by_muon  # noqa: E402

AXIS = "fsdp"
VARIANTS = ("ours_sequential", "ours_overlapped", "gspmd_replicated", "single_device")


def muon_chain(ns_dtype, plan=None) -> optax.GradientTransformation:
    return optax.chain(scale_by_muon(MOMENTUM, plan=plan, ns_dtype=ns_dtype),
                       optax.scale_by_learning_rate(LR))


def prepare_ours(layouts, mesh, in_flight, ns_dtype, fulls, grads) -> dict:
    """Our FSDP-shard step: one jit(shard_map) over the unit buffers."""
    opt = muon_chain(ns_dtype, muon_plan(layouts, AXIS, in_flight=in_flight))
    spec = {lay.name: P(AXIS) for lay in layouts}
    local = {lay.name: jnp.zeros(lay.shard_size) for lay in layouts}
    state_spec = jax.tree.map(lambda x: P() if x.ndim == 0 else P(AXIS), jax.eval_shape(opt.init, local))

    def local_step(p, g, s):
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s

    step = jax.jit(shard_map(local_step, mesh, in_specs=(spec, spec, state_spec),
                             out_specs=(spec, state_spec)))
    params = shard_params(fulls, layouts, mesh, AXIS)
    state = jax.jit(shard_map(opt.init, mesh, in_specs=(spec,), out_specs=state_spec))(params)
    return dict(step=step, params=params, state=state,
                grads=[shard_params(g, layouts, mesh, AXIS) for g in grads],
                full=lambda p: full_params(p, layouts))


def prepare_gspmd(mesh, ns_dtype, fulls, grads) -> dict:
    """The workaround: row-sharded parameters and momenta, each momentum replicated for Newton-Schulz."""
    rows, everywhere = NamedSharding(mesh, P(AXIS, None)), NamedSharding(mesh, P())

    def step(params, grads, momenta):
        new_params, new_momenta = {}, {}
        for n, g in grads.items():  # scale_by_muon's arithmetic, written out as a user would
            buf = momenta[n] + (1 - MOMENTUM) * (g - momenta[n])
            direction = g + MOMENTUM * (buf - g)
            whole = jax.lax.with_sharding_constraint(direction, everywhere)  # all-gather
            ortho = newton_schulz(whole, dtype=ns_dtype) * ragged.muon.muon_scale(whole.shape)
            # Replicated up to here (else GSPMD propagates the row sharding back into Newton-Schulz and
            # partitions its matmuls); then each device keeps its rows.
            ortho = jax.lax.with_sharding_constraint(ortho, everywhere)
            ortho = jax.lax.with_sharding_constraint(ortho, rows)
            new_params[n], new_momenta[n] = params[n] + (-LR) * ortho, buf
        return new_params, new_momenta

    place = lambda tree: {n: jax.device_put(a, rows) for n, a in tree.items()}  # noqa: E731
    out = {n: rows for n in fulls}
    return dict(step=jax.jit(step, out_shardings=(out, out)), params=place(fulls),
                state=place({n: jnp.zeros_like(a) for n, a in fulls.items()}),
                grads=[place(g) for g in grads], full=lambda p: p)


def prepare_single(device, ns_dtype, fulls, grads) -> dict:
    opt = muon_chain(ns_dtype)

    def step(p, g, s):
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s

    put = lambda tree: jax.device_put(tree, device)  # noqa: E731
    params = put(fulls)
    return dict(step=jax.jit(step), params=params, state=opt.init(params), grads=[put(g) for g in grads],
                full=lambda p: p)


def received_bytes(layouts, world: int, in_flight: int) -> dict[str, int]:
    """Per step, the most bytes one device receives from others (fp32 momenta), from the core's plans."""
    ours = np.zeros(world, np.int64)
    plan = muon_plan(layouts, AXIS, in_flight=in_flight)
    for lay in layouts:
        for m in plan.matrices[lay.name]:
            pieces = ragged.ragged_holdings(lay.placement(m.name), m.shape, m.name)
            whole = ragged.ragged_holdings(ragged.RaggedShard.whole_on(m.ns_device, world), m.shape, m.name)
            for t in ragged.transfers(pieces, whole) + ragged.transfers(whole, pieces):
                ours[t.dst] += 4 * t.length * (t.src != t.dst)
    gspmd = np.zeros(world, np.int64)
    for _, shape in matrices():
        numel = shape[0] * shape[1]
        rows = ragged.shard_holdings(shape, 0, world)
        for t in ragged.transfers(rows, ragged.replicate_holdings(numel, world)):
            gspmd[t.dst] += 4 * t.length * (t.src != t.dst)
    return {"ours_sequential": int(ours.max()), "ours_overlapped": int(ours.max()),
            "gspmd_replicated": int(gspmd.max()), "single_device": 0}


def main(args: argparse.Namespace) -> None:
    world = args.devices
    if len(jax.devices()) < world:
        raise SystemExit(f"muon_bench (JAX): --devices {world} but {args.platform} has {len(jax.devices())}")
    mesh = make_mesh((world,), (AXIS,))
    ns_dtype = jnp.dtype(args.ns_dtype)
    rng = np.random.default_rng(0)
    mats = matrices()
    for _, (rows, _) in mats:
        if rows % world:  # the workaround's P("fsdp", None) would pad: keep the comparison on even rows
            raise SystemExit(f"muon_bench (JAX): {rows} rows do not split over {world} devices")
    fulls = {n: jnp.asarray(rng.standard_normal(s), jnp.float32) for n, s in mats}
    grads = [{n: jnp.asarray(rng.standard_normal(s), jnp.float32) for n, s in mats}
             for _ in range(args.warmup + args.rounds)]
    layouts = plan_layouts(world)
    runs = {"ours_sequential": prepare_ours(layouts, mesh, None, ns_dtype, fulls, grads),
            "ours_overlapped": prepare_ours(layouts, mesh, args.in_flight, ns_dtype, fulls, grads),
            "gspmd_replicated": prepare_gspmd(mesh, ns_dtype, fulls, grads),
            "single_device": prepare_single(mesh.devices.flat[0], ns_dtype, fulls, grads)}
    compiled = {}
    for v, r in runs.items():
        t0 = time.perf_counter()
        compiled[v] = r["step"].lower(r["params"], r["grads"][0], r["state"]).compile()
        r["compile_s"] = time.perf_counter() - t0
    times = {v: [] for v in VARIANTS}
    for k in range(args.warmup + args.rounds):
        order = VARIANTS[k % 4:] + VARIANTS[:k % 4]
        for v in order:
            r = runs[v]
            t0 = time.perf_counter()
            r["params"], r["state"] = jax.block_until_ready(r["step"](r["params"], r["grads"][k], r["state"]))
            if k >= args.warmup:
                times[v].append(time.perf_counter() - t0)
    final = {v: {n: np.asarray(a) for n, a in r["full"](r["params"]).items()} for v, r in runs.items()}
    want = final["single_device"]
    diff = {v: max(float(np.abs(final[v][n] - want[n]).max() / np.abs(want[n]).max()) for n in want)
            for v in VARIANTS}
    g0 = grads[0]
    ns_err = max(float(jnp.linalg.norm(newton_schulz(g, dtype=ns_dtype) - newton_schulz(g))
                       / jnp.linalg.norm(newton_schulz(g))) for g in g0.values())
    summary = {
        "devices": world, "platform": args.platform, "device_kind": jax.devices()[0].device_kind,
        "ns_dtype": args.ns_dtype, "rounds": args.rounds, "in_flight": args.in_flight, "matrices": len(mats),
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "cpus": len(os.sched_getaffinity(0)),
        "median_step_s": {v: statistics.median(t) for v, t in times.items()},
        "median_ratio_vs_gspmd_replicated": {
            v: statistics.median(a / b for a, b in zip(times[v], times["gspmd_replicated"]))
            for v in VARIANTS},
        "median_ratio_overlapped_vs_sequential": statistics.median(
            a / b for a, b in zip(times["ours_overlapped"], times["ours_sequential"])),
        "received_bytes_per_step_device_max": received_bytes(layouts, world, args.in_flight),
        "hlo_collectives": {v: {k: c for k, c in collective_bytes(compiled[v].as_text()).items() if c["ops"]}
                            for v in VARIANTS},
        "memory": {v: memory(compiled[v]) for v in VARIANTS},
        "compile_s": {v: runs[v]["compile_s"] for v in VARIANTS},
        "max_rel_diff_vs_single_device": diff,
        "overlapped_equals_sequential_bitwise": all(
            np.array_equal(final["ours_overlapped"][n], final["ours_sequential"][n]) for n in want),
        "ns_rel_err_vs_fp32": ns_err,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({"summary": summary, "times_s": times}, indent=1))
    Path(args.out + ".md").write_text(render(summary))
    print(render(summary))


def render(s: dict) -> str:
    lines = [f"# Distributed Muon on JAX vs the GSPMD replicated workaround ({s['devices']} x "
             f"{s['device_kind']}, Newton-Schulz in {s['ns_dtype']}, {s['matrices']} matrices, "
             f"{s['rounds']} interleaved rounds)", "",
             "| variant | median step (ms) | ratio vs workaround (median of rounds) "
             "| bytes received per step (max device, core plans) "
             "| HLO collectives per device (ops: result bytes) "
             "| temp bytes | argument + output + temp bytes | max rel. diff vs single device |",
             "|---|---|---|---|---|---|---|---|"]
    for v in VARIANTS:
        coll = ", ".join(f"{k} {c['ops']}: {c['bytes']}" for k, c in s["hlo_collectives"][v].items())
        mem = s["memory"][v]
        lines.append(f"| {v} | {1e3 * s['median_step_s'][v]:.1f} "
                     f"| {s['median_ratio_vs_gspmd_replicated'][v]:.3f} "
                     f"| {s['received_bytes_per_step_device_max'][v]} | {coll or 'none'} | {mem['temp']} "
                     f"| {mem['argument'] + mem['output'] + mem['temp']} "
                     f"| {s['max_rel_diff_vs_single_device'][v]:.2e} |")
    lines += ["", f"Overlapped equals sequential bit for bit: {s['overlapped_equals_sequential_bitwise']}; "
              f"overlapped / sequential step time (median of rounds): "
              f"{s['median_ratio_overlapped_vs_sequential']:.3f}. "
              f"Newton-Schulz in {s['ns_dtype']} vs fp32 (relative Frobenius error, max over the matrices, "
              f"round-0 gradients): {s['ns_rel_err_vs_fp32']:.2e}. Compile seconds: "
              + ", ".join(f"{v} {t:.1f}" for v, t in s["compile_s"].items()) + ".",
              "HLO collective bytes are the result buffers of each collective in the per-device program "
              "(a `collective-permute` to one root has a result buffer on every device, so they overstate "
              "what is received; the core-plan column is the bytes that arrive). Memory is "
              "`memory_analysis()` per device: ours and the workaround hold a shard of the parameters, "
              "momenta and gradients, the single device all of them (its `peak_memory_in_bytes` is in the "
              "JSON; on XLA:CPU it leaves temp out).",
              f"XLA_FLAGS: `{s['xla_flags']}`; {s['cpus']} CPUs available.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main(ARGS)
