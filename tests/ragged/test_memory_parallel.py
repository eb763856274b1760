"""``memory_plan`` with tensor parallelism (``tp``) and expert parallelism (``ep``) against closed forms.

The references are written out here from the configs: llama-tiny's TP-local tensor sizes from Megatron's
split (column-parallel out dims, row-parallel in dims, vocabulary rows, whole norms), mixtral-tiny's
experts from its sizes. Where the data-parallel group has more than one device the parameter shards are
the planner's ``S`` of shapes this file builds itself, bounded below by ``ceil(numel / dp)``.
"""

import math

import pytest

import ragged
from ragged.models import MOE_CONFIGS, LlamaConfig, memory_plan, plan_expert_parallel, trained_model

C = LlamaConfig(256, 64, 4, 4, 4, 16, 176)  # llama-tiny with 4 kv heads (TP 4 splits whole heads)
BF16 = 2


def local_layer_numel(tp: int) -> int:
    """One decoder layer's TP-local elements: wq, wk, wv, wo (64 x 64), w1, w2, w3 (176 x 64), all split
    ``tp`` ways, and two whole norms of 64."""
    return (4 * 64 * 64 + 3 * 176 * 64) // tp + 2 * 64


def local_numel(tp: int) -> int:
    """The whole TP-local model: 4 layers, the embedding and the head (256 x 64, vocabulary split), a norm."""
    return 4 * local_layer_numel(tp) + 2 * 256 * 64 // tp + 64


def local_units(tp: int) -> list[tuple[str, list]]:
    """C's units with the TP-local shapes, built from the role of each tensor (not the core's table)."""
    units = [("tok_embeddings", [("tok_embeddings.weight", (256 // tp, 64))])]
    for i in range(4):
        p = f"layers.{i}"
        units.append((p, [(f"{p}.attention.{w}.weight", (64 // tp, 64)) for w in ("wq", "wk", "wv")]
                      + [(f"{p}.attention.wo.weight", (64, 64 // tp))]
                      + [(f"{p}.feed_forward.w1.weight", (176 // tp, 64)),
                         (f"{p}.feed_forward.w2.weight", (64, 176 // tp)),
                         (f"{p}.feed_forward.w3.weight", (176 // tp, 64)),
                         (f"{p}.attention_norm.weight", (64,)), (f"{p}.ffn_norm.weight", (64,))]))
    return units + [("output", [("norm.weight", (64,)), ("output.weight", (256 // tp, 64))])]


def activations(tp: int, tokens: int) -> int:
    """Saved per token and layer: the 2 x 64 gathered block inputs (bf16, whole on every TP rank), the heads'
    and hidden units' 6 x 64 + 4 x 176 values (bf16, split), the 2 x 64 fp32 norm inputs (sequence-split)."""
    return 4 * (tokens * BF16 * 2 * 64 + tokens * BF16 * (6 * 64 + 4 * 176) // tp + tokens // tp * 4 * 2 * 64)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_one_data_parallel_rank_holds_its_tp_share_unpadded(tp):
    """gpus = tp: no FSDP sharding, every TP-local size a multiple of the 4-element alignment."""
    plan = memory_plan("llama-mha", C, tp, tp=tp, seq_len=32, batch_per_device=2)
    assert plan.shard_group == 1 and plan.padding_ratio == 0
    assert (plan.params, plan.grads, plan.optimizer_state) == (4 * local_numel(tp), 4 * local_numel(tp),
                                                               8 * local_numel(tp))
    # the largest unit is a layer (50,176 / tp + 128 elements, the head 16,384 / tp + 64): two bf16 copies
    # gathered, its bf16 and fp32 gradient
    assert plan.unsharded == local_layer_numel(tp) * (3 * BF16 + 4)
    assert plan.activations == activations(tp, 64)
    # loss parallel: each device's logits are its 256 / tp vocabulary columns for the TP group's 64 tokens,
    # in bf16, in fp32 for the loss and their fp32 gradient
    assert plan.loss_parallel and plan.logits == 64 * (256 // tp) * (BF16 + 4 + 4)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_without_loss_parallel_every_tp_rank_holds_the_logits_of_the_whole_vocabulary(tp):
    plan = memory_plan("llama-mha", C, tp, tp=tp, seq_len=32, batch_per_device=2, loss_parallel=False)
    split = memory_plan("llama-mha", C, tp, tp=tp, seq_len=32, batch_per_device=2)
    assert plan.logits == 64 * 256 * (BF16 + 4 + 4)  # the head's output gathered on every TP rank
    assert plan.total - split.total == plan.logits - split.logits  # only the logits term changes
    assert ("loss parallel off" in plan.describe()) == (tp > 1)
    assert ("loss parallel on" in split.describe()) == (tp > 1)


@pytest.mark.parametrize("gpus, tp, replicas", [(8, 2, 1), (16, 2, 2), (12, 4, 1)])
def test_sharded_tp_local_units_are_the_planners_over_the_data_parallel_group(gpus, tp, replicas):
    plan = memory_plan("llama-mha", C, gpus, tp=tp, replicas=replicas, seq_len=32)
    dp = gpus // (tp * replicas)
    assert plan.shard_group == dp
    layouts = ragged.plan_model(local_units(tp), dp)
    shard = sum(lay.shard_size for lay in layouts)
    assert plan.params == 4 * shard and plan.optimizer_state == 8 * shard
    for lay, (_, tensors) in zip(layouts, local_units(tp)):  # a device holds at least its even share
        assert lay.shard_size >= math.ceil(sum(math.prod(s) for _, s in tensors) / dp)
    assert plan.padding_ratio == pytest.approx(1 - local_numel(tp) / (dp * shard))
    assert f"{replicas} replica(s) x {dp} shards x TP {tp}" in plan.describe()


def test_activation_checkpointing_keeps_each_layers_sequence_shard():
    plan = memory_plan("llama-mha", C, 4, tp=4, seq_len=32, batch_per_device=2, activation_checkpointing=True)
    # each layer's input (bf16, 64 wide) for the TP rank's 64 / 4 tokens, and one layer recomputed
    assert plan.activations == 4 * (64 // 4) * 64 * BF16 + activations(4, 64) // 4


@pytest.mark.parametrize("kwargs, match", [
    (dict(gpus=8, tp=3), "TP 3 must divide the 8 devices"),
    (dict(gpus=8, tp=2, replicas=3), "3 HSDP replicas must divide 4 data-parallel devices"),
    (dict(gpus=8, tp=2, seq_len=31), "TP 2 must divide seq_len=31"),
    (dict(gpus=8, tp=8), "TP 8 must divide n_heads=4"),
    (dict(gpus=8, ep=2), "EP 2 splits the experts of a mixture of experts"),
])
def test_tp_errors(kwargs, match):
    gpus = kwargs.pop("gpus")
    with pytest.raises(ragged.RaggedError, match=match):
        memory_plan("llama-mha", C, gpus, **kwargs)


def test_tp_on_a_mixture_of_experts_is_refused():
    c, _ = trained_model("mixtral-tiny")
    with pytest.raises(ragged.RaggedError, match="TP 2 is modelled for the llamas"):
        memory_plan("mixtral-tiny", c, 4, tp=2)


# ---- expert parallelism ------------------------------------------------------------------------------------
MIX = MOE_CONFIGS["mixtral-tiny"]  # dim 64, 2 layers, 8 experts of 96 (w1, w2, w3 modules), top-2
EXPERT = 3 * 64 * 96


def rest_units() -> list[tuple[str, list]]:
    """mixtral-tiny's units without the routed experts (which EP plans on their own)."""
    return [(u.name, [(n, s) for n, s in u.tensors if ".experts." not in n])
            for u in ragged.models.moe_shapes("mixtral-tiny", MIX).units]


def test_ep_with_one_device_per_ep_rank_holds_its_experts_whole():
    """2 devices, EP 2: each holds 4 experts of each of the 2 MoE layers unsharded, and half of the rest."""
    plan = memory_plan("mixtral-tiny", MIX, 2, ep=2, seq_len=16, batch_per_device=2)
    assert plan_expert_parallel(MIX, 2, 1)[0].local.shard_size == 4 * EXPERT
    rest = ragged.plan_model(rest_units(), 2)
    assert plan.params == 4 * (sum(lay.shard_size for lay in rest) + 2 * 4 * EXPERT)
    # the layer's unit and its 4 experts are gathered together (both layers alike)
    assert plan.unsharded == (rest[1].total_numel + 4 * EXPERT) * (3 * BF16 + 4)
    # dispatch and combine, a send and a receive buffer each, of top_k x tokens rows of 64 in bf16
    assert plan.all_to_all == 4 * 2 * 32 * 64 * BF16
    assert plan.activations == memory_plan("mixtral-tiny", MIX, 2, seq_len=16, batch_per_device=2).activations
    assert plan.total == sum(b for name, b in plan.rows() if name != "total per device")
    assert "EP 2 x 1 for the experts" in plan.describe()


@pytest.mark.parametrize("name, gpus, ep", [("mixtral-tiny", 8, 4), ("gpt-oss-tiny", 8, 2),
                                            ("gpt-oss-120b", 256, 8)])
def test_ep_keeps_the_sharded_state_and_shrinks_the_gathered_layer(name, gpus, ep):
    """Per device the experts' share is E / ep experts over gpus / ep devices, E over gpus without EP: the
    same elements, padding aside; the gathered MoE layer holds E / ep experts instead of E."""
    c = MOE_CONFIGS[name]
    with_ep, without = memory_plan(name, c, gpus, ep=ep), memory_plan(name, c, gpus)
    assert with_ep.params >= 4 * math.ceil(with_ep.numel / gpus)
    assert with_ep.params == pytest.approx(without.params, rel=0.02)
    assert with_ep.unsharded < without.unsharded / (ep / 2)


@pytest.mark.parametrize("gpus, ep, kwargs, match", [
    (3, 3, {}, "ep=3 must divide the 8 experts"),
    (4, 8, {}, "EP 8 must divide the shard group of 4 devices"),
    (8, 4, dict(replicas=4), "EP 4 must divide the shard group of 2 devices"),
    (4, 2, dict(sharding="fsdp2"), "EP 2 is planned with the planner only"),
])
def test_ep_errors(gpus, ep, kwargs, match):
    with pytest.raises(ragged.RaggedError, match=match):
        memory_plan("mixtral-tiny", MIX, gpus, ep=ep, **kwargs)
