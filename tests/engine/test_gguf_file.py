"""The GGUF reader against the `gguf` package's own reader, on the bundled model and on a
rewritten file with float and quantized parts; bad files fail with a message naming why."""

from __future__ import annotations

import time

import numpy as np
import pytest
from gguf import GGUFReader

from baton.engine.gguf_file import read_gguf
from baton.engine.loader import bundled_model_path

from .gguf_rewrite import rewrite_gguf

# the bundled file is Q4_1 and F32; the rewritten one adds F16, Q8_0, Q4_0 and BF16 parts
REWRITTEN = {"token_embd.weight": "F16", "blk.0.attn_q.weight": "Q8_0", "blk.0.ffn_up.weight": "Q4_0",
             "blk.1.ffn_down.weight": "BF16", "blk.0.attn_norm.weight": "F16"}


@pytest.fixture(scope="module", params=["bundled", "rewritten"])
def both(request, tmp_path_factory):
    path = bundled_model_path()
    if request.param == "rewritten":
        path = tmp_path_factory.mktemp("gguf") / "mixed.gguf"
        rewrite_gguf({path: REWRITTEN}, layers=2)
    return read_gguf(path), GGUFReader(str(path))


def test_every_metadata_field_equals_the_gguf_packages(both):
    ours, theirs = both
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields.keys() == expected.keys()
    for key, value in expected.items():
        assert ours.fields[key] == pytest.approx(value) if isinstance(value, float) else ours.fields[key] == value, key


def test_every_tensor_has_the_same_name_shape_type_and_bytes(both):
    ours, theirs = both
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.shape == tuple(int(d) for d in ref.shape), mine.name
        assert (mine.type_id, mine.type_name) == (int(ref.tensor_type), ref.tensor_type.name), mine.name
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape, mine.name
        assert np.array_equal(mine.data, ref.data), mine.name


def test_it_reads_the_metadata_in_well_under_a_second():
    started = time.perf_counter()
    read_gguf(bundled_model_path())
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize("cut", [3, 20, 4096, -1000], ids=["magic", "counts", "metadata", "tensors"])
def test_a_truncated_file_is_refused_naming_why(tmp_path, cut):
    whole = bundled_model_path().read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(whole[:cut])  # a negative cut drops the end of the last tensor
    with pytest.raises(ValueError, match="magic|truncated|past the end"):
        read_gguf(bad)


def test_an_unknown_version_is_refused(tmp_path):
    whole = bytearray(bundled_model_path().read_bytes()[:64])
    whole[4:8] = (9).to_bytes(4, "little")
    bad = tmp_path / "v9.gguf"
    bad.write_bytes(bytes(whole))
    with pytest.raises(ValueError, match="version 9"):
        read_gguf(bad)
