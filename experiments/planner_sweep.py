"""The planner's padding sweep (the paper's Figure 11), against FSDP1, FSDP2, ZeRO-3 and Megatron-FSDP.

Writes experiments/results/planner_sweep.csv, one planner_sweep_<model>.png per model and
planner_sweep.md (the acceptance statements, measured in this run). ``ragged sweep`` does the same.

    python -m experiments.planner_sweep                      # the full sweep
    python -m experiments.planner_sweep --models deepseek-v3 --world-sizes 8,1024
"""

from __future__ import annotations

import argparse

import ragged

_DEFAULTS = ragged.padding_sweep.__defaults__  # (models, world sizes, granularities)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(_DEFAULTS[0]), help="comma-separated presets")
    p.add_argument("--world-sizes", default=",".join(map(str, _DEFAULTS[1])), help="comma-separated ints")
    p.add_argument("--granularities", default=",".join(_DEFAULTS[2]), help="comma-separated")
    p.add_argument("--out", default="experiments/results", help="output folder")
    args = p.parse_args(argv)
    rows, paths = ragged.run_sweep(args.models.split(","), [int(m) for m in args.world_sizes.split(",")],
                                   args.granularities.split(","), args.out)
    for path in paths:
        print(f"wrote {path}")
    print((paths[-1]).read_text())


if __name__ == "__main__":
    main()
