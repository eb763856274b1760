"""How far 8-bit Adam moments drift from fp32 Adam's when both see the same gradients.

The 1.7M-parameter llama of ``experiments.adam8bit_quality`` trains with fp32 ``torch.optim.AdamW``; at
every step its gradients also feed *shadow* moments of each 8-bit scheme (each requantizing its own
state, as the optimizer would) and an exact fp32 shadow. Over the second half of the run, on every matrix
(the tensors both 8-bit optimizers quantize), it reports per scheme, weighted by elements:

- ``cos``: cosine between the scheme's Adam direction ``m_hat / (sqrt(v_hat) + eps)`` and fp32's;
- ``|d| / |d_fp32|``: their norm ratio (above 1: the scheme steps further, like a higher learning rate);
- ``m err``, ``sqrt(v) err``: relative L2 errors of the moments it holds after requantization;
- ``mean log(v / v_fp32)``: the bias of the second moment (over elements with ``v_fp32 > 0``);
- ``v = 0``: the fraction of elements whose stored ``v`` is 0 while fp32's is not (Adam divides by eps).

Schemes: ``ours`` (``Adam8bit``'s own functions: dynamic codebooks on 32x32 tiles, ``sqrt(v)`` stored),
``torchao`` (torchao's ``quant_utils``: dynamic codebooks on 256-element blocks, ``v`` stored), and
``linear`` (the former codes: ``round(127 m / max|m|)`` and ``round(255 sqrt(v) / max sqrt(v))`` per tile).

    python -m experiments.adam8bit_moment_error   # writes experiments/results/adam8bit_moment_error.{md,json}
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

import ragged
import ragged.quant
from experiments import adam8bit_quality as quality
from torch_backend.models import Llama, cross_entropy
from torch_backend.optim import from_tiles, requantize_moments, to_tiles

RESULTS = Path(__file__).parent / "results"
EPS = 1e-8
Requantize = Callable[[torch.Tensor, torch.Tensor, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]]


def ours(m: torch.Tensor, v: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``Adam8bit``'s round trip of flat fp32 moments (32x32 tiles, SIGNED m, UNSIGNED sqrt(v))."""
    return requantize_moments(m, v, shape, ragged.quant.TILE)


def torchao(m: torch.Tensor, v: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao ``AdamW8bit``'s round trip: 256-element blocks of the flat tensor, ``v`` itself."""
    from torchao.optim import quant_utils as ao  # an experiments-only dependency

    def trip(x, signed):
        qmap = torch.tensor(ao.create_dynamic_map(signed), dtype=torch.float32)
        unit, scale = ao.scale_tensor(x, 256)
        return ao.dequant_with_qmap(ao.quantize_8bit_with_qmap(unit, qmap), qmap, scale)
    return trip(m, True), trip(v, False)


def linear(m: torch.Tensor, v: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The former linear absmax codes on 32x32 tiles: 255 levels for ``m``, 256 for ``sqrt(v)``."""
    def trip(x, levels):
        tiles = to_tiles(x, shape, ragged.quant.TILE)
        scale = tiles.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
        return from_tiles(torch.round(tiles / scale * levels) / levels * scale, shape, ragged.quant.TILE)
    return trip(m, 127), trip(v.sqrt(), 255).square()


SCHEMES: dict[str, Requantize] = {"ours": ours, "torchao": torchao, "linear": linear}


def direction(m: torch.Tensor, v: torch.Tensor, step: int) -> torch.Tensor:
    b1, b2 = quality.BETAS
    return (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + EPS)


def measure(steps: int, lr: float, seed: int) -> dict:
    """Train with fp32 AdamW for ``steps``; the shadow statistics of every scheme over the second half."""
    torch.set_num_threads(1)
    train_ids, _ = quality.split(quality.stdlib_text())
    torch.manual_seed(0)
    model = Llama(quality.CONFIG)
    model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=quality.BETAS, weight_decay=quality.WEIGHT_DECAY)
    mats = {n: p for n, p in model.named_parameters() if p.ndim == 2}
    shadow = {s: {n: [torch.zeros(p.numel()), torch.zeros(p.numel())] for n, p in mats.items()}
              for s in ("fp32", *SCHEMES)}
    stats = {s: dict.fromkeys(("cos", "norm_ratio", "m_err", "sqrt_v_err", "log_v_bias", "v_zero"), 0.0)
             for s in SCHEMES}
    weight, b1, b2 = 0, *quality.BETAS
    for step, b in enumerate(quality.batches(train_ids, steps, 8, 128, seed=seed), start=1):
        quality.set_lr(opt, quality.lr_at(step - 1, steps, lr, max(1, steps // 10)))
        loss = cross_entropy(model(b[:, :-1]), b[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        record = step > steps // 2
        for n, p in mats.items():
            g = p.grad.reshape(-1)
            for m, v in (moments[n] for moments in shadow.values()):
                m.mul_(b1).add_(g * (1 - b1))
                v.mul_(b2).add_(g.square() * (1 - b2))
            m_ref, v_ref = shadow["fp32"][n]
            d_ref = direction(m_ref, v_ref, step)
            for s, requantize in SCHEMES.items():
                m, v = shadow[s][n]
                if record:
                    d, st, k = direction(m, v, step), stats[s], p.numel()
                    st["cos"] += k * float(d @ d_ref / (d.norm() * d_ref.norm()))
                    st["norm_ratio"] += k * float(d.norm() / d_ref.norm())
                m_q, v_q = requantize(m, v, tuple(p.shape))
                m.copy_(m_q)
                v.copy_(v_q)
                if record:
                    live = v_ref > 0
                    st["m_err"] += k * float((m - m_ref).norm() / m_ref.norm())
                    st["sqrt_v_err"] += k * float((v.sqrt() - v_ref.sqrt()).norm() / v_ref.sqrt().norm())
                    st["log_v_bias"] += k * float(torch.log(v[live].clamp_min(1e-45) / v_ref[live]).mean())
                    st["v_zero"] += k * float(((v == 0) & live).float().mean())
        weight += record * sum(p.numel() for p in mats.values())
        opt.step()
    return {s: {k: x / weight for k, x in st.items()} for s, st in stats.items()}


def _markdown(results: dict, steps: int, seed: int) -> str:
    lines = [
        "# 8-bit Adam moments against fp32 Adam's on the same gradients "
        "(`python -m experiments.adam8bit_moment_error`)",
        "",
        f"`experiments.adam8bit_quality`'s llama trained {steps} steps with fp32 AdamW (data seed {seed}); "
        "every scheme's shadow moments see the same gradients and requantize their own state each step. "
        "Statistics over the second half, on every matrix, weighted by elements (the script's docstring).",
        "",
        "| lr | scheme | cos(d, d_fp32) | \\|d\\| / \\|d_fp32\\| | m err | sqrt(v) err "
        "| mean log(v / v_fp32) | v = 0 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for lr, by_scheme in results.items():
        for s in SCHEMES:
            r = by_scheme[s]
            cells = (f"{r['cos']:.4f}", f"{r['norm_ratio']:.4f}", f"{100 * r['m_err']:.2f}%",
                     f"{100 * r['sqrt_v_err']:.2f}%", f"{r['log_v_bias']:+.4f}", f"{100 * r['v_zero']:.2f}%")
            lines.append(f"| {lr} | {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-2])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    t0 = time.perf_counter()
    results = {str(lr): measure(args.steps, lr, args.seed) for lr in args.lrs}
    print(f"{time.perf_counter() - t0:.0f} s")
    args.out.mkdir(exist_ok=True)
    (args.out / "adam8bit_moment_error.json").write_text(json.dumps(results, indent=1))
    (args.out / "adam8bit_moment_error.md").write_text(_markdown(results, args.steps, args.seed))
    print(_markdown(results, args.steps, args.seed))


if __name__ == "__main__":
    main()
