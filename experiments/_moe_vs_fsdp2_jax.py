"""The JAX part of ``experiments/moe_vs_fsdp2.py``: expert parallelism + ragged FSDP against GSPMD with an
expert axis, side by side in one process on 8 host CPU devices.

Same MoE decoder (``jax_backend.models.moe.MoEDecoder``: gpt-oss-tiny's fused 3-D experts, mixtral-tiny's
per-expert SwiGLUs), same initial values, data and optimizer (AdamW), on a mesh ``(ep, fsdp)``:

- **ours**: ``parallelize_moe`` (an experts unit per MoE layer holding ``E / ep`` experts, sharded over
  ``fsdp``; every other unit ragged over ``ep x fsdp``), ``capacity_factor=None`` (nothing dropped), the
  dispatch of ``ExpertParallelMoE``: a static ``(E, N, dim)`` send buffer per device and an ``all_to_all``
  over ``ep`` each way.
- **GSPMD**: plain ``jax.jit`` of the same model, its MoE layers doing the **dense dispatch** of
  ``models/moe.py`` (every expert runs on every token; ``route_tokens`` sums the chosen outputs) per
  *group* of tokens, group ``g`` being ours' device batch ``g`` (rows ``[g b, (g + 1) b)``), with the
  experts' input and output, ``(E, groups, N, dim)``, constrained to ``P("ep", "fsdp")`` so that the
  experts stay on their EP rank and the tokens move along ``ep`` (GSPMD picks the collectives; without
  the output constraint it replicated whole activations). Expert tensors are sharded on ``ep`` along the
  expert dim and on ``fsdp`` along their largest other dim it divides (per-expert SwiGLUs are stacked into
  ``[E, ...]`` tensors: GSPMD needs an expert dim to shard); every other parameter on its largest dim that
  ``ep * fsdp`` divides, over ``(ep, fsdp)`` jointly (``jax_vs_gspmd.gspmd_spec``); the batch over both.

Both do the same arithmetic: each device runs ``E / ep`` experts on ``ep N`` rows per MoE layer (ours:
its experts on every EP peer's send buffer; GSPMD: its experts on every token of ``ep`` groups), and both
compute the same loss, the mean over devices of each device batch's ``moe_loss`` (the load-balancing
loss is per device batch in ours, per group in GSPMD). Timing, memory and HLO come from
``experiments.jax_vs_gspmd`` (``train_round_robin``: interleaved rounds in a rotating order, the step ratio
the median of the per-round ratios; ``memory_analysis`` of the compiled executables; collectives counted
in the compiled HLO).

Run it in a process of its own (XLA reads its flags when jax is imported; ``moe_vs_fsdp2 --part jax``
launches it):

    python -m experiments._moe_vs_fsdp2_jax --out experiments/results/moe_vs_fsdp2_jax
"""

import os

if __name__ == "__main__":  # 8 host devices, one thread each (jax_vs_gspmd appends the same on import)
    for _flag in ("--xla_force_host_platform_device_count=8", "--xla_cpu_multi_thread_eigen=false"):
        if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from experiments.jax_vs_gspmd import DEVICES, gspmd_spec, summarize, token_batches, train_round_robin  # noqa: E402
from jax_backend import make_mesh  # noqa: E402
from jax_backend.models import model_params  # noqa: E402
from jax_backend.models.expert_parallel import parallelize_moe  # noqa: E402
from jax_backend.models.moe import ExpertList, MoE, MoEDecoder, load_balancing_loss, moe_loss, route_tokens  # noqa: E402
from ragged.models import MOE_CONFIGS  # noqa: E402

MODELS = ("gpt-oss-tiny", "mixtral-tiny")
MESHES = ((2, 4), (4, 2))  # (ep, fsdp)
EXPERT_AXES = ("ep", "fsdp")


# ---- GSPMD's model: the same decoder, its MoE layers dispatching per group under a sharding constraint ----

class StackedExperts(nnx.Module):
    """Per-expert SwiGLUs as one ``FeedForward`` whose tensors are stacked ``[E, ...]`` (an expert dim for
    GSPMD to shard), run with ``vmap``: ``(E, C, dim) -> (E, C, dim)``, the same values as ``ExpertList``."""

    def __init__(self, experts: ExpertList):
        graphdefs, states = zip(*(nnx.split(e) for e in experts))
        self.stacked = nnx.merge(graphdefs[0], jax.tree.map(lambda *xs: jnp.stack(xs), *states))

    def __call__(self, x: jax.Array) -> jax.Array:
        graphdef, state = nnx.split(self.stacked)
        return jax.vmap(lambda s, rows: nnx.merge(graphdef, s)(rows))(state, x)


class GroupedDenseMoE(nnx.Module):
    """``models/moe.py``'s MoE (router, dense dispatch, shared expert) on ``groups`` groups of tokens, the
    load-balancing loss per group (a device's rows in ours), the experts' input and output pinned to
    ``experts_sharding`` (expert dim on ``ep``, groups on ``fsdp``)."""

    def __init__(self, moe: MoE, groups: int, experts_sharding: NamedSharding):
        self.router, self.shared_expert = moe.router, moe.shared_expert
        self.experts = StackedExperts(moe.experts) if isinstance(moe.experts, ExpertList) else moe.experts
        self.groups, self.experts_sharding = groups, experts_sharding

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        b, t, d = x.shape
        g = self.groups
        tokens = x.reshape(g, b * t // g, d)  # (G, N, dim): group i is rows [i b/G, (i+1) b/G)
        weights, chosen, probs = self.router(tokens)  # (G, N, k), (G, N, k), (G, N, E)
        n_experts = probs.shape[-1]
        every_token = jnp.broadcast_to(tokens, (n_experts, *tokens.shape))  # (E, G, N, dim)
        every_token = jax.lax.with_sharding_constraint(every_token, self.experts_sharding)
        outputs = self.experts(every_token.reshape(n_experts, -1, d)).reshape(every_token.shape)
        outputs = jax.lax.with_sharding_constraint(outputs, self.experts_sharding)
        out = jax.vmap(route_tokens, in_axes=(1, 0, 0))(outputs, weights, chosen)  # (G, N, dim)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        aux = jnp.mean(jax.vmap(load_balancing_loss)(probs, chosen))
        return out.reshape(b, t, d), aux


def gspmd_model(model: MoEDecoder, mesh: Mesh) -> MoEDecoder:
    """A copy of ``model`` whose MoE layers are ``GroupedDenseMoE``s, one group per device."""
    out = nnx.clone(model)
    experts_sharding = NamedSharding(mesh, P("ep", "fsdp"))
    for layer in out.layers:
        if isinstance(layer.feed_forward, MoE):
            layer.feed_forward = GroupedDenseMoE(layer.feed_forward, mesh.size, experts_sharding)
    return out


def dotted(path) -> str:
    """A pytree key path as a dotted name (``layers.1.feed_forward.experts.w1.value``)."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


def expert_axis_spec(path: str, shape: tuple[int, ...], fsdp: int) -> P:
    """Experts: dim 0 on ``ep``, their largest other dim ``fsdp`` divides on ``fsdp``. Everything else:
    ``gspmd_spec``'s largest dim ``ep * fsdp`` divides, over ``(ep, fsdp)`` jointly."""
    if ".experts." not in f".{path}.":
        return gspmd_spec(shape, DEVICES, axis=EXPERT_AXES)
    return gspmd_spec(shape, fsdp, tensor_axis="ep", tensor_dim=0)


def prepare_gspmd(model: MoEDecoder, mesh: Mesh, loss_fn, batches, opt) -> dict:
    """GSPMD with an expert axis: ``jit`` with every parameter and its moments placed by
    ``expert_axis_spec``, the batch over ``(fsdp, ep)`` (fsdp major, so that leaving ``ep`` out of the
    groups' sharding for the experts is an exchange within each fsdp index)."""
    graphdef, params = nnx.split(gspmd_model(model, mesh), nnx.Param)
    fsdp = mesh.shape["fsdp"]
    shardings = jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, expert_axis_spec(dotted(path), x.shape, fsdp)), params)
    params = jax.device_put(params, shardings)
    # Moments get their parameter's sharding; the step count is replicated.
    state_shardings = optax.tree_utils.tree_map_params(
        opt, lambda _, sharding: sharding, jax.eval_shape(opt.init, params), shardings,
        transform_non_params=lambda _: NamedSharding(mesh, P()))
    state = jax.jit(opt.init, out_shardings=state_shardings)(params)
    data = NamedSharding(mesh, P(("fsdp", "ep")))

    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p)(x), y))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    jitted = jax.jit(step, in_shardings=(shardings, state_shardings, data, data), donate_argnums=(0, 1),
                     out_shardings=(shardings, state_shardings, NamedSharding(mesh, P())))
    t0 = time.perf_counter()
    compiled = jitted.lower(params, state, *batches[0]).compile()

    def run(carry: tuple, x, y) -> tuple:
        *carry, loss = compiled(*carry, x, y)
        return tuple(carry), loss

    return {"compiled": compiled, "run": run, "carry": (params, state), "compile_s": time.perf_counter() - t0,
            "padding": 0, "blocks_cut_32": None}  # summarize's field; not measured here


# ---- ours: expert parallelism + ragged FSDP ----------------------------------------------------------------

def prepare_ours(model: MoEDecoder, mesh: Mesh, loss_fn, batches, opt) -> dict:
    """``parallelize_moe`` at ``capacity_factor=None``: the step carries each device's drop counts."""
    ep = parallelize_moe(model, mesh)
    buffers = ep.shard_params(model_params(model))
    carry = (buffers, ep.fsdp.init(opt, buffers), ep.init_model_state())
    t0 = time.perf_counter()
    compiled = ep.fsdp.train_step(opt, loss_fn).lower(*carry[:2], *batches[0], carry[2]).compile()

    def run(carry: tuple, x, y) -> tuple:
        buffers, state, loss, model_state = compiled(*carry[:2], x, y, carry[2])
        return (buffers, state, model_state), loss

    return {"compiled": compiled, "run": run, "carry": carry, "compile_s": time.perf_counter() - t0,
            "padding": sum(lay.padding for lay in ep.fsdp.layouts), "blocks_cut_32": None, "runtime": ep}


# ---- the comparison ----------------------------------------------------------------------------------------

def bench(name: str, ep: int, fsdp: int, batches: list[tuple], rounds: int, warmup: int) -> dict:
    """One model on one mesh, ours against GSPMD round-robin from the same initial values: ``summarize``'s
    rows (ours' ratios are against GSPMD), each program's collectives (ops and bytes per kind), the losses
    and their largest difference, ours' number of FSDP units and the assignments it dropped."""
    c = MOE_CONFIGS[name]
    mesh, model = make_mesh((ep, fsdp), ("ep", "fsdp")), MoEDecoder(c, rngs=nnx.Rngs(0))
    opt = optax.adamw(1e-3, weight_decay=0.1)

    def loss_fn(outputs, targets):
        return moe_loss(outputs, targets, c.aux_loss_coef)

    runs = {"gspmd": prepare_gspmd(model, mesh, loss_fn, batches, opt),
            "ours": prepare_ours(model, mesh, loss_fn, batches, opt)}
    train_round_robin(runs, batches, rounds, warmup)
    losses = {k: r["losses"] for k, r in runs.items()}
    gaps = [abs(a - b) / abs(b) for a, b in zip(losses["ours"], losses["gspmd"])]
    dropped = runs["ours"]["runtime"].dropped(runs["ours"]["carry"][2])
    return {"model": name, "ep": ep, "fsdp": fsdp, "moe_layers": c.n_layers - c.n_dense_layers,
            "units": len(runs["ours"]["runtime"].fsdp.layouts),
            "rows": {k: summarize(name, k, r, runs["gspmd"]) for k, r in runs.items()},
            "collectives": {k: r["collectives"] for k, r in runs.items()}, "losses": losses,
            "max_relative_loss_difference": max(gaps),
            "dropped_assignments": int(sum(v.sum() for v in dropped.values()))}


def _ops(kind: str):
    def cell(r: dict) -> str:
        return " / ".join(f"{r['collectives'][k][kind]['ops']} ({r['collectives'][k][kind]['bytes']:,} B)"
                          for k in ("ours", "gspmd"))
    return cell


_CELLS = [
    ("step time ours / GSPMD: median of rounds (IQR)", lambda r: "{ratio_median:.3f} ({ratio_q1:.3f} to "
     "{ratio_q3:.3f})".format(**r["rows"]["ours"])),
    ("median step (ms), ours / GSPMD", lambda r: " / ".join(f"{r['rows'][k]['median_step_ms']:.1f}"
                                                           for k in ("ours", "gspmd"))),
    ("temporary memory (MB), ours / GSPMD", lambda r: " / ".join(f"{r['rows'][k]['temp_bytes'] / 1e6:.2f}"
                                                                for k in ("ours", "gspmd"))),
    *[(f"{kind} ops (result bytes), ours / GSPMD", _ops(kind))
      for kind in ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")],
    ("all collectives (result bytes), ours / GSPMD", lambda r: " / ".join(
        f"{sum(c['bytes'] for c in r['collectives'][k].values()):,} B" for k in ("ours", "gspmd"))),
    ("compile (s), ours / GSPMD", lambda r: " / ".join(f"{r['rows'][k]['compile_s']:.1f}"
                                                      for k in ("ours", "gspmd"))),
    ("largest relative loss difference", lambda r: f"{r['max_relative_loss_difference']:.1e}"),
]


def markdown(results: list[dict], meta: dict) -> str:
    heads = [f"{r['model']}, (ep, fsdp) = ({r['ep']}, {r['fsdp']})" for r in results]
    lines = [f"# JAX: expert parallelism + ragged FSDP vs GSPMD with an expert axis ({DEVICES} host CPU "
             "devices)", "",
             f"`python -m experiments.moe_vs_fsdp2 --part jax`: {meta['rounds']} rounds of "
             f"{meta['steps_per_round']} steps per program, round-robin, the first {meta['warmup']} rounds "
             f"not counted; batch {meta['batch']} x {meta['seq']} tokens ({meta['batch'] // DEVICES} rows "
             f"per device), fp32, AdamW. jax {meta['jax']}, XLA_FLAGS `{meta['xla_flags']}`, {meta['cpus']} "
             "CPUs; "
             f"load average (1, 5, 15 min) {meta['load_before']} before the run and {meta['load_after']} "
             "after it: the machine was shared, so the step ratios are noisy; the collective counts and the "
             "memory do not depend on load.", "",
             "Ours: `parallelize_moe`, `capacity_factor=None` (assignments dropped: "
             + ", ".join(str(r["dropped_assignments"]) for r in results) + "). GSPMD: `jax.jit` of the same "
             "decoder, `models/moe.py`'s dense dispatch per group of one device's rows, the experts' input "
             "and output `(E, groups, N, dim)` constrained to `P(\"ep\", \"fsdp\")`; expert tensors on "
             "`ep` (expert dim) and `fsdp` (their largest other dim it divides), the other parameters over "
             "`(ep, fsdp)` jointly (experiments/_moe_vs_fsdp2_jax.py's docstring). Collectives: ops and "
             "result bytes in the compiled per-device program of one training step; temporary memory: "
             "`memory_analysis()`.", "",
             "| metric | " + " | ".join(heads) + " |", "|---|" + "---|" * len(results)]
    lines += [f"| {label} | " + " | ".join(cell(r) for r in results) + " |" for label, cell in _CELLS]
    return "\n".join([*lines, "", *meta["statements"], ""])


def statements(results: list[dict]) -> list[str]:
    out = []
    for r in results:
        o, g, layers = r["rows"]["ours"], r["rows"]["gspmd"], r["moe_layers"]
        a2a = {k: r["collectives"][k]["all-to-all"]["ops"] for k in ("ours", "gspmd")}
        out.append(f"- {r['model']} at (ep, fsdp) = ({r['ep']}, {r['fsdp']}): ours has {a2a['ours']} "
                   f"all-to-alls for {layers} MoE layers ({a2a['ours'] / layers:g} per layer and step: one "
                   f"each way in the forward, their transposes in the backward), GSPMD {a2a['gspmd']}; "
                   f"temporary memory ours / GSPMD {o['temp_bytes'] / g['temp_bytes']:.2f}; step time ratio "
                   f"{o['ratio_median']:.3f}, ours faster in {100 * o['rounds_faster']:.0f}% of rounds.")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps-per-round", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3, help="rounds not counted")
    p.add_argument("--batch", type=int, default=32, help="global rows (a multiple of 8)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--meshes", default=",".join(f"{e}x{f}" for e, f in MESHES), help="EPxFSDP, ...")
    p.add_argument("--out", required=True, help="path prefix of the .md and .json results")
    args = p.parse_args(argv)
    assert jax.device_count() >= DEVICES, f"needs {DEVICES} devices, found {jax.device_count()}"
    load_before, t0 = os.getloadavg(), time.perf_counter()
    results = []
    for name in args.models.split(","):
        batches = token_batches(args.rounds * args.steps_per_round, args.batch, args.seq,
                                MOE_CONFIGS[name].vocab_size)
        for mesh in args.meshes.split(","):
            ep, fsdp = map(int, mesh.split("x"))
            results.append(bench(name, ep, fsdp, batches, args.rounds, args.warmup))
    meta = {"rounds": args.rounds, "steps_per_round": args.steps_per_round, "warmup": args.warmup,
            "batch": args.batch, "seq": args.seq, "jax": jax.__version__,
            "xla_flags": " ".join(dict.fromkeys(os.environ.get("XLA_FLAGS", "").split())),  # jax_vs_gspmd
            "cpus": len(os.sched_getaffinity(0)),
            "load_before": ", ".join(f"{x:.1f}" for x in load_before),
            "load_after": ", ".join(f"{x:.1f}" for x in os.getloadavg()),
            "wall_s": time.perf_counter() - t0, "statements": statements(results)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(out.name + ".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    out.with_name(out.name + ".md").write_text(markdown(results, meta))
    print(out.with_name(out.name + ".md").read_text())


if __name__ == "__main__":
    main()
