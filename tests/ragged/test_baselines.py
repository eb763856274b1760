"""Baselines against brute-force numpy simulation and closed forms."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragged import PlanningError, TensorSpec
from ragged._baselines import count_split_blocks, megatron_offsets
from ragged.bench import baseline_layouts


def ceil_to(x, k):
    return -(-x // k) * k


def _split_by_owner(owner_of_element, block):
    """Blocks whose elements live on more than one device, from a per-element owner array."""
    if owner_of_element.size == 0 or block == 1:
        return 0
    per_block = owner_of_element.reshape(-1, block)
    return int((per_block.min(axis=1) != per_block.max(axis=1)).sum())


def _brute_flat(specs, offsets, shard):
    """Cut a flat buffer into shards of ``shard`` and count cut blocks element by element."""
    return sum(_split_by_owner((o + np.arange(s.numel)) // shard, s.block) for s, o in zip(specs, offsets))


def _brute_fsdp2(specs, m):
    split, shard = 0, 0
    for s in specs:
        if s.numel == 0:
            continue
        rows = s.shape[0] if s.shape else 1
        per_row = s.numel // rows
        chunks = np.array_split(np.arange(rows), range(-(-rows // m), rows, -(-rows // m)))  # torch.chunk
        assert len(chunks) <= m
        owner = np.concatenate([np.full(len(c) * per_row, d) for d, c in enumerate(chunks)])
        split += _split_by_owner(owner, s.block)
        shard += max(len(c) for c in chunks) * per_row
    return shard, split


def _brute_zero3(specs, m):
    split, shard = 0, 0
    for s in specs:
        part = -(-s.numel // m)
        shard += part
        if part:
            split += _split_by_owner(np.arange(s.numel) // part, s.block)
    return shard, split


_shapes = st.lists(st.integers(0, 6), min_size=1, max_size=3).map(tuple)


@st.composite
def _unit(draw):
    specs = []
    for i in range(draw(st.integers(1, 5))):
        shape = draw(_shapes)
        numel = math.prod(shape)
        block = draw(st.sampled_from([d for d in range(1, max(numel, 1) + 1) if numel % d == 0]))
        specs.append(TensorSpec(f"t{i}", shape, block))
    return specs


@settings(max_examples=300, deadline=None)
@given(specs=_unit(), m=st.integers(1, 9), align=st.sampled_from([1, 2, 4]))
def test_baselines_match_brute_force(specs, m, align):
    fsdp1, fsdp2, zero3, megatron = baseline_layouts(specs, m, align=align)
    used = sum(s.numel for s in specs)
    for b in (fsdp1, fsdp2, zero3, megatron):
        assert b.used_numel == used and b.shard_size % align == 0 and b.padding >= 0

    offsets, cur = [], 0
    for s in specs:  # FSDP1: aligned back-to-back offsets
        cur = ceil_to(cur, align)
        offsets.append(cur)
        cur += s.numel
    assert fsdp1.shard_size == ceil_to(max(1, -(-cur // m)), align)
    assert fsdp1.split_blocks == _brute_flat(specs, offsets, fsdp1.shard_size)

    shard, split = _brute_fsdp2(specs, m)
    assert (fsdp2.shard_size, fsdp2.split_blocks) == (ceil_to(max(shard, 1), align), split)
    shard, split = _brute_zero3(specs, m)
    assert (zero3.shard_size, zero3.split_blocks) == (ceil_to(max(shard, 1), align), split)

    # Megatron-style: a valid buffer (no overlap, aligned, inside m shards) that cuts no block.
    offs, chunk, end = megatron_offsets(specs, align)
    assert megatron.shard_size % chunk == 0 and end <= m * megatron.shard_size
    spans = sorted((o, o + s.numel) for o, s in zip(offs, specs) if s.numel)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert all(o % align == 0 for o in offs)
    assert megatron.split_blocks == _brute_flat(specs, offs, megatron.shard_size) == 0


def test_fsdp2_doubles_128_experts_on_256_ranks():
    # GPT-OSS-style fused experts: dim 0 of 128 padded to 256 rows, half the buffer is padding.
    experts = TensorSpec("experts.gate_up_proj", (128, 2880, 5760), "rows:1")
    fsdp1, fsdp2, zero3, megatron = baseline_layouts([experts], 256)
    assert fsdp2.total_numel == 2 * experts.numel and fsdp2.padding_ratio == 0.5
    assert fsdp2.split_blocks == 0
    # Element-wise methods pad nothing here (numel is a multiple of 256) ...
    assert fsdp1.padding == zero3.padding == 0
    # At 1024 ranks and rows:16, FSDP1's flat shards hold 360 rows each and cut 16-row blocks, while
    # FSDP2 keeps them whole at the price of 1024 padded expert slots for 128 experts.
    cut = baseline_layouts([TensorSpec("e", (128, 2880, 5760), "rows:16")], 1024)
    assert cut[0].split_blocks > 0 and cut[1].split_blocks == 0 and cut[3].split_blocks == 0
    assert cut[1].padding_ratio == 1 - 128 / 1024


@pytest.mark.parametrize("numel, m, expect_shard", [(10, 4, 3), (12, 4, 3), (1, 8, 1), (0, 3, 1)])
def test_zero3_closed_form(numel, m, expect_shard):
    (_, _, zero3, _) = baseline_layouts([TensorSpec("w", (numel,))], m, align=1)
    assert zero3.shard_size == expect_shard
    assert zero3.padding == m * expect_shard - numel


def test_megatron_pads_to_the_lcm_grid():
    # Rows of 6 and 4 elements: chunks of lcm(4, 6, 4) = 12; each tensor starts on the grid.
    specs = [TensorSpec("a", (5, 6), "rows:1"), TensorSpec("b", (3, 4), "rows:1")]
    offs, chunk, end = megatron_offsets(specs, 4)
    assert chunk == 12 and offs == [0, 36] and end == 48
    b = baseline_layouts(specs, 2, align=4)[3]
    assert b.shard_size == 24 and b.padding == 48 - 42 and b.split_blocks == 0


def test_megatron_fills_gaps_first_fit():
    # chunk = lcm(2, 4) = 4; "a" leaves a gap [10, 12) that the small "norm" takes; "c" is appended.
    specs = [TensorSpec("a", (5, 2), "rows:1"), TensorSpec("w", (2, 4), "rows:1"), TensorSpec("norm", (2,)),
             TensorSpec("c", (3,))]
    offs, chunk, end = megatron_offsets(specs, 1)
    assert chunk == 4 and offs == [0, 12, 10, 20] and end == 23
    # A small tensor that would straddle a grid point mid-block moves to that grid point.
    specs = [TensorSpec("a", (4,), 4), TensorSpec("b", (1,)), TensorSpec("c", (2,), 2)]
    offs, chunk, end = megatron_offsets(specs, 1)
    assert chunk == 4 and offs == [0, 4, 5] and end == 7  # c fits before the grid point 8
    specs = [TensorSpec("a", (4,), 4), TensorSpec("b", (3,)), TensorSpec("c", (2,), 2)]
    offs, chunk, end = megatron_offsets(specs, 1)
    assert offs == [0, 4, 8] and end == 10


def test_count_split_blocks_each_block_once():
    # Boundaries every 3 elements inside one block of 10: one block cut, counted once.
    assert count_split_blocks(0, 10, 10, 3, 5) == 1
    assert count_split_blocks(0, 12, 4, 4, 2) == 0  # boundaries on block edges
    assert count_split_blocks(2, 8, 4, 4, 5) == 2  # boundaries at 4, 8 -> positions 2 and 6


def test_allgather_bytes_counts_padding():
    b = baseline_layouts([TensorSpec("w", (10,))], 4, align=1)[2]  # ZeRO-3: 3 per device
    assert b.allgather_bytes(2) == 3 * 3 * 2


@pytest.mark.parametrize("world_size", [0, -1, 2.0, True])
def test_bad_world_size(world_size):
    with pytest.raises(PlanningError, match="world_size"):
        baseline_layouts([TensorSpec("w", (4,))], world_size)
