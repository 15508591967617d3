"""Triton kernels, one concept per module; each matches its twin in ``kernels/ref.py``."""

from .activation import silu_and_mul
from .decode_attention import paged_decode_attention
from .kv_pack import pack_kv_blocks, unpack_kv_blocks
from .kv_store import store_kvcache
from .prefill_attention import paged_prefill_attention
from .rmsnorm import fused_add_rms_norm, rms_norm
from .rope import rotary_embedding

__all__ = [
    "fused_add_rms_norm",
    "pack_kv_blocks",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "store_kvcache",
    "unpack_kv_blocks",
]
