"""The HSDP advisor: every reported option re-planned independently, and the recommendation rule."""

import pytest

from ragged import RaggedError, TensorSpec, plan
from ragged.advise import advise
from ragged.advise._advise import merge_layers
from ragged.models import ModelShapes, UnitShapes, model_shapes
from ragged.models._shapes_file import model_units


def _replan(model, group_size, merge, granularity="rows:1"):
    """Whole-model padding with ``merge`` layers per unit, built and planned without the advisor."""
    units = model.units
    layers = [u for u in units if u.name.startswith("layers.")]
    groups = [[units[0]], *[layers[i:i + merge] for i in range(0, len(layers), merge)], [units[-1]]]
    padding = buffer = 0
    for group in groups:
        specs = [TensorSpec(n, s, granularity if len(s) >= 2 else "element")
                 for u in group for n, s in u.tensors]
        layout = plan(specs, group_size)
        padding += layout.padding
        buffer += group_size * layout.shard_size
    return padding / buffer


@pytest.mark.parametrize("target", [0.0, 0.003, 0.01, 0.05])
def test_advice_matches_independent_replans_and_rule(target):
    model = model_shapes("llama-tiny")
    advice = advise("llama-tiny", 8, "rows:1", max_padding=target, exhaustive=True)
    measured = {(g, k): _replan(model, g, k) for g in (8, 4, 2, 1) for k in (1, 2, 4)}
    assert {(o.group_size, o.merge) for o in advice.options} == set(measured)
    for o in advice.options:
        assert o.padding_ratio == pytest.approx(measured[o.group_size, o.merge])
        assert o.replicas * o.group_size == 8
    meeting = [gk for gk, p in measured.items() if p <= target]
    rec = advice.recommended
    if not meeting:
        assert rec is None
        return
    assert measured[rec.group_size, rec.merge] <= target
    # Rule: the smallest merge factor that meets the target, then the largest group at that merge.
    assert rec.merge == min(k for _, k in meeting)
    assert not any(k == rec.merge and g > rec.group_size for g, k in meeting)
    # Without exhaustive: the same recommendation, every group from 8 down to the recommended one.
    short = advise("llama-tiny", 8, "rows:1", max_padding=target)
    assert short.recommended == rec
    assert {o.group_size for o in short.options} == {g for g in (8, 4, 2, 1) if g >= rec.group_size}
    assert set(short.options) <= set(advice.options)


def _toy():
    # One layer of a [3, 4] matrix at rows:1 over 2 devices: S >= 2 rows, so 4 of 16 elements pad (25%).
    return ModelShapes("toy", (UnitShapes("layers.0", (("w", (3, 4)),)),))


def test_closed_forms_on_a_toy_model():
    advice = advise(_toy(), 2, max_padding=0.2, merge_factors=[1], itemsize=4)
    two, one = advice.options
    assert (two.group_size, two.padding_ratio, two.shard_numel, two.unit_numel) == (2, 0.25, 8, 12)
    assert two.allgather_bytes == 2 * (2 - 1) * 8 * 4  # forward and backward, one shard of 8 fp32
    assert (one.group_size, one.padding_ratio, one.allgather_bytes) == (1, 0.0, 0)
    assert advice.recommended == one
    assert advise(_toy(), 2, max_padding=0.2, merge_factors=[1], group_sizes=[2]).recommended is None


def test_merge_layers_names_and_order():
    units = model_units("llama-tiny")
    merged = merge_layers(units, 3)
    assert [u.name for u in merged] == ["tok_embeddings", "layers.0-2", "layers.3", "output"]
    assert [t.name for t in merged[1].tensors] == [t.name for u in units[1:4] for t in u.tensors]
    assert merge_layers(units, 1) == units
    with pytest.raises(RaggedError, match="merge factor must be an int >= 1, got 0"):
        merge_layers(units, 0)


@pytest.mark.parametrize("kwargs, message", [
    ({"gpus": 0}, "gpus must be an int >= 1, got 0"),
    ({"gpus": 8, "group_sizes": [3]}, r"group sizes \[3\] do not divide gpus=8"),
    ({"gpus": 8, "max_padding": 1.5}, r"max_padding must be a ratio in \[0, 1\), got 1.5"),
])
def test_bad_input(kwargs, message):
    with pytest.raises(RaggedError, match=message):
        advise("llama-tiny", **kwargs)
    with pytest.raises(RaggedError, match="unknown model 'nope'"):
        advise("nope", 8)


def _tp_local(model: ModelShapes, tp: int) -> ModelShapes:
    """Megatron's split written out by each tensor's role: out dim of wq wk wv w1 w3, in dim of wo w2,
    vocabulary rows of the embedding and the head; the norms whole."""
    split = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "wo": 1, "w2": 1, "tok_embeddings": 0, "output": 0}

    def local(name, shape):
        k = split.get(name.split(".")[-2])
        return shape if k is None else tuple(d // tp if i == k else d for i, d in enumerate(shape))
    return ModelShapes(model.name, tuple(UnitShapes(u.name, tuple((n, local(n, s)) for n, s in u.tensors))
                                         for u in model.units))


def test_tp_advice_plans_the_tp_local_units_over_the_data_parallel_devices():
    advice = advise("llama-tiny", 8, tp=2, max_padding=0.01, exhaustive=True)
    local = _tp_local(model_shapes("llama-tiny"), 2)
    assert advice.tp == 2
    assert {(o.group_size, o.merge) for o in advice.options} == {(g, k) for g in (4, 2, 1) for k in (1, 2, 4)}
    for o in advice.options:
        assert o.padding_ratio == pytest.approx(_replan(local, o.group_size, o.merge))
        assert o.replicas * o.group_size * 2 == 8
    with pytest.raises(RaggedError, match="tp=3 must be an int >= 1 dividing gpus=8"):
        advise("llama-tiny", 8, tp=3)
    with pytest.raises(RaggedError, match="TP 4 must divide n_kv_heads=2"):
        advise("llama-tiny", 8, tp=4)
    with pytest.raises(RaggedError, match=r"group sizes \[8\] do not divide gpus=8 / tp=2 = 4"):
        advise("llama-tiny", 8, tp=2, group_sizes=[8])
