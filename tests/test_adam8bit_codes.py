"""8-bit Adam's codes: the core codebook, and the same codes from the torch and the JAX optimizers.

References: bitsandbytes' dynamic map as torchao builds it, a brute-force nearest-entry search in numpy,
and each stack against the other on the same inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import ragged
import ragged.quant
from jax_backend.optim import _adam8bit as jax_adam8bit
from jax_backend.optim import scale_by_adam8bit
from ragged.quant.codebook import BUCKET_SHIFT, SIGNED, UNSIGNED, buckets
from torch_backend.optim import Adam8bit
from torch_backend.optim import _adam8bit as torch_adam8bit

BOOKS = {"signed": SIGNED, "unsigned": UNSIGNED}


@pytest.mark.parametrize("signed", [True, False])
def test_codebooks_are_the_bitsandbytes_dynamic_maps(signed):
    quant_utils = pytest.importorskip("torchao.optim.quant_utils")
    want = np.asarray(quant_utils.create_dynamic_map(signed=signed), np.float64)  # torch float32 linspace
    book = SIGNED if signed else UNSIGNED
    np.testing.assert_allclose(book.values, want, rtol=0, atol=1e-7)
    assert book.values[0] == (-book.values[-2] if signed else 0.0) and book.values[-1] == 1.0
    assert np.all(np.diff(book.values) > 0) and np.all(np.diff(book.thresholds) > 0)
    assert np.all((book.values[:-1] < book.thresholds) & (book.thresholds < book.values[1:]))


@pytest.mark.parametrize("name", ["signed", "unsigned"])
def test_bucket_tables_count_the_thresholds_at_every_bucket_edge_and_tie(name):
    """The tables' count equals a search of the thresholds at both ends of every bucket (where the count
    can change) and at every threshold and its float32 neighbours."""
    book = BOOKS[name]
    keys = np.arange(1 << (32 - BUCKET_SHIFT), dtype=np.uint32) << BUCKET_SHIFT
    ends = [keys.view(np.float32), (keys | ((1 << BUCKET_SHIFT) - 1)).view(np.float32)]
    ties = [book.thresholds, np.nextafter(book.thresholds, -np.inf), np.nextafter(book.thresholds, np.inf)]
    x = np.concatenate(ends + ties)
    x = x[np.isfinite(x)]
    key = x.view(np.uint32) >> BUCKET_SHIFT
    got = book.bucket_base[key] + (x >= book.bucket_threshold[key])
    np.testing.assert_array_equal(got, np.searchsorted(book.thresholds, x, side="right"))


def test_bucket_tables_refuse_thresholds_finer_than_a_bucket():
    with pytest.raises(ValueError, match="holds 2 thresholds"):
        buckets(np.array([1.0001, 1.0002], np.float32))  # in one bucket of [1, 1.0039)


def _tiles(signed: bool) -> np.ndarray:
    """(6, 1024) values spread over 12 decades, one tile all zero, exact codebook entries and midpoints."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 1024)) * np.logspace(-10, 2, 1024)[rng.permutation(1024)]
    x[2] = 0.0
    book = SIGNED if signed else UNSIGNED
    x[3, :256], x[3, 256:511] = book.values, book.thresholds  # scale 1: entries and exact ties
    x = x.astype(np.float32)
    return x if signed else np.abs(x)


def _nearest(x: np.ndarray, book) -> tuple[np.ndarray, np.ndarray]:
    """Brute force: per tile, the entry nearest ``x / absmax`` (ties to the larger entry) and the scale."""
    scale = np.abs(x).max(axis=1)
    unit = x / np.where(scale > 0, scale, 1)[:, None]
    dist = np.abs(unit[..., None].astype(np.float64) - book.values.astype(np.float64))
    codes = 255 - np.argmin(dist[..., ::-1], axis=-1)  # the last minimum: ties go up
    return codes.astype(np.uint8), scale


@pytest.mark.parametrize("name", ["signed", "unsigned"])
def test_both_stacks_store_the_nearest_codebook_entry_and_the_same_bits(name):
    book, x = BOOKS[name], _tiles(name == "signed")
    want_codes, want_scale = _nearest(x, book)
    tbook = torch_adam8bit.device_book(name == "signed", torch.device("cpu"))
    codes, scale = torch_adam8bit.quantize(torch.from_numpy(x), tbook)
    ids = jnp.repeat(jnp.arange(6), 1024)
    jcodes, jscale = jax.jit(lambda v: jax_adam8bit.quantize(v, ids, 6, book))(jnp.asarray(x.reshape(-1)))
    assert codes.dtype == torch.uint8 and jcodes.dtype == jnp.uint8
    np.testing.assert_array_equal(codes.numpy(), want_codes)
    np.testing.assert_array_equal(scale.numpy(), want_scale)
    np.testing.assert_array_equal(np.asarray(jcodes).reshape(6, 1024), want_codes)
    np.testing.assert_array_equal(np.asarray(jscale), want_scale)
    back = torch_adam8bit.dequantize(codes, scale, tbook).numpy()
    jback = np.asarray(jax_adam8bit.dequantize(jcodes, jscale, ids, book)).reshape(6, 1024)
    np.testing.assert_array_equal(jback, back)
    np.testing.assert_array_equal(back, book.values[want_codes] * want_scale[:, None])
    assert not back[2].any()  # an all-zero tile decodes to zeros


def test_torch_and_jax_optimizers_keep_the_same_codes_over_steps():
    """Same gradients, both stacks: the same codes and scales, bit for bit, after every step, and the same
    Adam direction (to float32 rounding: the bias corrections are float64 in torch, float32 in optax)."""
    shapes = {"w": (96, 64), "odd": (40, 8), "norm": (64,)}
    rng = np.random.default_rng(0)
    grads = [{k: (rng.standard_normal(s) * np.logspace(-6, 0, int(np.prod(s))).reshape(s)).astype(np.float32)
              for k, s in shapes.items()} for _ in range(4)]
    live = {k: torch.nn.Parameter(torch.zeros(s)) for k, s in shapes.items()}
    opt = Adam8bit(list(live.items()), lr=1.0, betas=(0.9, 0.95))  # lr 1, no decay: the step is -direction
    tx = scale_by_adam8bit(0.9, 0.95)
    state, update = tx.init({k: jnp.zeros(s) for k, s in shapes.items()}), jax.jit(tx.update)
    for g in grads:
        before = {k: p.detach().clone() for k, p in live.items()}
        for k, p in live.items():
            p.grad = torch.from_numpy(g[k])
        opt.step()
        direction, state = update({k: jnp.asarray(v) for k, v in g.items()}, state)
        for k, p in live.items():
            np.testing.assert_allclose((before[k] - p.detach()).numpy(), np.asarray(direction[k]), rtol=2e-5,
                                       atol=1e-6, err_msg=k)
    for k, p in live.items():
        for field in ("m_codes", "v_codes"):
            mine = torch_adam8bit.from_tiles(opt.state[p][field], shapes[k], ragged.quant.TILE).numpy()
            np.testing.assert_array_equal(mine, np.asarray(getattr(state, field)[k]), err_msg=f"{k}.{field}")
        for field in ("m_scale", "v_scale"):
            np.testing.assert_array_equal(opt.state[p][field].numpy(), np.asarray(getattr(state, field)[k]),
                                          err_msg=f"{k}.{field}")
