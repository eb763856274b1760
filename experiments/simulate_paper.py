"""The paper's cluster-scale results, simulated from the exact layouts: ours vs FSDP2 vs Megatron-FSDP.

Writes experiments/results/simulate_paper.{md,json} and simulate_paper_timeline.{svg,png} (GPT-OSS-120B's
step on 128 H800 for the three methods):

1. Table 1 (GPT-OSS-120B, 64 H800, FSDP2): the four per-layer times predicted with the default
   (assumed) efficiencies, then the efficiencies calibrated on them (which reproduce them exactly, by
   construction: that agreement checks nothing);
2. Figure 8's configurations (Llama-3-70B and GPT-OSS-120B on H800: FSDP@128, FSDP@256, HSDP 2x256 and
   4x256), with the Table 1 calibration, beside the paper's claims (who is faster, who runs out of memory);
3. weak and strong scaling of an 800B MoE built from public shapes (DeepSeek-V3's layers, 72 of them)
   on 1K-8K H800 in HSDP groups of 256;
4. a published single-node anchor predicted before any fitting: torchtitan's FSDP2 Llama-3.1-8B on 8 H100.

    python -m experiments.simulate_paper
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ragged.models import ModelShapes, UnitShapes, flops_per_token, model_shapes, model_units, trained_llama
from ragged.simulate import (
    PROFILES,
    Efficiency,
    StepConfig,
    calibrate,
    load_calibration,
    simulate,
    timeline_svg,
)

HERE = Path(__file__).parent
RESULTS = HERE / "results"
CALIBRATION = HERE / "calibration" / "paper_table1.json"
H800 = PROFILES["h800"]
# The paper does not state its per-GPU batch or sequence for Figure 8; these are this script's choices.
SEQ, BATCH = 4096, 1
FIGURE8 = [("FSDP@128", 128, 1), ("FSDP@256", 256, 1), ("HSDP 2x256", 512, 2), ("HSDP 4x256", 1024, 4)]
PAPER_SPEEDUP = {"llama3-70b": (1.05, 1.05), "gpt-oss-120b": (1.11, 1.66)}  # ours / FSDP2 throughput
PAPER_CLAIMS = {
    "llama3-70b": "ours about 5% faster than FSDP2; 16-30% less memory than the baselines",
    "gpt-oss-120b": "ours 11-66% faster; 16-30% less memory; FSDP2 out of memory at 256 GPUs (dim-0 padding "
                    "of 128 experts over 256 ranks)",
}
# torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1 (Grand Teton: H100 with 96 GB HBM2e at
# 2.4 TB/s, 500 W power limit, 400 Gb/s per GPU): Llama 3.1 8B, FSDP, 8 GPUs, local batch 2, seq 8192
# (train_configs/llama3_8b.toml at the benchmark's commit 9dec370), selective activation checkpointing with
# selective_ac_option = 'op' (that commit's parallelize_llama.py: save every matmul and attention output
# except every second matmul's). Its footnote: "the actual peak TFLOPs number is between SXM and NVL".
TORCHTITAN = {"tokens_per_s_per_gpu": 5762,
              "source": "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1, 'FSDP' row",
              "peak_flops": {"H100 SXM": 989e12, "H100 NVL": 835e12}}  # dense bf16, NVIDIA datasheets


def table1(eff_default: Efficiency, eff_cal: Efficiency) -> dict:
    cal = load_calibration(CALIBRATION)
    c, _ = trained_llama(cal.model)
    rows = []
    for label, eff in (("predicted (defaults)", eff_default), ("after calibration", eff_cal)):
        r = simulate(model_shapes(cal.model), c, H800, cal.config(), methods=["fsdp2"], efficiency=eff)[0]
        t = r.times[[u.name for u in r.units].index(cal.unit)]
        got = {k: 1e3 * getattr(t, k) for k in cal.measured_ms}
        rows.append({"setting": label, "ms": got,
                     "ratio": {k: got[k] / cal.measured_ms[k] for k in got}})
    return {"paper_ms": cal.measured_ms, "rows": rows}


def figure8(eff: Efficiency) -> list[dict]:
    out = []
    for model in ("llama3-70b", "gpt-oss-120b"):
        c, _ = trained_llama(model)
        for label, gpus, replicas in FIGURE8:
            cfg = StepConfig(gpus, replicas, BATCH, SEQ)
            sim = simulate(model_shapes(model), c, H800, cfg, efficiency=eff, name=model)
            results = {r.method: r for r in sim}
            row = {"model": model, "config": label, **{m: _summary(r) for m, r in results.items()}}
            ours, fsdp2, mega = results["ours"], results["fsdp2"], results["megatron"]
            row["speedup_vs_fsdp2"] = ours.tokens_per_s / fsdp2.tokens_per_s
            row["speedup_vs_megatron"] = ours.tokens_per_s / mega.tokens_per_s
            row["memory_saving_vs_fsdp2"] = 1 - ours.peak_bytes / fsdp2.peak_bytes
            row["memory_saving_vs_megatron"] = 1 - ours.peak_bytes / mega.peak_bytes
            row["held_saving_vs_fsdp2"] = 1 - ours.held_bytes / fsdp2.held_bytes
            out.append(row)
    return out


def sensitivity(eff: Efficiency) -> list[dict]:
    """FSDP@128 at 1, 2 and 4 sequences per GPU: how much the unknown batch moves the Figure 8 ratios."""
    out = []
    for model in ("llama3-70b", "gpt-oss-120b"):
        c, _ = trained_llama(model)
        for batch in (1, 2, 4):
            cfg = StepConfig(128, 1, batch, SEQ)
            r = {x.method: x for x in simulate(model_shapes(model), c, H800, cfg, efficiency=eff, name=model)}
            out.append({"model": model, "tokens_per_gpu": batch * SEQ,
                        "speedup_vs_fsdp2": r["ours"].tokens_per_s / r["fsdp2"].tokens_per_s,
                        "speedup_vs_megatron": r["ours"].tokens_per_s / r["megatron"].tokens_per_s,
                        "mfu_ours": r["ours"].mfu, "fits": {m: x.fits(H800) for m, x in r.items()}})
    return out


def moe_800b() -> tuple[ModelShapes, object]:
    """DeepSeek-V3's public layer shapes with 72 layers (3 dense, 69 MoE): about 800B parameters."""
    base = model_shapes("deepseek-v3")
    moe = base.units[4]  # layers.3, the first MoE layer
    layers = list(base.units[1:4])
    for i in range(3, 72):
        prefix = f"layers.{i}."
        tensors = tuple((prefix + n.split(".", 2)[2], s) for n, s in moe.tensors)
        layers.append(UnitShapes(f"layers.{i}", tensors))
    shapes = ModelShapes("moe-800b", (base.units[0], *layers, base.units[-1]))
    c, _ = trained_llama("deepseek-v3")
    return shapes, dataclasses.replace(c, n_layers=72)


def scaling(eff: Efficiency) -> list[dict]:
    shapes, c = moe_800b()
    # its 54k tensor specs built once: given the shapes, simulate builds them on each of the 8 calls
    units = model_units(shapes)
    rows = []
    global_tokens = 1024 * 2 * SEQ  # strong scaling: the 1K-GPU batch of 2 sequences per GPU, kept fixed
    for kind in ("weak", "strong"):
        for gpus in (1024, 2048, 4096, 8192):
            batch = 2 if kind == "weak" else max(1, global_tokens // (gpus * SEQ))
            seq = SEQ if kind == "weak" or global_tokens // gpus >= SEQ else global_tokens // gpus
            cfg = StepConfig(gpus, gpus // 256, batch, seq)
            results = simulate(units, c, H800, cfg, efficiency=eff, name="moe-800b")
            rows.append({"kind": kind, "gpus": gpus, "tokens_per_gpu": batch * seq,
                         **{r.method: _summary(r) for r in results}})
    for kind in ("weak", "strong"):
        mine = [r for r in rows if r["kind"] == kind]
        for r in mine:
            for m in ("ours", "fsdp2", "megatron"):
                r[m]["scaling_efficiency"] = (r[m]["tokens_per_s"] / mine[0][m]["tokens_per_s"]
                                              / (r["gpus"] / mine[0]["gpus"]))
    return rows


def torchtitan_anchor() -> dict:
    """The anchor at both ends of the published peak range, and with the recomputation the first version
    of this prediction wrongly assumed (none), to show what that error was worth."""
    c, _ = trained_llama("llama3-8b")  # Llama 3.1 8B has Llama 3 8B's shapes
    published = TORCHTITAN["tokens_per_s_per_gpu"]
    rows = []
    for (peak_name, peak), ac in [*((p, "selective-op") for p in TORCHTITAN["peak_flops"].items()),
                                  (("H100 SXM", TORCHTITAN["peak_flops"]["H100 SXM"]), False)]:
        hw = dataclasses.replace(
            PROFILES["h100"], name="h100-grand-teton", hbm_bytes=96e9, hbm_bandwidth=2.4e12, peak_flops=peak,
            sources={**PROFILES["h100"].sources, "hbm_bytes": "torchtitan: 96 GB HBM2e on Grand Teton",
                     "hbm_bandwidth": "torchtitan: 2.4 TB/s", "peak_flops": f"{peak_name} datasheet"})
        cfg = StepConfig(8, 1, 2, 8192, activation_checkpointing=ac)
        r = simulate(model_shapes("llama3-8b"), c, hw, cfg, methods=["fsdp2"], efficiency=Efficiency())[0]
        rows.append({"peak": peak_name, "activation_checkpointing": ac or "none", "predicted": _summary(r),
                     "ratio": r.tokens_per_s_per_gpu / published})
    layer = next(u for u in r.units if u.name == "layers.0")  # what the simulator charged for the policy
    return {"rows": rows, "published_tokens_per_s_per_gpu": published,
            "selective_gemm_fraction": layer.selective_op_gemm_flops / layer.gemm_flops,
            "published_mfu": published * flops_per_token(c, 8192) / TORCHTITAN["peak_flops"]["H100 SXM"],
            "source": TORCHTITAN["source"]}


def _summary(r) -> dict:
    return r.summary() | {"fits": r.fits(H800) if r.hardware == "h800" else None}


def report(data: dict) -> str:
    t1, eff, a = data["table1"], data["efficiency"], data["torchtitan"]
    pred = t1["rows"][0]["ratio"]
    off = {k: _pct(v - 1) for k, v in pred.items()}
    lines = [
        "# Simulated: the paper's cluster-scale results from the exact layouts", "",
        "Made by `python -m experiments.simulate_paper` (the model: docs/simulate.md). Every number below is "
        "a simulation, not a measurement. The paper states claims rather than these configurations' raw "
        "numbers, so the comparison is of directions and sizes of effects.", "",
        "## Table 1: FSDP2 per-layer times, GPT-OSS-120B on 64 H800", "",
        "| | all-gather | copy-out | reduce-scatter | copy-in |", "|---|---|---|---|---|",
        "| paper | " + " | ".join(f"{t1['paper_ms'][k]:.2f} ms" for k in t1["paper_ms"]) + " |"]
    for row in t1["rows"]:
        cells = [f"{row['ms'][k]:.2f} ms ({row['ratio'][k]:.2f}x)" for k in t1["paper_ms"]]
        lines.append(f"| {row['setting']} | " + " | ".join(cells) + " |")
    lines += [
        "", f"Before fitting (vendor peaks, the assumed 0.8 efficiencies) the model is {off['all_gather']} "
        f"on the all-gather, {off['ag_copy_out']} on the copy-out, {off['reduce_scatter']} on the "
        f"reduce-scatter and {off['rs_copy_in']} on the copy-in (the copy-in, with its bf16-to-fp32 cast, "
        "is the worst piece). The calibration solves one efficiency per measured piece, so after it the "
        "four times match exactly, by construction: that row checks the arithmetic, not the model. The "
        "constants:", ""]
    lines += [f"- `{k}` = {v['value']:.3f} ({v['source']})" for k, v in eff.items()]
    lines += [
        "", "## Figure 8 configurations (H800, Table 1 calibration)", "",
        f"Per GPU: {BATCH} x {SEQ} tokens, bf16 compute, fp32 gradient reduction, AdamW, full activation "
        "checkpointing (the paper does not state its batch: these are this script's choices). No expert "
        "parallelism: it has not landed in the simulator, so every expert is all-gathered to every GPU and "
        "the MoE rows are communication-bound (the paper caps that with cross-node EP).", "",
        "| model | config | tok/s/GPU ours | FSDP2 | Megatron | ours/FSDP2 | ours/Megatron "
        "| peak GiB ours | FSDP2 | Megatron | fits (ours/FSDP2/Megatron) |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["figure8"]:
        o, f, m = r["ours"], r["fsdp2"], r["megatron"]
        cells = [r["model"], r["config"], *(f"{x['tokens_per_s_per_gpu']:,.0f}" for x in (o, f, m)),
                 f"{r['speedup_vs_fsdp2']:.3f}", f"{r['speedup_vs_megatron']:.3f}",
                 *(_gib(x["peak_bytes"]) for x in (o, f, m)),
                 "/".join("yes" if x["fits"] else "OOM" for x in (o, f, m))]
        lines.append("| " + " | ".join(cells) + " |")
    held = ", ".join(f"{r['model']} {r['config']} {_pct(r['held_saving_vs_fsdp2'])}" for r in data["figure8"])
    lines += [
        "", "How much the unknown batch matters (FSDP@128):", "",
        "| model | tokens/GPU | ours/FSDP2 | ours/Megatron | MFU ours | fits (ours/FSDP2/Megatron) |",
        "|---|---|---|---|---|---|",
        *(f"| {r['model']} | {r['tokens_per_gpu']:,} | {r['speedup_vs_fsdp2']:.3f} | "
          f"{r['speedup_vs_megatron']:.3f} | {100 * r['mfu_ours']:.1f}% | "
          + "/".join("yes" if r["fits"][m] else "OOM" for m in ("ours", "fsdp2", "megatron")) + " |"
          for r in data["sensitivity"]),
        "", "The dense model's gain shrinks as more tokens per GPU hide the communication and FSDP2's copies "
        "(the paper's 5% lies inside the simulated range); the MoE without EP stays communication-bound, so "
        "its ratio does not move with the batch.",
        "", "Peak memory includes each baseline's allocator reserve *as the paper measured it* (FSDP2 12%, "
        "Megatron-FSDP 24%): that part is the paper's number, not a prediction. On held bytes alone (no "
        f"reserve), ours saves against FSDP2: {held}.", "", "### Against the paper's claims", "",
        *data["verdicts"], "",
        "## Weak and strong scaling: an 800B MoE (DeepSeek-V3's layers x 72), HSDP groups of 256", "",
        "Weak: 2 x 4096 tokens per GPU. Strong: the 1K-GPU global batch (8.4M tokens) kept fixed. Scaling "
        "efficiency is tokens/s per GPU relative to 1,024 GPUs.", "",
        "| kind | GPUs | tokens/GPU | tok/s/GPU ours | FSDP2 | Megatron | scaling eff. ours | FSDP2 "
        "| MFU ours |", "|---|---|---|---|---|---|---|---|---|"]
    for r in data["scaling"]:
        o, f, m = r["ours"], r["fsdp2"], r["megatron"]
        cells = [r["kind"], f"{r['gpus']:,}", f"{r['tokens_per_gpu']:,}",
                 *(f"{x['tokens_per_s_per_gpu']:,.1f}" for x in (o, f, m)),
                 f"{o['scaling_efficiency']:.3f}", f"{f['scaling_efficiency']:.3f}", f"{100 * o['mfu']:.1f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    sxm, nvl, no_ac = a["rows"]
    published = a["published_tokens_per_s_per_gpu"]
    within = "within" if max(abs(r["ratio"] - 1) for r in (sxm, nvl)) <= 0.2 else "outside"
    lines += [
        "", "The paper's scaling numbers are not in this project's notes (only that it scales to 10K GPUs), "
        "so these rows have no paper column. Without EP the MoE is bound by all-gathering all 800B "
        "parameters every step: weak scaling is flat because each GPU's traffic does not depend on the "
        "replica count, strong scaling falls with the tokens per GPU because the traffic does not shrink "
        "with them, and the absolute MFU is not comparable with an EP-based run's.", "",
        "## Anchor predicted before any fitting: torchtitan FSDP2 Llama-3.1-8B on 8 H100", "",
        "Default (uncalibrated) efficiencies; H100 with Grand Teton's 96 GB / 2.4 TB/s HBM; 2 x 8192 tokens "
        "per GPU; torchtitan's selective op activation checkpointing (every second matmul of a layer "
        "recomputed in backward, from its code at the benchmark's commit); peak bf16 FLOP/s at both ends of "
        f"the range the benchmark's footnote gives (between SXM and NVL). Source: {a['source']}.", "",
        "| | peak | recomputation | tokens/s/GPU | MFU (SXM peak) | off the published |",
        "|---|---|---|---|---|---|",
        f"| torchtitan (published) | | selective op | {published:,} | "
        f"{100 * a['published_mfu']:.1f}% (from its tokens/s, PaLM FLOPs) | |",
        *(f"| simulated | {r['peak']} | {r['activation_checkpointing']} | {r['ratio'] * published:,.0f} | "
          f"{100 * r['ratio'] * a['published_mfu']:.1f}% | {_pct(r['ratio'] - 1)} |" for r in a["rows"]), "",
        f"The prediction is {_pct(nvl['ratio'] - 1)} to {_pct(sxm['ratio'] - 1)} off the published "
        f"throughput over the published peak range ({within} the issue's 20%); no efficiency was fitted to "
        "it. Said plainly: the first version of this prediction modelled selective checkpointing as "
        f"recomputing nothing and was {_pct(no_ac['ratio'] - 1)} off (the last row); torchtitan's policy "
        f"recomputes {100 * a['selective_gemm_fraction']:.1f}% of each layer's matmul FLOPs (Llama-3-8B's "
        "wk, wo and w3), which the model now takes. Left out: the 500 W power limit's effect on sustained "
        "clocks (inside the peak range only as far as NVL's lower clocks are).", ""]
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> list[str]:
    out = []
    methods = ("ours", "fsdp2", "megatron")
    for model in PAPER_CLAIMS:
        mine = [r for r in rows if r["model"] == model]
        faster = [r["config"] for r in mine if r["speedup_vs_fsdp2"] > 1]
        sp = ", ".join(f"{r['config']} {r['speedup_vs_fsdp2']:.3f}" for r in mine)
        oom = [f"{m} at {r['config']}" for r in mine for m in methods if not r[m]["fits"]]
        held = [f"{m} at {r['config']}" for r in mine for m in methods if r[m]["held_bytes"] > H800.hbm_bytes]
        mega = ", ".join(f"{r['speedup_vs_megatron']:.3f}" for r in mine)
        saving = [100 * r[k] for r in mine for k in ("memory_saving_vs_fsdp2", "memory_saving_vs_megatron")
                  if r["fsdp2"]["fits"] or k.endswith("megatron")]
        lo, hi = PAPER_SPEEDUP[model]
        fit = [r["speedup_vs_fsdp2"] for r in mine if r["fsdp2"]["fits"]]
        where = ("inside" if lo - 0.02 <= min(fit) and max(fit) <= hi + 0.02 else
                 "below" if max(fit) < lo - 0.02 else "above" if min(fit) > hi + 0.02 else "partly outside")
        out += [f"- {model}: the paper says {PAPER_CLAIMS[model]}. Simulated ours/FSDP2 throughput: {sp}; "
                f"ours faster in {len(faster)} of {len(mine)} configurations. Where FSDP2 fits, the "
                f"simulated gain ({min(fit):.3f} to {max(fit):.3f}) is {where} the paper's {lo:.2f} to "
                f"{hi:.2f} (2 points of slack); where it does not, the paper has no FSDP2 throughput to "
                "compare.",
                f"  Out of memory on 80 GB with the paper's reserves: {', '.join(oom) or 'none'}; on held "
                f"bytes alone (no reserve): {', '.join(held) or 'none'}.",
                f"  Ours/Megatron-FSDP throughput: {mega}. Neither copies and their padding is similar, so "
                "the model sees almost no difference: the paper's gain over Megatron-FSDP is not reproduced.",
                f"  Peak-memory saving against a baseline that fits: {min(saving):.0f}% to "
                f"{max(saving):.0f}% (the paper: 16% to 30%), most of it the paper's own reserve figures."]
    return out


def main() -> dict:
    RESULTS.mkdir(exist_ok=True)
    cal = load_calibration(CALIBRATION)
    c, _ = trained_llama(cal.model)
    eff = calibrate(cal, model_shapes(cal.model), c, H800)
    fig8 = figure8(eff)
    data = {"table1": table1(Efficiency(), eff), "efficiency": eff.to_dict(), "figure8": fig8,
            "verdicts": verdicts(fig8), "sensitivity": sensitivity(eff), "scaling": scaling(eff),
            "torchtitan": torchtitan_anchor(),
            "settings": {"seq_len": SEQ, "batch_per_device": BATCH, "hardware": H800.to_dict()}}
    (RESULTS / "simulate_paper.json").write_text(json.dumps(data, indent=1) + "\n")
    (RESULTS / "simulate_paper.md").write_text(report(data))
    step = simulate(model_shapes(cal.model), c, H800, StepConfig(128, 1, BATCH, SEQ), efficiency=eff)
    (RESULTS / "simulate_paper_timeline.svg").write_text(timeline_svg(step))
    timeline_png(step, RESULTS / "simulate_paper_timeline.png")
    print(report(data))
    return data


def timeline_png(results: list, path: Path) -> None:
    """The same timeline as the SVG, drawn with matplotlib (the core's picture is SVG only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ragged.simulate import TIMELINE_COLORS

    fig, ax = plt.subplots(figsize=(12, 0.9 * len(results) + 1.2))
    labels = []
    for i, r in enumerate(results):
        for j, stream in enumerate(("compute", "comm")):
            y = 2 * (len(results) - 1 - i) + (1 - j)
            labels.append((y, f"{r.label}: {stream}"))
            for kind, colour in TIMELINE_COLORS.items():
                bars = [(o.start, o.seconds) for o in r.ops
                        if o.stream == stream and o.kind == kind and o.seconds]
                ax.broken_barh(bars, (y - 0.4, 0.8), color=colour, label=kind if i == j == 0 else None)
    ax.set_yticks([y for y, _ in labels], [text for _, text in labels])
    ax.set_xlabel("seconds into the step")
    ax.set_title(f"simulated step, {results[0].config.gpus} {results[0].hardware}")
    ax.legend(ncol=8, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


if __name__ == "__main__":
    main()
