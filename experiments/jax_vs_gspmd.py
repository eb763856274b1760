"""ragged-fsdp's JAX backend against plain GSPMD FSDP, side by side in one run on 8 host CPU devices.

Same model (llama-tiny), data, seed and optimizer (AdamW). GSPMD FSDP is the usual recipe: ``jit`` with a
``NamedSharding`` on every parameter's largest dim that 8 divides (replicated where none does), the
optimizer state sharded like the parameters, the batch split over the devices. Ours is
``jax_backend.models.parallelize`` (one flat buffer per unit, shard_map, per-unit all-gather and
reduce-scatter). Measured: median step time and the ratio, compile time, collective bytes per step and
per device (read from the compiled HLO), compiled memory (``memory_analysis``), and the loss curves (they
must agree). A third run keeps every 32-row block whole (the 8-bit Adam tiling), which per-parameter
GSPMD sharding cannot express; the block counts show it.

    python -m experiments.jax_vs_gspmd            # writes experiments/results/jax_vs_gspmd.{json,md}
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ragged  # noqa: E402
from jax_backend import make_mesh  # noqa: E402
from jax_backend.models import Llama, cross_entropy, model_params, parallelize  # noqa: E402

DEVICES = 8
_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
_SHAPE = re.compile(r"\b(f32|bf16|f16|s32|u32|f64|s64|u8|s8|pred)\[([\d,]*)\]")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u8": 1, "s8": 1, "pred": 1}


def collective_bytes(hlo: str) -> dict[str, dict[str, int]]:
    """Per collective kind: how many ops and the bytes of their results, per device (SPMD program)."""
    out = {k: {"ops": 0, "bytes": 0} for k in _COLLECTIVES}
    for line in hlo.splitlines():
        m = re.search(r"=\s*(.*?)\s(" + "|".join(_COLLECTIVES) + r")(-start)?\(", line)
        if not m:
            continue
        kind = m.group(2)
        out[kind]["ops"] += 1
        for dtype, dims in _SHAPE.findall(m.group(1)):
            out[kind]["bytes"] += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    return out


def memory(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    return {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}


def gspmd_spec(shape: tuple[int, ...]) -> P:
    """Shard the largest dim that the device count divides; replicate when none does."""
    dims = sorted((d for d in range(len(shape)) if shape[d] % DEVICES == 0), key=lambda d: -shape[d])
    if not dims:
        return P()
    spec = [None] * len(shape)
    spec[dims[0]] = "fsdp"
    return P(*spec)


def blocks_cut_by_gspmd(rows: int = 32) -> tuple[int, int]:
    """(blocks cut, blocks in all) over the matrices that a ``rows``-row tiling applies to."""
    cut = total = 0
    for unit in ragged.model_shapes("llama-tiny").units:
        for _, shape in unit.tensors:
            if len(shape) != 2 or shape[0] % rows:
                continue
            n = shape[0] // rows
            total += n
            spec = gspmd_spec(shape)
            if spec == P():
                continue
            if spec[0] == "fsdp":  # rows split in chunks of shape[0] / 8: whole blocks only if they divide
                cut += 0 if (shape[0] // DEVICES) % rows == 0 else n
            else:  # columns split: every block is spread over all devices
                cut += n
    return cut, total


def blocks_cut_by_layouts(layouts, rows: int = 32) -> int:
    """32-row blocks that a shard boundary passes through, over the same matrices."""
    cut = 0
    for layout in layouts:
        for t in layout.tensors:
            if len(t.shape) != 2 or t.shape[0] % rows:
                continue
            block = rows * t.shape[1]
            edges = {p.start for rank in range(layout.world_size) for p in layout.local_pieces(rank)
                     if p.name == t.name and 0 < p.start < t.numel}
            cut += len({e // block for e in edges if e % block})
    return cut


def rows32(name: str, shape: tuple[int, ...]) -> str:
    if len(shape) < 2:
        return "element"
    return "rows:32" if shape[0] % 32 == 0 else "rows:1"


def prepare_ours(model, batches, opt, *, remat: bool = False, granularity="rows:1") -> dict:
    fsdp = parallelize(model, make_mesh((DEVICES,), ("fsdp",)), remat=remat, granularity=granularity)
    buffers = fsdp.shard(model_params(model))
    state = fsdp.init(opt, buffers)
    b = batches[0]
    t0 = time.perf_counter()
    compiled = fsdp.train_step(opt, cross_entropy).lower(buffers, state, b[:, :-1], b[:, 1:]).compile()
    return {"compiled": compiled, "carry": (buffers, state), "compile_s": time.perf_counter() - t0,
            "padding": sum(lay.padding for lay in fsdp.layouts),
            "blocks_cut_32": blocks_cut_by_layouts(fsdp.layouts)}


def prepare_gspmd(model, batches, opt) -> dict:
    mesh = make_mesh((DEVICES,), ("fsdp",))
    graphdef, params = nnx.split(model, nnx.Param)
    shardings = jax.tree.map(lambda x: NamedSharding(mesh, gspmd_spec(x.shape)), params)
    params = jax.device_put(params, shardings)
    # Moments get their parameters' rule (same shapes); scalars (the step count) are replicated.
    state_shapes = jax.eval_shape(opt.init, params)
    state_shardings = jax.tree.map(lambda x: NamedSharding(mesh, gspmd_spec(x.shape)), state_shapes)
    state = jax.jit(opt.init, out_shardings=state_shardings)(params)
    data = NamedSharding(mesh, P("fsdp"))

    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(lambda p: cross_entropy(nnx.merge(graphdef, p)(x), y))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    jitted = jax.jit(step, in_shardings=(shardings, state_shardings, data, data),
                     out_shardings=(shardings, state_shardings, NamedSharding(mesh, P())),
                     donate_argnums=(0, 1))
    b = batches[0]
    t0 = time.perf_counter()
    compiled = jitted.lower(params, state, b[:, :-1], b[:, 1:]).compile()
    return {"compiled": compiled, "carry": (params, state), "compile_s": time.perf_counter() - t0,
            "padding": 0, "blocks_cut_32": blocks_cut_by_gspmd()[0]}


def train_interleaved(runs: dict[str, dict], batches: np.ndarray, warmup: int) -> None:
    """Step every run on batch i before any run takes batch i + 1, so load changes hit all runs alike."""
    for r in runs.values():
        r.update(step_s=[], losses=[], memory=memory(r["compiled"]),
                 collectives=collective_bytes(r["compiled"].as_text()))
    for i, b in enumerate(batches):
        for r in runs.values():
            t0 = time.perf_counter()
            *carry, loss = r["compiled"](*r["carry"], b[:, :-1], b[:, 1:])
            loss = float(loss)  # waits for the step
            if i >= warmup:
                r["step_s"].append(time.perf_counter() - t0)
            r["carry"] = tuple(carry)
            r["losses"].append(loss)


_COMM = ("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes", "other_collective_bytes")


def summarize(name: str, r: dict) -> dict:
    c = r["collectives"]
    return {
        "run": name,
        "median_step_ms": 1e3 * statistics.median(r["step_s"]),
        "min_step_ms": 1e3 * min(r["step_s"]),
        "compile_s": r["compile_s"],
        "all_gather_bytes": c["all-gather"]["bytes"], "all_gather_ops": c["all-gather"]["ops"],
        "reduce_scatter_bytes": c["reduce-scatter"]["bytes"],
        "reduce_scatter_ops": c["reduce-scatter"]["ops"],
        "all_reduce_bytes": c["all-reduce"]["bytes"], "all_reduce_ops": c["all-reduce"]["ops"],
        "other_collective_bytes": c["collective-permute"]["bytes"] + c["all-to-all"]["bytes"],
        "temp_bytes": r["memory"]["temp"], "argument_bytes": r["memory"]["argument"],
        "padding_elements": r["padding"], "blocks_cut_32": r["blocks_cut_32"],
        "final_loss": r["losses"][-1],
    }


def write_markdown(path: Path, rows: list[dict], meta: dict) -> None:
    cols = list(rows[0])
    lines = [f"# ragged-fsdp JAX backend vs GSPMD FSDP ({meta['devices']} host CPU devices)", "",
             f"llama-tiny, batch {meta['batch']} x seq {meta['seq']}, AdamW, {meta['steps']} steps "
             f"({meta['warmup']} warm-up, runs interleaved step by step), jax {meta['jax']}. "
             "Collective bytes: results of each kind of op in the compiled per-device program, i.e. per "
             "device per step. Memory: `memory_analysis()`.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = (f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values())
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *meta["statements"], ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--out", default="experiments/results")
    args = p.parse_args(argv)
    assert jax.device_count() >= DEVICES, f"needs {DEVICES} devices, found {jax.device_count()}"
    model = Llama(rngs=nnx.Rngs(0))
    batches = np.random.default_rng(0).integers(0, 256, size=(args.steps, args.batch, args.seq + 1))
    batches = batches.astype(np.int32)
    opt = optax.adamw(1e-3, weight_decay=0.1)
    runs = {
        "gspmd": prepare_gspmd(model, batches, opt),
        "ours": prepare_ours(model, batches, opt),
        "ours_remat": prepare_ours(model, batches, opt, remat=True),
        "ours_rows32": prepare_ours(model, batches, opt, granularity=rows32),
    }
    train_interleaved(runs, batches, args.warmup)
    raw = {k: {f: v for f, v in r.items() if f not in ("compiled", "carry")} for k, r in runs.items()}
    rows = [summarize(k, v) for k, v in raw.items()]
    g, o = rows[0], rows[1]
    loss_gap = max(abs(a - b) / abs(b) for a, b in zip(raw["ours"]["losses"], raw["gspmd"]["losses"]))
    cut, total = blocks_cut_by_gspmd()
    ratio = o["median_step_ms"] / g["median_step_ms"]
    statements = [
        f"- Step time: ours {o['median_step_ms']:.2f} ms vs GSPMD {g['median_step_ms']:.2f} ms, ratio "
        f"{ratio:.3f} ({'<=' if ratio <= 1 else '>'} 1); fastest steps {o['min_step_ms']:.2f} vs "
        f"{g['min_step_ms']:.2f} ms (ratio {o['min_step_ms'] / g['min_step_ms']:.3f}).",
        f"- Compile: ours {o['compile_s']:.2f} s vs GSPMD {g['compile_s']:.2f} s.",
        f"- All-gathered per device per step: ours {o['all_gather_bytes']} B vs GSPMD "
        f"{g['all_gather_bytes']} B; all collectives: ours {sum(o[k] for k in _COMM)} B vs GSPMD "
        f"{sum(g[k] for k in _COMM)} B.",
        f"- Compiled temp memory: ours {o['temp_bytes']} B, ours with remat {rows[2]['temp_bytes']} B, "
        f"GSPMD {g['temp_bytes']} B.",
        f"- Losses agree: largest relative gap over {args.steps} steps {loss_gap:.2e}.",
        f"- 32-row blocks: GSPMD's per-parameter sharding cuts {cut} of {total}; ours with 32-row "
        f"granularity cuts {rows[3]['blocks_cut_32']} (padding {rows[3]['padding_elements']} elements).",
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"devices": DEVICES, "batch": args.batch, "seq": args.seq, "steps": args.steps,
            "warmup": args.warmup, "jax": jax.__version__, "statements": statements}
    (out / "jax_vs_gspmd.json").write_text(json.dumps({"meta": meta, "rows": rows, "raw": raw}, indent=1))
    write_markdown(out / "jax_vs_gspmd.md", rows, meta)
    print((out / "jax_vs_gspmd.md").read_text())


if __name__ == "__main__":
    main()
