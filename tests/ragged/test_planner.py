"""The planner on hand-made cases, on the model presets, and on bad input."""

import math

import pytest

from ragged import GranularityError, Layout, PlanningError, TensorSpec, granularity_for, plan, plan_model
from ragged._packing import earliest_start, place_by_class, place_in_order
from ragged._planner import first_fit_shard_size, search_shard_size
from ragged.bench import baseline_layouts
from ragged.models import UnitSpecs, model_shapes
from tests.ragged.checker import check_layout, expected_block


def _specs(layout):
    return [(t.name, t.shape, t.block) for t in layout.tensors]


# ----- stages -----------------------------------------------------------------------------------

@pytest.mark.parametrize("shard,align", [(6, 1), (7, 1), (13, 1), (6, 2), (8, 2), (8, 4), (12, 4)])
@pytest.mark.parametrize("numel,block", [(1, 1), (5, 5), (8, 4), (9, 3), (12, 6), (24, 2), (20, 20)])
def test_earliest_start_is_the_first_valid_offset(shard, align, numel, block):
    """Against a direct scan of every offset, for every cursor in three shards."""
    def valid(p):
        return p % align == 0 and all((k * shard - p) % block == 0
                                      for k in range(p // shard + 1, -(-(p + numel) // shard)))
    for cur in range(3 * shard):
        want = next((p for p in range(cur, cur + 4 * shard * block) if valid(p)), None)
        assert earliest_start(cur, numel, block, shard, align) == want


def test_fixed_orders_and_class_schedules():
    """S = 8, two shards: the second 6 (blocks of 3) cannot cross 8 at 2, so the 4 goes between."""
    items = [(6, 3), (6, 3), (4, 1)]
    classes = (((6, 3), (0, 1)), ((4, 1), (2,)))
    assert place_in_order(items, [0, 1, 2], 8, 2, 1) is None
    assert place_in_order(items, [0, 2, 1], 8, 2, 1) == [0, 10, 6]
    # tolerant: a 2-element gap is below the 6's offset step of 3, so it is taken and 4 overflows
    assert place_by_class(items, classes, 8, 2, 1, tolerant=True) is None
    assert place_by_class(items, classes, 8, 2, 1, tolerant=False) == [0, 10, 6]
    assert place_by_class(items, classes, 8, 2, 1, tolerant=True, rigid_first=True) is None


def test_class_scheduling_uses_flexible_tensors_to_fill_gaps():
    """Rigid tensors (blocks of 3 with S = 8) fit only if the flexible ones sit between them."""
    items = [(9, 3)] * 4 + [(7, 1)] * 4
    assert place_in_order(items, range(8), 16, 4, 1) is None  # the given order fails
    shard, offsets = search_shard_size(items, 4, 1)
    assert shard == 16
    layout = plan([(f"t{i}", (e,), g) for i, (e, g) in enumerate(items)], 4, align=1)
    check_layout(layout.to_dict(), _specs(layout), 4, 1)


def test_plan_is_never_worse_than_first_fit_or_megatron():
    specs = [TensorSpec(f"t{i}", (r, 8), "rows:1") for i, r in enumerate([7, 3, 12, 5, 9, 1, 2, 6, 11])]
    items = [(s.numel, s.block) for s in specs]
    for world in (1, 2, 3, 5, 7, 16):
        layout = plan(specs, world, align=4)
        first_fit = first_fit_shard_size(items, world, 4)
        megatron = baseline_layouts(specs, world, align=4)[-1]
        assert layout.shard_size <= first_fit[0]
        assert layout.shard_size <= megatron.shard_size
        check_layout(layout.to_dict(), _specs(layout), world, 4)


def test_lower_bound_and_gap():
    """A tensor of two shards or more forces S to a multiple of its block (the ShardGrid)."""
    layout = plan([("big", (100, 3), "rows:1"), ("small", (4,), "element")], 10, align=1)
    # basic bound: ceil(304 / 10) = 31; big (300 >= 2 * 31) forces a multiple of 3: 33
    assert layout.lower_bound == 33
    assert layout.shard_size == 33 and layout.gap == 0.0


# ----- presets ----------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["deepseek-v3", "gpt-oss-120b"])
@pytest.mark.parametrize("granularity", ["rows:1", "rows:16"])
@pytest.mark.parametrize("world", [8, 64, 256])
def test_preset_padding_target(model, granularity, world):
    """The issue's target: <= 3% padding over the model at 1 and 16 rows up to 256 devices."""
    layouts = plan_model(model_shapes(model), world, granularity, itemsize=2)
    total = sum(layout.total_numel for layout in layouts)
    used = sum(layout.used_numel for layout in layouts)
    assert (total - used) / total <= 0.03


@pytest.mark.parametrize("model,granularity,world", [
    ("deepseek-v3", "rows:16", 1024), ("deepseek-v3", "rows:1", 1024), ("deepseek-v3", "rows:16", 512),
    ("gpt-oss-120b", "rows:16", 1024), ("gpt-oss-120b", "rows:1", 512), ("llama3-70b", "rows:16", 1024),
])
def test_presets_reach_the_lower_bound_and_beat_megatron(model, granularity, world):
    """On every distinct unit the shard size equals the structural lower bound (so it is optimal)
    and the padding is at most the Megatron-style baseline's; the checker passes."""
    layouts = plan_model(model_shapes(model), world, granularity, itemsize=2)
    seen = set()
    for unit, layout in zip(model_shapes(model).units, layouts):
        key = tuple(s for _, s in unit.tensors)
        if key in seen:
            continue
        seen.add(key)
        assert layout.shard_size == layout.lower_bound, unit.name
        specs = [TensorSpec(n, s, granularity_for(s, granularity)) for n, s in unit.tensors]
        megatron = baseline_layouts(specs, world, align=layout.align)[-1]
        assert layout.padding <= megatron.padding, unit.name
        check_layout(layout.to_dict(), [(n, s, expected_block(s, granularity if len(s) > 1 else "element"))
                                        for n, s in unit.tensors], world, 8)


@pytest.mark.parametrize("model,granularity,world,unit", [
    ("mixtral-8x7b", "rows:1", 32, 1),  # first fit lands on a multiple of 4096; candidate_bases finds it
    ("deepseek-v3", "rows:16", 128, 4),  # a dense grid where the bound itself is infeasible
    ("deepseek-v3", "rows:16", 8, 1),
])
def test_presets_never_worse_than_the_model_order_first_fit(model, granularity, world, unit):
    shapes = model_shapes(model).units[unit]
    specs = [TensorSpec(n, s, granularity_for(s, granularity)) for n, s in shapes.tensors]
    layout = plan(specs, world, itemsize=2)
    first_fit = first_fit_shard_size([(s.numel, s.block) for s in specs], world, 8,
                                     limit=layout.shard_size - 1)
    assert first_fit is None


def test_deepseek_moe_layer_beats_the_model_order_greedy():
    """The issue's example: 16 rows, 1024 devices; the paper's greedy in model order pads ~12%."""
    unit = model_shapes("deepseek-v3").units[10]
    specs = [TensorSpec(n, s, granularity_for(s, "rows:16")) for n, s in unit.tensors]
    layout = plan(specs, 1024, itemsize=2, name=unit.name)
    greedy = first_fit_shard_size([(s.numel, s.block) for s in specs], 1024, 8)
    assert layout.shard_size < greedy[0]
    # Bound: 5%, under half the ~12% of the paper's greedy quoted above; gap 0: the lower bound is reached.
    assert layout.padding_ratio < 0.05 and layout.gap == 0.0


def test_plan_model_reuses_layouts_and_matches_plan():
    model = model_shapes("llama-tiny")
    layouts = plan_model(model, 3, "rows:1")
    assert [layout.name for layout in layouts] == [u.name for u in model.units]
    for unit, layout in zip(model.units, layouts):
        direct = plan([TensorSpec(n, s, granularity_for(s, "rows:1")) for n, s in unit.tensors], 3,
                      name=unit.name)
        assert layout == direct
        assert Layout.from_json(layout.to_json()) == layout


def test_plan_model_takes_every_unit_form_and_a_granularity_function():
    """UnitShapes, UnitSpecs, (name, pairs) and (name, TensorSpecs) plan alike; a function sees each FQN."""
    units = model_shapes("llama-tiny").units
    seen = []

    def rule(fqn, shape):
        seen.append(fqn)
        return "rows:16" if fqn.endswith("w2.weight") else granularity_for(shape, "rows:1")

    layouts = plan_model(units, 4, rule)
    assert seen == [fqn for u in units for fqn, _ in u.tensors]
    specs = [(u.name, [TensorSpec(n, s, rule(n, s)) for n, s in u.tensors]) for u in units]
    assert plan_model(specs, 4) == layouts
    assert plan_model([UnitSpecs(n, tuple(t)) for n, t in specs], 4) == layouts
    assert plan_model([(u.name, list(u.tensors)) for u in units], 4, rule) == layouts
    for (name, tensors), layout in zip(specs, layouts):
        assert layout == plan(tensors, 4, name=name)


def test_plan_model_does_not_share_a_plan_across_different_blocks():
    a = ("a", [("a.w", (64, 8))])
    b = ("b", [("b.w", (64, 8))])
    la, lb = plan_model([a, b], 3, lambda n, s: "rows:16" if n == "b.w" else "rows:1")
    assert la.slot("a.w").block == 8 and lb.slot("b.w").block == 128
    assert lb == plan([TensorSpec("b.w", (64, 8), "rows:16")], 3, name="b")
    with pytest.raises(PlanningError, match=r"a unit must be UnitShapes, UnitSpecs or \(name, tensors\)"):
        plan_model([42], 2)


def test_renamed_checks_names():
    layout = plan([("a", (4,)), ("b", (4,))], 2)
    with pytest.raises(PlanningError, match="duplicate tensor names"):
        layout.renamed(("x", "x"), "u")
    with pytest.raises(PlanningError, match="1 names for 2 tensors"):
        layout.renamed(("x",), "u")


# ----- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [0, -3, 2.0, True, "4"])
def test_world_size_must_be_a_positive_int(world):
    with pytest.raises(PlanningError, match="unit 'u0': world_size must be an int >= 1"):
        plan([("a", (4,))], world, name="u0")


@pytest.mark.parametrize("align", [0, -8, 1.5, False])
def test_align_must_be_a_positive_int(align):
    with pytest.raises(PlanningError, match="align must be an int >= 1"):
        plan([("a", (4,))], 2, align=align)


def test_duplicate_names_are_rejected():
    with pytest.raises(PlanningError, match=r"duplicate tensor names \['a'\]"):
        plan([("a", (4,)), ("a", (2,))], 2)


def test_granularity_that_does_not_divide_names_the_tensor():
    with pytest.raises(GranularityError, match=r"layers.0.w: granularity rows:16 does not divide.*10 rows"):
        plan([("layers.0.w", (10, 4), "rows:16")], 2)
    with pytest.raises(GranularityError, match=r"router: .*8 rows"):
        plan_model([type(model_shapes("llama-tiny").units[0])("u", (("router", (8, 4)),))], 2, "rows:16")


def test_negative_dims_are_rejected():
    with pytest.raises(PlanningError, match="bad: shape .* has a negative dim"):
        plan([("bad", (3, -1))], 2)


def test_empty_and_zero_size_units():
    assert plan([], 3).shard_size == 4
    layout = plan([("z", (0, 5)), ("one", (1,))], 3, align=1)
    check_layout(layout.to_dict(), [("z", (0, 5), 1), ("one", (1,), 1)], 3, 1)
    assert layout.shard_size == 1 and math.isclose(layout.padding_ratio, 2 / 3)


@pytest.mark.parametrize("bad", [("a",), {"name": "a"}, 7, ("a", 4)])
def test_malformed_tensor_entries_are_named(bad):
    with pytest.raises(PlanningError, match=r"unit 'u': tensor #1 .* is not a TensorSpec"):
        plan([("ok", (2,)), bad], 2, name="u")


def test_tensor_entry_forms_agree():
    forms = [[TensorSpec("a", (4, 2), "rows:2")], [("a", (4, 2), "rows:2")], [("a", [4, 2], "rows:2")],
             [{"name": "a", "shape": [4, 2], "granularity": "rows:2"}], [("a", (4, 2))]]
    layouts = [plan(f, 3, granularity="rows:2") for f in forms]
    assert all(layout == layouts[0] for layout in layouts)
