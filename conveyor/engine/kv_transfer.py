"""KV handoff between two engines: export a prefilled sequence, import it as a running row.

Export (prefill role): right after the step that sampled a marked request's first token, its
KV for positions [0, num_computed_tokens) is gathered from the paged cache (contents, not
block ids), its seeded generator state is saved, and it leaves this engine as
FINISHED_HANDED_OFF: its blocks are freed (full ones stay in the prefix cache), and the
step's output for it carries the KVHandoff.

Import (decode role): the request is added with its prompt and first token; instead of being
queued it allocates blocks, gets the KV written into them and joins the running batch as a
decode row, bitwise the state a single engine would have. With no free slot or block it is
queued instead and re-prefilled here (the same bits, as after a preemption).

Sliding layers kept in their own block group (engine/window_blocks.py) hold only their window: the
blob still carries positions [0, n) of every attention layer, and a sliding layer's positions its sender
gave back are zeros (read from the NULL block). The receiver never reads them: it writes a sliding
layer's positions only from its own window on, which the sender still held.

MLA layers (models/mla.py) keep one latent row per token and read their values from it: the blob then
carries each layer's key rows only (`values_in_keys`), one head as wide as the latent and rotary key.

Both run on the engine thread (inside EngineCore.step / add_request).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from conveyor.engine.outputs import RequestOutput
from conveyor.engine.request import Request, RequestStatus
from conveyor.kernels.kv_quant import BF16, Q8_0, KVCacheTypes, bytes_per_row
from conveyor.models.cache_specs import kv_layers

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


@dataclass
class KVBlob:
    """KV of positions [0, num_tokens): per layer, K's rows (num_tokens, kv_heads, row) then V's, as the cache
    keeps them: (layers, 2, num_tokens, kv_heads, head_dim) row-major when both are bf16 (dtype), raw Q8_0
    rows (kv_quant.py) where a cache type is q8_0. Blocks travel as they are, never re-quantized."""

    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    data: bytes
    # Hybrid models: the sequence's recurrent state after those tokens, every recurrent layer's fp32 tensors
    # flattened in order (empty for attention-only models).
    state: bytes = b""
    cache_type_k: str = "bf16"
    cache_type_v: str = "bf16"
    values_in_keys: bool = False  # MLA: per layer one tensor of latent rows, no V rows

    @property
    def kv_types(self) -> KVCacheTypes:
        return KVCacheTypes(self.cache_type_k, self.cache_type_v)

    def layer_bytes(self, kind: str) -> int:
        """Bytes of one layer's K (kind "k") or V rows."""
        cache_type = self.cache_type_k if kind == "k" else self.cache_type_v
        return self.num_tokens * self.num_kv_heads * bytes_per_row(cache_type, self.head_dim, _DTYPES[self.dtype])

    @property
    def expected_bytes(self) -> int:
        if self.dtype not in _DTYPES or not {self.cache_type_k, self.cache_type_v} <= {BF16, Q8_0}:
            return 0
        return self.num_layers * (self.layer_bytes("k") + (0 if self.values_in_keys else self.layer_bytes("v")))


@dataclass
class KVHandoff:
    """What the prefill engine hands over: the sequence's tokens, KV and sampler state."""

    request: Request
    kv: KVBlob
    rng_state: bytes | None = None
    # Image sequences: each image's tower output, in request.images order (the decode node re-prefills from them)
    image_rows: list[torch.Tensor] = field(default_factory=list)


@dataclass
class TransferStats:
    num_exported: int = 0
    num_imported: int = 0  # joined the running batch with the transferred KV
    num_recomputed: int = 0  # no slot/block at arrival: queued and re-prefilled here
    exported_bytes: int = 0
    imported_bytes: int = 0


@dataclass
class KVTransfer:
    core: object  # EngineCore (not imported: it imports us)
    handoff_ids: set[str] = field(default_factory=set)
    stats: TransferStats = field(default_factory=TransferStats)
    _imports: dict[str, tuple[KVBlob, bytes | None]] = field(default_factory=dict)

    def layout(self) -> tuple[int, int, int, bool]:
        """(attention layers, heads, head_dim, values_in_keys) of this engine's K/V rows: the config's heads,
        or an MLA layer's one latent row (models/mla.py)."""
        specs = kv_layers(self.core.runner.cache_specs)
        latent = next((spec for spec in specs if spec.values_in_keys), None)
        if latent is not None:
            return len(specs), latent.num_kv_heads, latent.head_dim, True
        cfg = self.core.model_config
        return cfg.num_attention_layers, cfg.num_key_value_heads, cfg.head_dim, False

    # -- prefill side --------------------------------------------------------------------------
    def mark_for_handoff(self, request_id: str) -> None:
        """Call before submitting: the request leaves this engine once its first token is sampled."""
        self.handoff_ids.add(request_id)

    def after_step(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.request_id not in self.handoff_ids:
                continue
            self.handoff_ids.discard(out.request_id)
            if out.finished:  # done at its first token (EOS, max_tokens, stop string, error): nothing to hand off
                continue
            request = self.core.scheduler.requests[out.request_id]
            out.kv_handoff = self._export(request)
            out.finished = True  # this engine's stream for it ends here (the text delta stays as built)
            self.core.drop_detokenizer(request.request_id)  # held-back text is the decode node's to emit
            self.core.scheduler.finish(request.request_id, RequestStatus.FINISHED_HANDED_OFF)

    def forget(self, request_id: str) -> None:
        self.handoff_ids.discard(request_id)
        self._imports.pop(request_id, None)

    def _export(self, request: Request) -> KVHandoff:
        core = self.core
        num_tokens = request.num_computed_tokens
        slots = self._slots(core.kv.block_table(request.request_id), num_tokens)
        window_slots = self._slots(core.kv.window_table(request.request_id), num_tokens) if core.kv.window else None
        layers = core.runner.kv_layer_tensors()
        num_layers, heads, dim, values_in_keys = self.layout()
        kv_parts = []  # per layer K's rows then V's, each in its cache's own format (Q8_0 bytes as they are)
        for caches, windowed in zip(layers, core.runner.kv_layer_windowed()):
            layer_slots = window_slots if windowed else slots
            for cache in caches:  # index_select: one contiguous copy per cache, no temporaries
                rows = torch.index_select(cache.view(-1, heads, cache.shape[3]), 0, layer_slots).cpu()
                kv_parts.append(rows.view(torch.uint8).reshape(-1))
        state = b""
        slot = core.kv.state_slot(request.request_id)
        if slot is not None:
            parts = [tensor[slot].reshape(-1).cpu() for layer in core.runner.state_layers() for tensor in layer]
            state = torch.cat(parts).view(torch.uint8).numpy().tobytes()
        blob = KVBlob(num_layers=num_layers, num_tokens=len(slots), num_kv_heads=heads, head_dim=dim,
                      dtype=_DTYPE_NAMES[core.dtype], data=torch.cat(kv_parts).numpy().tobytes(), state=state,
                      cache_type_k=core.kv_types.k, cache_type_v=core.kv_types.v, values_in_keys=values_in_keys)
        self.stats.num_exported += 1
        self.stats.exported_bytes += len(blob.data)
        return KVHandoff(request, blob, core.runner.sampler.generator_state(request.request_id),
                         [self._image_rows(item) for item in request.images])

    def _image_rows(self, item) -> torch.Tensor:
        """The rows the prefill just used: held by the encoder cache, or (evicted meanwhile) encoded again on its
        worker, the same bits."""
        cache = self.core.runner.encoder_cache
        rows = cache.peek(item.content_hash) if item.embeds is None else item.embeds
        return rows if rows is not None else cache.get(item)

    # -- decode side ---------------------------------------------------------------------------
    def check_layout(self, blob: KVBlob) -> None:
        """ValueError unless the blob fits this engine's KV cache exactly (any thread)."""
        core = self.core
        want = (*self.layout(), _DTYPE_NAMES.get(core.dtype))
        got = (blob.num_layers, blob.num_kv_heads, blob.head_dim, blob.values_in_keys, blob.dtype)
        if want != got:
            raise ValueError(f"KV layout (layers, kv_heads, head_dim, latent rows, dtype) {got} does not match this "
                             f"node's {want}")
        if blob.kv_types != core.kv_types:
            raise ValueError(f"KV cache type (K {blob.cache_type_k}, V {blob.cache_type_v}) does not match this "
                             f"node's (K {core.kv_types.k}, V {core.kv_types.v}): start both nodes with the same "
                             "--cache-type-k / --cache-type-v")
        if blob.num_tokens < 1 or len(blob.data) != blob.expected_bytes:
            raise ValueError(f"KV payload has {len(blob.data)} bytes, expected {blob.expected_bytes}")
        state_bytes = core.states.bytes_per_slot if core.states is not None else 0
        if len(blob.state) != state_bytes:
            raise ValueError(f"recurrent state payload has {len(blob.state)} bytes, this node's model keeps "
                             f"{state_bytes} per sequence")

    def stage_import(self, request: Request, blob: KVBlob, rng_state: bytes | None = None) -> None:
        """Call before submitting `request` (prompt + first token): add_request will import the KV."""
        if blob.num_tokens != request.num_tokens - 1:
            raise ValueError(f"KV covers {blob.num_tokens} tokens; the sequence needs {request.num_tokens - 1}")
        self._imports[request.request_id] = (blob, rng_state)

    def admit(self, request: Request) -> bool:
        """add_request's hook: False when the request is not an import (queue it as usual)."""
        staged = self._imports.pop(request.request_id, None)
        if staged is None:
            return False
        blob, rng_state = staged
        core = self.core
        scheduler = core.scheduler
        if rng_state is not None:
            core.runner.sampler.set_generator_state(request.request_id, rng_state)
        if len(scheduler.running) >= scheduler.config.max_batch_size or not self._scatter(request, blob):
            self.stats.num_recomputed += 1
            scheduler.add_request(request)  # re-prefilled here later, bitwise the same KV
            return True
        request.num_computed_tokens = blob.num_tokens
        request.status = RequestStatus.DECODING
        scheduler.requests[request.request_id] = request
        scheduler.running.append(request)
        core.kv.cache_computed_blocks(request)  # its full blocks serve later prefix hits here too
        self.stats.num_imported += 1
        self.stats.imported_bytes += len(blob.data)
        return True

    def _scatter(self, request: Request, blob: KVBlob) -> bool:
        core = self.core
        slot = core.states.allocate() if core.states is not None else None
        if core.states is not None and slot is None:
            return False
        if not core.kv.allocate_imported(request, blob.num_tokens, slot):  # + the first token's own KV
            if slot is not None:
                core.states.free(slot)
            return False
        if slot is not None:
            self._write_state(slot, blob.state)
        with warnings.catch_warnings():  # read-only bytes are fine: the tensor is only read (copied into the pool)
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(blob.data, dtype=torch.uint8)
        k_bytes, v_bytes = blob.layer_bytes("k"), blob.layer_bytes("v")
        slots = self._slots(core.kv.block_table(request.request_id), blob.num_tokens)
        # Sliding layers: only the positions this side holds, from the first block its next query reads.
        start = core.kv.window.first_live(blob.num_tokens) * core.kv.block_size if core.kv.window else 0
        window_slots = self._slots(core.kv.window_table(request.request_id), blob.num_tokens)[start:] \
            if core.kv.window else None
        offset = 0
        for caches, windowed in zip(core.runner.kv_layer_tensors(), core.runner.kv_layer_windowed()):
            layer_slots, first = (window_slots, start) if windowed else (slots, 0)
            for cache, size in zip(caches, (k_bytes, v_bytes)):
                heads, width = cache.shape[2], cache.shape[3]
                rows = data[offset:offset + size].view(cache.dtype).view(blob.num_tokens, heads, width)
                cache.view(-1, heads, width).index_copy_(0, layer_slots, rows[first:].to(cache.device))
                offset += size
        return True

    def _write_state(self, slot: int, data: bytes) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(data, dtype=torch.uint8).view(torch.float32)
        offset = 0
        for layer in self.core.runner.state_layers():
            for tensor in layer:
                size = tensor[slot].numel()
                tensor[slot] = flat[offset:offset + size].view(tensor.shape[1:]).to(tensor.device)
                offset += size

    def _slots(self, table: list[int], num_tokens: int) -> torch.Tensor:
        block_size = self.core.kv.block_size
        positions = torch.arange(num_tokens)
        blocks = torch.tensor(table, dtype=torch.long)
        return (blocks[positions // block_size] * block_size + positions % block_size).to(self.core.device)
