"""Run a step of a Llama model on CPU (fp32 or bf16) through the native library.

`NativeDecoder.build(model, kv_caches)` binds the model's weights and caches once (the
pointers stay valid: weights never move and a reshard rebinds); `step()` then runs every
layer of a step in one call: its decodes, and the prompt chunks beside them where
`prompts` (native/prompt_steps.py) allows, calling a step's layer hook after each layer.
The torch path stays the reference and handles every other step (other dtypes and devices,
the prompt steps `prompts` leaves to it).
"""

from __future__ import annotations

import ctypes
import logging
import os

import numpy as np
import torch

from baton.engine.native import build, prompt_attention, prompt_steps
from baton.engine.native.packing import packed_weights, use_dot_products
from baton.engine.native.quant import PANEL_ENGINE_IDS
from baton.engine.quant.weight import QuantizedWeight

log = logging.getLogger(__name__)
_f32p = ctypes.POINTER(ctypes.c_float)
_voidp = ctypes.c_void_p


# tensor parallelism: the C step calls back to sum a buffer over the ranks
_ALL_REDUCE = ctypes.CFUNCTYPE(None, _f32p, ctypes.c_int64)
# a step's layer hook: the C step calls back after each layer
_LAYER_DONE = ctypes.CFUNCTYPE(None, ctypes.c_int)


class _Layer(ctypes.Structure):
    _fields_ = [(name, _voidp) for name in (
        "input_norm", "qkv", "qkv_bias", "o_proj", "post_norm", "gate_up", "down", "k_cache", "v_cache",
        "qkv_packed", "o_proj_packed", "gate_up_packed", "down_packed",
        "qkv_quant", "o_proj_quant", "gate_up_quant", "down_quant")]


class _Model(ctypes.Structure):
    _fields_ = [
        *[(name, ctypes.c_int) for name in (
            "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "vocab", "num_layers",
            "block_size", "max_positions")],
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *[(name, _voidp) for name in ("embed", "final_norm", "lm_head", "lm_head_packed")],
        ("cos_sin", _f32p),
        ("layers", ctypes.POINTER(_Layer)),
        ("bf16_dot", ctypes.c_int),
        ("embed_quant", _voidp),
        ("lm_head_quant", _voidp),
        ("all_reduce", _ALL_REDUCE),
        ("vocab_start", ctypes.c_int),
        ("layer_done", _LAYER_DONE),
    ]


_WORKSPACE = ("residual", "normed", "qkv", "attn", "gate_up", "act", "out")


class _Workspace(ctypes.Structure):
    _fields_ = [*[(name, _f32p) for name in _WORKSPACE], ("matmul_input", _voidp), ("quant_input", _voidp),
                ("quant_engine", ctypes.c_int), ("quant_min_rows", ctypes.c_int),
                ("few_engine", ctypes.c_int), ("few_min_rows", ctypes.c_int)]


class _Prompts(ctypes.Structure):
    _fields_ = [("chunks", ctypes.c_int), ("starts", _voidp), ("bf16_products", ctypes.c_int)]


def _ptr(t: torch.Tensor | None):
    """A full-precision tensor's data (None for a quantized matrix: see _quant)."""
    return None if t is None or isinstance(t, QuantizedWeight) else t.data_ptr()


def _quant(w) -> int | None:
    """A quantized matrix's QuantMatrix (quant_product.h), or None."""
    if not isinstance(w, QuantizedWeight):
        return None
    if w.native_matrix is None:
        raise ValueError("a quantized matrix was not prepared for the native kernels")
    return ctypes.addressof(w.native_matrix)


def unavailable_reason(model, device: torch.device, dtype: torch.dtype,
                       kv_dtype: torch.dtype | None = None) -> str | None:
    """Why this model cannot take the native path, or None when it can."""
    if os.environ.get("BATON_NATIVE_DECODE", "1").strip() == "0":
        return "disabled by BATON_NATIVE_DECODE=0"
    if device.type != "cpu" or (dtype, kv_dtype or dtype) not in build.ENTRY_POINTS:
        return (f"native decode runs on CPU only, fp32 or bf16 with a KV cache as wide or bf16 "
                f"(here {dtype} with a {kv_dtype or dtype} cache on {device.type})")
    if build.load() is None:
        return f"native library unavailable: {build.failure()}"
    return None


def _prompt_plan(lib: ctypes.CDLL, model, kv_dtype: torch.dtype, quantized: list[QuantizedWeight],
                 bf16_products: bool, torch_attention_faster: bool) -> prompt_steps.PromptSteps:
    cfg = model.cfg
    return prompt_steps.plan(
        prompt_attention.supported(lib, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, kv_dtype),
        quantized[0].dense if quantized else None, PANEL_ENGINE_IDS, bf16_products, torch_attention_faster,
        os.environ.get("BATON_NATIVE_PROMPT_STEPS", "").strip())


class NativeDecoder:
    def __init__(self, lib: ctypes.CDLL, model, kv_caches, dtype: torch.dtype, comm=None,
                 prompt_bf16: bool = False, torch_attention_faster: bool = False):
        """`comm`: run one tensor-parallel rank's slice (model holds that slice); the step
        calls back into it for every sum over the ranks and gathers the logits after.
        `prompt_bf16`: prompt chunks attend on bf16 products (where the library has them);
        `torch_attention_faster`: torch's prompt attention was chosen as the faster here."""
        cfg = model.cfg
        kv_dtype = kv_caches[0][0].dtype
        self._step = getattr(lib, build.ENTRY_POINTS[dtype, kv_dtype])
        self._row_widths = {
            "residual": cfg.hidden_size, "normed": cfg.hidden_size, "out": cfg.hidden_size,
            "qkv": (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim,
            "attn": cfg.num_heads * cfg.head_dim,
            "gate_up": 2 * cfg.intermediate_size, "act": cfg.intermediate_size,
        }
        # everything a pointer is taken of stays referenced as long as the decoder lives
        self._keep = [tensor for tensor, _ in _bound_tensors(model, kv_caches, dtype)]
        products = [w for layer in model.layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        quantized = [w for w in (model.embed, model.lm_head, *products) if isinstance(w, QuantizedWeight)]
        self.quantized = bool(quantized)
        self.prompts = _prompt_plan(lib, model, kv_dtype, quantized, prompt_bf16 and prompt_attention.takes_bf16(lib),
                                    torch_attention_faster)
        self.packed = packed_weights(lib, model) if dtype == torch.bfloat16 and not self.quantized else None
        self._keep.append(self.packed)
        self.bf16_dot = dtype == torch.bfloat16 and self.packed is None and use_dot_products(lib)
        self.vocab = cfg.vocab_size  # the rows this model's head holds
        self.comm = comm
        self.full_vocab = self.vocab if comm is None else sum(span.size for span in comm.vocab_spans)
        self._reduce_error: BaseException | None = None
        self._hook, self._hook_error = None, None
        self._layer_done = _LAYER_DONE(self._call_hook)
        self._kv_caches = kv_caches
        self._reduce = _ALL_REDUCE(self._all_reduce) if comm is not None else _ALL_REDUCE()
        self.block_size = kv_caches[0][0].shape[1]
        self.num_blocks = kv_caches[0][0].shape[0]
        self.max_positions = model.cos_sin.shape[0]
        self._model = _Model(
            hidden=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, vocab=cfg.vocab_size,
            num_layers=cfg.num_layers, block_size=self.block_size,
            max_positions=self.max_positions, eps=cfg.rms_norm_eps, scale=cfg.head_dim**-0.5,
            embed=_ptr(model.embed), final_norm=_ptr(model.norm), lm_head=_ptr(model.lm_head),
            lm_head_packed=_ptr(self.packed.lm_head) if self.packed else None,
            cos_sin=ctypes.cast(model.cos_sin.data_ptr(), _f32p), bf16_dot=int(self.bf16_dot),
            embed_quant=_quant(model.embed), lm_head_quant=_quant(model.lm_head),
            all_reduce=self._reduce, vocab_start=comm.shard.vocab.start if comm is not None else 0,
        )
        self._lib = lib
        self._widest_input = max(cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)
        self._layers = (_Layer * cfg.num_layers)()
        for index, layer in enumerate(model.layers):
            k_cache, v_cache = kv_caches[index]
            packed = self.packed.layers[index] if self.packed else (None,) * 4
            self._layers[index] = _Layer(
                _ptr(layer.input_norm), _ptr(layer.qkv), _ptr(layer.qkv_bias), _ptr(layer.o_proj),
                _ptr(layer.post_attention_norm), _ptr(layer.gate_up), _ptr(layer.down),
                _ptr(k_cache), _ptr(v_cache), *(_ptr(t) for t in packed),
                *(_quant(w) for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)))
        self._model.layers = self._layers
        self._rows = 0
        self._workspace = _Workspace(quant_engine=prompt_steps.NO_ENGINE, few_engine=prompt_steps.NO_ENGINE)
        self._buffers: dict[str, torch.Tensor] = {}

    def _all_reduce(self, pointer, count: int) -> None:
        """Called from the C step. An error cannot cross back into C: it is kept, later sums
        are skipped (the step's numbers no longer matter), and step() raises it."""
        if self._reduce_error is not None:
            return
        try:
            self.comm.all_reduce(torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(count,))))
        except BaseException as exc:
            self._reduce_error = exc

    def _call_hook(self, layer: int) -> None:
        """Called from the C step after each layer: the step's layer hook (an error is kept
        for step() to raise, later layers' calls skipped, as _all_reduce does)."""
        if self._hook_error is not None or self._hook is None:
            return
        try:
            self._hook(layer, *self._kv_caches[layer])
        except BaseException as exc:
            self._hook_error = exc

    @classmethod
    def build(cls, model, kv_caches, device: torch.device, dtype: torch.dtype, comm=None,
              prompt_bf16: bool = False, torch_attention_faster: bool = False) -> NativeDecoder | None:
        """A decoder for this model, or None when the native path cannot run it."""
        reason = unavailable_reason(model, device, dtype, kv_caches[0][0].dtype)
        if reason is None and not all(t.dtype == want and t.is_contiguous()
                                      for t, want in _bound_tensors(model, kv_caches, dtype)):
            reason = f"a weight is not a contiguous {dtype} tensor, or a cache not one of its dtype"
        if reason is not None:
            # a build failure costs speed on CPU: say so; a GPU or a disabled path is expected
            level = logging.WARNING if device.type == "cpu" and "unavailable" in reason else logging.INFO
            log.log(level, "decode steps use the torch path: %s", reason)
            return None
        decoder = cls(build.load(), model, kv_caches, dtype, comm, prompt_bf16, torch_attention_faster)
        log.info("native steps, %s; steps with prompt tokens: %s", build.describe(), decoder.prompts.reason)
        return decoder

    def _reserve(self, rows: int) -> None:
        if rows <= self._rows:
            return
        self._rows = max(rows, 2 * self._rows)
        for name in _WORKSPACE:
            buffer = torch.empty(self._rows * self._row_widths[name], dtype=torch.float32)
            self._buffers[name] = buffer
            setattr(self._workspace, name, ctypes.cast(buffer.data_ptr(), _f32p))
        widest_input = max(self._row_widths[name] for name in ("residual", "attn", "act"))
        self._buffers["matmul_input"] = buffer = torch.empty(self._rows * widest_input, dtype=torch.bfloat16)
        self._workspace.matmul_input = buffer.data_ptr()
        if self.quantized:
            size = max(self._lib.baton_quant_input_bytes(self._rows, self._widest_input),
                       self._lib.baton_quant_panel_scratch_bytes(self._rows, self._widest_input))
            self._buffers["quant_input"] = buffer = torch.empty(size, dtype=torch.uint8)
            self._workspace.quant_input = buffer.data_ptr()

    def step(self, token_ids: np.ndarray, positions: np.ndarray, tables: np.ndarray,
             prompt_starts=None, logits_rows: np.ndarray | None = None, layer_hook=None) -> torch.Tensor | None:
        """fp32 logits [sampled rows, vocab] of one step; writes every row's K/V. Under tensor
        parallelism: all of the vocabulary on rank 0, None on the others.

        token_ids, positions: int64 [rows]; tables: int32 [rows, width], each row's block
        table covering its position (each attends over positions 0..its own).
        prompt_starts: the rows of the step's prompt chunks, first (chunk c: rows
        prompt_starts[c] .. prompt_starts[c + 1] - 1, consecutive positions of one sequence,
        every row with its table); None or [0] for a decode-only step. logits_rows: the
        increasing rows whose logits come back (default: all). layer_hook(layer, k_cache,
        v_cache): called after each layer, as the torch path calls it.
        """
        rows = len(token_ids)
        starts = np.ascontiguousarray([0] if prompt_starts is None else prompt_starts, dtype=np.int64)
        chunks = len(starts) - 1
        if chunks and rows >= self.prompts.max_rows:
            raise ValueError(f"this decoder does not run steps with prompt tokens of {rows} rows "
                             f"({self.prompts.reason})")
        wanted = np.arange(rows, dtype=np.int64) if logits_rows is None else \
            np.ascontiguousarray(logits_rows, dtype=np.int64)
        self._reserve(rows)
        logits = torch.empty(len(wanted), self.vocab, dtype=torch.float32)
        token_ids = np.ascontiguousarray(token_ids, dtype=np.int64)
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        tables = np.ascontiguousarray(tables, dtype=np.int32)
        self._check_bounds(token_ids, positions, tables)
        _check_rows(positions, starts, wanted)
        ws = self._workspace
        ws.quant_engine = self.prompts.quant_engine  # decode-only steps too: the same products by their rows
        ws.quant_min_rows = self.prompts.quant_min_rows
        ws.few_engine, ws.few_min_rows = self.prompts.few_engine, self.prompts.few_min_rows
        prompts = _Prompts(chunks, starts.ctypes.data, int(self.prompts.bf16_products))
        self._hook, self._hook_error = layer_hook, None
        self._model.layer_done = self._layer_done if layer_hook is not None else _LAYER_DONE()
        try:
            status = self._step(
                ctypes.byref(self._model), ctypes.c_int(rows),
                token_ids.ctypes.data_as(ctypes.c_void_p), positions.ctypes.data_as(ctypes.c_void_p),
                tables.ctypes.data_as(ctypes.c_void_p), ctypes.c_int(tables.shape[1]), ctypes.byref(prompts),
                wanted.ctypes.data_as(ctypes.c_void_p), ctypes.c_int(len(wanted)), ctypes.byref(ws),
                ctypes.c_void_p(logits.data_ptr()),
            )
        finally:
            self._hook = None
        if self._hook_error is not None:
            error, self._hook_error = self._hook_error, None
            raise error
        if status == -2:
            raise MemoryError("native step: no memory for a prompt chunk's context")
        if status != 0:
            raise RuntimeError(f"native step refused a prompt chunk (status {status})")
        if self.comm is None:
            return logits
        if self._reduce_error is not None:
            error, self._reduce_error = self._reduce_error, None
            raise error
        return self.comm.gather_logits(logits)

    def _check_bounds(self, token_ids, positions, tables) -> None:
        """The C code indexes with these unchecked: refuse anything that would read or write
        outside the model's tables or the cache pool."""
        rows = len(token_ids)
        if not (len(positions) == tables.shape[0] == rows):
            raise ValueError(f"decode step inputs disagree on the row count ({rows})")
        if rows == 0:
            return
        if token_ids.min() < 0 or token_ids.max() >= self.full_vocab:
            raise ValueError(f"a token id is outside the vocabulary [0, {self.full_vocab})")
        if positions.min() < 0 or positions.max() >= self.max_positions:
            raise ValueError(f"a position is outside the RoPE table [0, {self.max_positions})")
        if tables.shape[1] * self.block_size <= positions.max():
            raise ValueError("a block table is shorter than its context")
        if tables.min() < 0 or tables.max() >= self.num_blocks:
            raise ValueError(f"a block id is outside the pool [0, {self.num_blocks})")


def _check_rows(positions: np.ndarray, starts: np.ndarray, wanted: np.ndarray) -> None:
    """Prompt chunks and sampled rows the C step can index without checks: chunks of at
    least one row each, in order, within the step, at consecutive positions (the kernel
    places a chunk's rows by its last); sampled rows increasing, within the step."""
    rows = len(positions)
    if starts[0] != 0 or np.any(np.diff(starts) < 1) or starts[-1] > rows:
        raise ValueError(f"prompt chunks must be consecutive, non-empty row ranges from 0 within {rows} rows")
    for first, end in zip(starts[:-1], starts[1:]):
        if np.any(np.diff(positions[first:end]) != 1):
            raise ValueError(f"a prompt chunk's positions are not consecutive (rows {first}..{end - 1})")
    if len(wanted) and (wanted[0] < 0 or wanted[-1] >= rows or np.any(np.diff(wanted) < 1)):
        raise ValueError(f"sampled rows must increase within [0, {rows})")


def _bound_tensors(model, kv_caches, dtype: torch.dtype):
    """(tensor, the dtype the native code reads it as) for everything it is handed."""
    yield model.cos_sin, torch.float32
    for tensor in (model.embed, model.norm, model.lm_head):
        if not isinstance(tensor, QuantizedWeight):
            yield tensor, dtype
    for layer in model.layers:
        for tensor in (layer.input_norm, layer.qkv, layer.qkv_bias, layer.o_proj,
                       layer.post_attention_norm, layer.gate_up, layer.down):
            if tensor is not None and not isinstance(tensor, QuantizedWeight):
                yield tensor, dtype
    kv_dtype = kv_caches[0][0].dtype  # checked against the compiled pairs before
    for k_cache, v_cache in kv_caches:
        yield k_cache, kv_dtype
        yield v_cache, kv_dtype
