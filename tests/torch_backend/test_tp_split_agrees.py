"""The torch llama's tensor-parallel plan (torchtitan's, ``torch_backend.models.apply_tensor_parallel``)
splits each parameter as the core's memory plan assumes (``ragged.models.LLAMA_TP_SPLIT``): read from the
DTensor placements the plan leaves on 2 gloo ranks (``Shard(d)``: dim d, ``Replicate``: whole)."""

from tests.torch_backend._dist import case_results, launch


def checks(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from ragged.models import LLAMA_TINY, tp_split_dim
    from tests.torch_backend._dist import run_cases
    from torch_backend.models import Llama, apply_tensor_parallel

    def split() -> None:
        model = apply_tensor_parallel(Llama(LLAMA_TINY), init_device_mesh("cpu", (world,)))
        got = {n: next((p.dim for p in t.placements if isinstance(p, Shard)), None)
               for n, t in model.named_parameters()}
        want = {n: tp_split_dim(n) for n in got}
        assert got == want, f"torch plan {got}\ncore {want}"

    return run_cases({"split": split})


def test_torch_plan_is_the_cores_split():
    case_results(launch(__file__, "checks", 2), "split")
