"""The native prompt attention (native/prompt_attention.h): causal softmax attention within
float32 summation of a float64 reference, over float32 and bf16 keys and values, across
block edges, grouped heads and head sizes; through the paged-cache op as ref's twin; rows
independent of their chunk; clear refusals; and where the engine chooses it."""

from __future__ import annotations

import platform

import pytest
import torch
from test_ref_kernels import _dense_attention, _gen, _scatter

from baton.engine.cpu_features import CpuInfo
from baton.engine.kernels import ref
from baton.engine.native import build
from baton.engine.native import prompt_attention as native


@pytest.fixture(scope="module")
def lib():
    lib = build.load()
    if lib is None:
        pytest.skip(f"native library unavailable: {build.failure()}")
    reason = native.supported(lib, 4, 2, 64, torch.float32)
    if reason is not None:
        pytest.skip(f"native prompt attention unavailable here: {reason}")
    return lib


def _causal_tail(n: int, ctx: int) -> torch.Tensor:
    """[n, ctx]: row i (position ctx - n + i) sees keys 0..its position."""
    return torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]


SHAPES = [  # n, ctx, hq, hkv, d
    (1, 1, 2, 1, 16),  # one token
    (5, 5, 9, 3, 64),  # SmolLM2's heads, a fresh prompt shorter than a key block
    (40, 100, 9, 3, 64),  # extend: 60 cached, rows spanning task blocks and key blocks
    (33, 33, 8, 8, 128),  # no grouping, the widest head
    (70, 70, 8, 4, 16),  # groups of two, 32 rows a task
    (64, 64, 64, 1, 16),  # 64 query heads to one KV head: one chunk row a task
]


@pytest.fixture(scope="module")
def portable_lib():
    """The library built for any x86-64 CPU: the attention's portable C form without AVX2."""
    if platform.machine() != "x86_64":
        pytest.skip("the portable build is an x86 one")
    return build.library_for("x86-64")


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, ctx, hq, hkv, d", SHAPES)
def test_matches_causal_attention(lib, kv_dtype, n, ctx, hq, hkv, d):
    _check_causal_attention(lib, kv_dtype, n, ctx, hq, hkv, d)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, ctx, hq, hkv, d", SHAPES)
def test_the_portable_form_matches_causal_attention(portable_lib, kv_dtype, n, ctx, hq, hkv, d):
    _check_causal_attention(portable_lib, kv_dtype, n, ctx, hq, hkv, d)


def _check_causal_attention(lib, kv_dtype, n, ctx, hq, hkv, d):
    g = _gen(n + ctx)
    q = 3 * torch.randn(n, hq, d, generator=g)  # scaled: peaked softmax rows too
    k, v = (torch.randn(ctx, hkv, d, generator=g).to(kv_dtype) for _ in range(2))
    got = native.attend(lib, q, k, v, d**-0.5)
    want = _dense_attention(q, k.float(), v.float(), d**-0.5, _causal_tail(n, ctx))
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("engine", ["avx512", "amx"])
@pytest.mark.parametrize("n, ctx, hq, hkv, d", [
    (5, 5, 9, 3, 64), (40, 100, 9, 3, 64), (33, 33, 8, 8, 128), (3, 35, 2, 1, 32),  # an odd last key pair
    (70, 70, 9, 3, 64),  # 210 rows of one KV head: tasks of 63, the last tile of 16 part empty
])
def test_bf16_products_are_as_close_as_torchs_bf16_attention(lib, engine, n, ctx, hq, hkv, d):
    if not native.takes_bf16(lib, engine):
        pytest.skip(f"this library or CPU has no bf16 products on {engine}")
    g = _gen(n + ctx)
    q = 3 * torch.randn(n, hq, d, generator=g)
    k, v = (torch.randn(ctx, hkv, d, generator=g).bfloat16() for _ in range(2))
    got = native.attend(lib, q, k, v, d**-0.5, bf16=True, engine=engine)
    want = _dense_attention(q.bfloat16().float(), k.float(), v.float(), d**-0.5, _causal_tail(n, ctx))
    # the probabilities rounded to bf16 before the values' sums, as torch's bf16 attention
    # rounds them (which also rounds its output: ~8e-3 here)
    torch.testing.assert_close(got.double(), want, atol=6e-3, rtol=1e-2)
    assert (got.double() - want).abs().mean() < 1e-3
    assert torch.equal(native.attend(lib, q[-1:], k, v, d**-0.5, bf16=True, engine=engine)[0], got[-1])


@pytest.mark.parametrize("engine", ["avx512", "amx"])
@pytest.mark.parametrize("n, ctx, d", [(13, 13, 64), (5, 77, 32), (40, 1000, 64), (9, 70, 128)])
def test_a_bf16_context_is_laid_out_as_its_float32_widening_is(lib, engine, n, ctx, d):
    """A bf16 context is laid out from its own bits, a float32 one rounded to bf16 first:
    values that bf16 holds exactly give the same result to the bit, a key block's tail past
    the context included, and so does the same context read through a block table from
    paged caches, as the native step reads it."""
    if not native.takes_bf16(lib, engine, d):
        pytest.skip(f"this library or CPU has no bf16 products on {engine}")
    g = _gen(3 * n + ctx)
    q = torch.randn(n, 9, d, generator=g)
    k, v = (torch.randn(ctx, 3, d, generator=g).bfloat16() for _ in range(2))
    from_bf16 = native.attend(lib, q, k, v, d**-0.5, bf16=True, engine=engine)
    assert torch.equal(from_bf16, native.attend(lib, q, k.float(), v.float(), d**-0.5, bf16=True, engine=engine))
    used, block_size = -(-ctx // 16), 16
    table = torch.randperm(used + 3, generator=g)[:used].int()
    for dtype in (torch.bfloat16, torch.float32):
        k_cache, v_cache = (torch.full((used + 3, block_size, 3, d), float("nan"), dtype=dtype) for _ in range(2))
        _scatter(k_cache, table, 0, k.to(dtype))
        _scatter(v_cache, table, 0, v.to(dtype))
        paged = native.attend_paged(lib, q, k_cache, v_cache, table, ctx, d**-0.5, bf16=True, engine=engine)
        assert torch.equal(paged, from_bf16), dtype


def test_the_paged_entry_refuses_caches_and_tables_that_do_not_fit_by_name(lib):
    q, cache = torch.zeros(2, 4, 16), torch.zeros(3, 8, 2, 16)
    with pytest.raises(ValueError, match="two alike"):
        native.attend_paged(lib, q, cache, cache.bfloat16(), torch.zeros(1, dtype=torch.int32), 2, 1.0)
    with pytest.raises(ValueError, match="enough for a context of 20"):
        native.attend_paged(lib, q, cache, cache, torch.zeros(2, dtype=torch.int32), 20, 1.0)
    with pytest.raises(ValueError, match="int32"):
        native.attend_paged(lib, q, cache, cache, torch.zeros(3, dtype=torch.int64), 20, 1.0)
    with pytest.raises(ValueError, match="outside the caches' 3"):
        native.attend_paged(lib, q, cache, cache, torch.tensor([0, 3, 1], dtype=torch.int32), 20, 1.0)
    with pytest.raises(ValueError, match=r"\[n, heads, 16\]"):
        native.attend_paged(lib, torch.zeros(2, 4, 32), cache, cache, torch.zeros(3, dtype=torch.int32), 20, 1.0)
    assert native.attend_paged(lib, q, cache, cache, torch.zeros(3, dtype=torch.int32), 1, 1.0) is None  # n > ctx


def test_amx_tiles_take_head_sizes_of_32s_and_any_falls_back_to_dot_products(lib):
    if not native.takes_bf16(lib, "amx"):
        pytest.skip("no AMX tiles here (the CPU lacks them, or the OS did not grant them)")
    g = _gen(11)
    q, k, v = torch.randn(20, 4, 48, generator=g), *(torch.randn(20, 2, 48, generator=g).bfloat16() for _ in range(2))
    assert native.attend(lib, q, k, v, 0.2, bf16=True, engine="amx") is None  # 48: not a multiple of 32
    assert not native.takes_bf16(lib, "amx", 48) and native.takes_bf16(lib, "amx", 64)
    assert torch.equal(native.attend(lib, q, k, v, 0.2, bf16=True),  # "any": VDPBF16PS for this head
                       native.attend(lib, q, k, v, 0.2, bf16=True, engine="avx512"))
    q, k, v = torch.randn(20, 4, 64, generator=g), *(torch.randn(20, 2, 64, generator=g).bfloat16() for _ in range(2))
    tiles, dots = (native.attend(lib, q, k, v, 0.2, bf16=True, engine=e) for e in ("amx", "avx512"))
    assert torch.equal(native.attend(lib, q, k, v, 0.2, bf16=True), tiles)  # "any": the tiles
    torch.testing.assert_close(tiles, dots, atol=2e-3, rtol=1e-2)  # the same roundings, other sum orders


@pytest.mark.parametrize("engine", ["float32", "avx512", "amx"])
@pytest.mark.parametrize("d", [64, 128])  # on the tiles: value sums held in tiles; added block by block in memory
def test_sums_rescale_where_a_rows_scores_keep_rising(lib, engine, d):
    bf16 = engine != "float32"
    if bf16 and not native.takes_bf16(lib, engine):
        pytest.skip(f"this library or CPU has no bf16 products on {engine}")
    n, ctx = 40, 300
    g = _gen(ctx + d)
    q = torch.randn(n, 6, d, generator=g)
    # later keys score ever higher: each row's maximum passes the one its sums were taken
    # against by more than the kernel lets it, block after block
    growth = torch.linspace(0.2, 10.0, ctx)[:, None, None]
    k = (torch.randn(ctx, 2, d, generator=g) * growth).bfloat16()
    v = torch.randn(ctx, 2, d, generator=g).bfloat16()
    scale = d**-0.5
    kwargs = dict(bf16=True, engine=engine) if bf16 else {}
    got = native.attend(lib, q, k, v, scale, **kwargs)
    want = _dense_attention((q.bfloat16() if bf16 else q).float(), k.float(), v.float(), scale, _causal_tail(n, ctx))
    if bf16:
        torch.testing.assert_close(got.double(), want, atol=6e-3, rtol=1e-2)
    else:
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)
    assert torch.equal(native.attend(lib, q[-1:], k, v, scale, **kwargs)[0], got[-1])
    assert torch.equal(native.attend(lib, q[-21:], k, v, scale, **kwargs), got[-21:])


def test_a_rows_result_does_not_depend_on_its_chunk(lib):
    g = _gen(7)
    q, k, v = torch.randn(50, 6, 32, generator=g), torch.randn(90, 2, 32, generator=g), torch.randn(90, 2, 32, generator=g)
    together = native.attend(lib, q, k, v, 0.2)
    assert torch.equal(native.attend(lib, q[-1:], k, v, 0.2)[0], together[-1])  # the last row alone
    assert torch.equal(native.attend(lib, q[-17:], k, v, 0.2), together[-17:])  # other task blocks


@pytest.mark.parametrize("shape, why", [
    ((4, 2, 24), "head size 24"),  # not a multiple of 16
    ((5, 2, 16), "5 query heads, 2 KV heads"),
    ((130, 1, 16), "130 query heads, 1 KV heads"),  # more than a task holds
])
def test_shapes_it_does_not_take_are_refused_by_name(lib, shape, why):
    hq, hkv, d = shape
    assert native.attend(lib, torch.zeros(2, hq, d), torch.zeros(2, hkv, d), torch.zeros(2, hkv, d), 1.0) is None
    assert why in native.supported(lib, hq, hkv, d, torch.float32)
    assert "float16" in native.supported(lib, 4, 2, 16, torch.float16)
    assert native.attend(lib, torch.zeros(3, 4, 16), torch.zeros(2, 2, 16), torch.zeros(2, 2, 16), 1.0) is None


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_the_paged_op_is_refs_twin(lib, cache_dtype):
    g = _gen(3)
    hq, hkv, d, bs = 4, 2, 16, 8
    seqs = [(5, 0), (3, 6), (1, 7), (37, 29)]  # (new, cached): fresh, mid-block, one token, many blocks
    k_cache, v_cache = torch.zeros(40, bs, hkv, d, dtype=cache_dtype), torch.zeros(40, bs, hkv, d, dtype=cache_dtype)
    tables = torch.randperm(40, generator=g)[:40].reshape(4, 10).int()
    news = []
    for b, (n, c) in enumerate(seqs):
        q, k, v = (torch.randn(n + c, h, d, generator=g) for h in (hq, hkv, hkv))
        _scatter(k_cache, tables[b], 0, k.to(cache_dtype))
        _scatter(v_cache, tables[b], 0, v.to(cache_dtype))
        news.append((q[c:], k[c:].to(cache_dtype).float(), v[c:].to(cache_dtype).float()))
    q, k, v = (torch.cat([new[i] for new in news]) for i in range(3))
    cu = [0, 5, 8, 9, 46]
    ctx = [n + c for n, c in seqs]
    args = (k_cache, v_cache, tables, cu, ctx, 0.25)
    doubled = (k_cache.double(), v_cache.double(), tables, cu, ctx, 0.25)
    want = ref.paged_prefill_attention(q.double(), k.double(), v.double(), *doubled)
    got = native.paged_prefill_attention_op(lib)(q, k, v, *args)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)
    if native.takes_bf16(lib):  # the bf16 products' op: as close as their rounding allows
        got = native.paged_prefill_attention_op(lib, bf16=True)(q, k, v, *args)
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    assert native.paged_prefill_attention_op(lib)(q.bfloat16(), k.bfloat16(), v.bfloat16(), *args).dtype == torch.bfloat16


AMD, INTEL = "AuthenticAMD", "GenuineIntel"


@pytest.mark.parametrize("vendor, flags, dtype, unsupported, setting, native_wanted, tiles", [
    (AMD, {"avx512f", "avx512_bf16"}, torch.bfloat16, None, "", True, False),  # MKL's generic sgemm under torch's
    (AMD, {"avx512f"}, torch.float32, None, "", True, False),
    # torch's bf16 on AMX tiles, unless the kernel's bf16 products run on them too
    (INTEL, {"avx512f", "amx_bf16", "amx_tile"}, torch.bfloat16, None, "", False, False),
    (INTEL, {"avx512f", "amx_bf16", "amx_tile"}, torch.bfloat16, None, "", True, True),
    (INTEL, {"avx512f"}, torch.float32, None, "", True, False),  # MKL's AVX-512 sgemm: 1.0-1.4x slower on a Xeon
    (INTEL, {"avx512f", "avx512_bf16"}, torch.bfloat16, None, "", False, False),  # torch's bf16: not measured against
    (INTEL, {"avx512f"}, torch.float32, None, "1", True, False),  # asked for
    ("", {"avx512f"}, torch.float32, None, "", False, False),  # an unknown vendor
    (AMD, {"avx2"}, torch.float32, "a shape it does not take", "", False, False),
    # the portable form: the native step's short chunks only (prompt_steps.TORCH_ATTENTION_WORK)
    (AMD, {"avx2", "fma"}, torch.float32, None, "", False, False),
    (AMD, {"avx2", "fma"}, torch.float32, None, "1", True, False),
    (AMD, {"avx512f"}, torch.float32, None, "0", False, True),
])
def test_the_engine_chooses_it_where_it_was_measured_the_faster(vendor, flags, dtype, unsupported, setting,
                                                                  native_wanted, tiles):
    cpu = CpuInfo("a CPU", "x86_64", frozenset(flags), vendor)
    chosen, why = native.choose(cpu, dtype, unsupported, setting, tiles)
    assert chosen == native_wanted and why
    if unsupported:
        assert why == unsupported
    if setting:
        assert f"BATON_NATIVE_PROMPT_ATTENTION={setting}" in why
