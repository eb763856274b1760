"""What running optax on the parameters' pieces costs (``jax_backend.shard_optimizer``), against plain AdamW.

Plain AdamW runs as it is on the flat unit shards; recipes over the params pytree (a weight-decay mask,
``clip_by_global_norm``, LAMB) run on every device's pieces of every parameter. On the MoE of
``jax_vs_gspmd.py`` (8 host CPU devices, one thread each, ``shard_model(..., units="blocks.*", remat=True)``,
batch 16 x 64) this compiles one training step per recipe and reports its temporary memory, then times the
steps round-robin (the order rotating each round) and gives, per recipe, the median over rounds of its
step time divided by plain AdamW's in the same round. Writes ``experiments/results/optax_pieces.{json,md}``.

    PYTHONPATH=. python experiments/optax_pieces.py [--rounds 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

# isort: off
from experiments.jax_vs_gspmd import MoE, moe_loss  # sets the XLA flags before jax is imported
import jax
import numpy as np
import optax
from flax import nnx

from jax_backend import make_mesh, shard_model
# isort: on


def ndim_mask(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


RECIPES = {
    "adamw (flat shards)": lambda: optax.adamw(1e-3, weight_decay=0.1),
    "adamw, decay on ndim > 1": lambda: optax.adamw(1e-3, weight_decay=0.1, mask=ndim_mask),
    "clip_by_global_norm + adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                                       optax.adamw(1e-3, weight_decay=0.1)),
    "lamb": lambda: optax.lamb(1e-3),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--out", default="experiments/results")
    args = p.parse_args()
    model = MoE(rngs=nnx.Rngs(0))
    data = np.random.default_rng(0).integers(0, 512, size=(16, 65)).astype(np.int32)
    x, y = data[:, :-1], data[:, 1:]
    mesh = make_mesh((8,), ("fsdp",))
    runs = {}
    for name, make in RECIPES.items():
        fsdp, opt = shard_model(model, mesh, units="blocks.*", remat=True), make()
        buffers = fsdp.shard_params(model)
        state = fsdp.init(opt, buffers)
        compiled = fsdp.train_step(opt, moe_loss).lower(buffers, state, x, y).compile()
        mem = compiled.memory_analysis()
        runs[name] = {"step": compiled, "carry": (buffers, state), "times": [],
                      "temp_bytes": mem.temp_size_in_bytes, "argument_bytes": mem.argument_size_in_bytes}
    names = list(runs)
    for r in range(args.rounds + 2):  # two warm-up rounds, dropped
        for name in names[r % len(names):] + names[:r % len(names)]:
            run = runs[name]
            start = time.perf_counter()
            buffers, state, loss, _ = run["step"](*run["carry"], x, y)
            jax.block_until_ready(loss)
            run["times"].append(time.perf_counter() - start)
            run["carry"] = (buffers, state)
    base = runs[names[0]]["times"][2:]
    rows = []
    for name in names:
        times = runs[name]["times"][2:]
        rows.append({"recipe": name, "temp_bytes": runs[name]["temp_bytes"],
                     "argument_bytes": runs[name]["argument_bytes"],
                     "median_step_ms": 1e3 * statistics.median(times),
                     "median_ratio_to_adamw": statistics.median(t / b for t, b in zip(times, base))})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "optax_pieces.json").write_text(json.dumps({"rounds": args.rounds, "rows": rows}, indent=1))
    lines = ["# optax on the pieces vs plain AdamW on flat shards (MoE, 8 host CPU devices, remat)", "",
             f"{args.rounds} interleaved rounds (2 warm-up rounds dropped), shared 2-core machine.", "",
             "| recipe | temp memory | arguments | median step | median per-round ratio to adamw |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['recipe']} | {r['temp_bytes'] / 1e3:.0f} kB | {r['argument_bytes'] / 1e3:.0f} kB | "
              f"{r['median_step_ms']:.1f} ms | {r['median_ratio_to_adamw']:.3f} |" for r in rows]
    (out / "optax_pieces.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
