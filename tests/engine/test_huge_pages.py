"""The quantized weights gathered into one mapping advised for huge pages (native/huge_pages.py)."""

from __future__ import annotations

import pytest
import torch

from baton.engine.native.huge_pages import (
    HUGE_PAGE,
    aligned_offsets,
    gather,
    parse_setting,
    this_thp_mode,
    thp_mode,
)

USABLE = this_thp_mode() in ("always", "madvise")


def test_the_kernels_setting_is_the_bracketed_word():
    assert thp_mode("always [madvise] never\n") == "madvise"
    assert thp_mode("[always] madvise never") == "always"
    assert thp_mode("always madvise [never]") == "never"
    assert thp_mode("") == ""


def test_tensors_lie_side_by_side_each_on_a_cache_line():
    assert aligned_offsets([1, 64, 65, 0, 3]) == ([0, 64, 128, 256, 256], 320)
    assert aligned_offsets([]) == ([], 0)


def mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    fields, inside = {}, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@pytest.mark.skipif(not USABLE, reason=f"transparent huge pages are {this_thp_mode() or 'unavailable'} here")
def test_copies_in_one_mapping_the_kernel_may_back_with_huge_pages():
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=generator),
               torch.randn(5, 7, generator=generator), torch.randint(0, 256, (130, 33), dtype=torch.uint8)]
    copies, how = gather(tensors)
    assert "2 MiB pages" in how
    for tensor, copy in zip(tensors, copies):
        assert copy.dtype == tensor.dtype and copy.shape == tensor.shape and torch.equal(copy, tensor)
        assert copy.data_ptr() != tensor.data_ptr() and copy.data_ptr() % 64 == 0
    first = copies[0].data_ptr()
    assert first % HUGE_PAGE == 0
    assert all(first <= c.data_ptr() < first + aligned_offsets([t.nbytes for t in tensors])[1] for c in copies)
    assert mapping_of(first).get("THPeligible") == "1"  # advised: the kernel may back it with 2 MiB pages
    tensors[1].zero_()
    assert not torch.equal(copies[1], tensors[1])  # copies, not views


def test_the_setting_is_on_or_off():
    assert parse_setting("") and parse_setting("1") and parse_setting(" 1 ") and not parse_setting("0")
    with pytest.raises(ValueError, match="BATON_HUGE_PAGES must be 1 or 0, got 'yes'"):
        parse_setting("yes")


def test_off_when_the_setting_says_so():
    tensors = [torch.zeros(4)]
    same, how = gather(tensors, enabled=False)
    assert same is tensors and "BATON_HUGE_PAGES=0" in how


def test_a_misspelt_setting_stops_the_engine_naming_it(monkeypatch):
    from baton.engine.native import build

    from .conftest import make_engine

    if build.load() is None:  # the setting is read where the native kernels take the weights
        pytest.skip(f"native library unavailable: {build.failure()}")
    monkeypatch.setenv("BATON_HUGE_PAGES", "on")
    with pytest.raises(ValueError, match="BATON_HUGE_PAGES must be 1 or 0, got 'on'"):
        make_engine(quantization="auto")
