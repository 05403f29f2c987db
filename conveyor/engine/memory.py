"""Sizing the KV block pool: the context window per slot and the byte budget."""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MIN_TOKENS_PER_SLOT = 512
# auto budget: this share of the memory left after the weights, minus activation headroom.
AUTO_BUDGET_FRACTION = 0.5
ACTIVATION_HEADROOM_BYTES = 512 << 20


@dataclass(frozen=True)
class KVPoolPlan:
    max_model_len: int  # per-slot context window
    num_blocks: int  # the full-attention group (every attention layer without a sliding group)
    bytes_per_block: int
    budget_bytes: int | None  # None = unbounded (sized to fill every slot's window)
    budget_source: str  # "auto", "explicit" or "none"
    # Models whose sliding layers keep K/V in their own group (engine/window_blocks.py); 0 without one.
    window_blocks: int = 0
    window_bytes_per_block: int = 0

    @property
    def window_pool_bytes(self) -> int:
        return self.window_blocks * self.window_bytes_per_block

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block + self.window_pool_bytes


@dataclass(frozen=True)
class WindowGroupNeed:
    """What sizes a sliding group: its window, and the most tokens one tick prefills (None: no bound)."""

    window: int
    bytes_per_block: int
    prefill_tokens_per_tick: int | None
    max_prefill_rows: int  # prompts one tick may prefill (each may straddle one more block)

    def blocks(self, num_slots: int, block_size: int, max_model_len: int, full_layout_blocks: int) -> int:
        """Every running sequence's window (window / block_size + 2 blocks: the partial ends, one to grow
        into), plus room for the tick's prefill chunks, which write past their windows before giving back;
        never more than every layer keeping every block would take (full_layout_blocks)."""
        if self.prefill_tokens_per_tick is None:
            return full_layout_blocks
        per_sequence = -(-self.window // block_size) + 2
        tick = min(self.prefill_tokens_per_tick, self.max_prefill_rows * max_model_len)  # no prompt is longer
        room = -(-tick // block_size) + self.max_prefill_rows
        return min(num_slots * per_sequence + room, full_layout_blocks)


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def per_slot_window(model_max_len: int, ctx_size: int, num_slots: int, kv_unified: bool) -> int:
    """llama-server semantics: an explicit ctx_size is a total shared by the slots unless unified."""
    if ctx_size == 0:
        return model_max_len
    window = ctx_size if kv_unified else ctx_size // num_slots
    if window < MIN_TOKENS_PER_SLOT:
        raise ValueError(f"--ctx-size {ctx_size} over {num_slots} slots leaves {window} tokens per slot; "
                         f"at least {MIN_TOKENS_PER_SLOT} are needed")
    return min(window, model_max_len) if not kv_unified else window


def plan_kv_pool(*, model_max_len: int, ctx_size: int, num_slots: int, kv_unified: bool, block_size: int,
                 bytes_per_block: int, budget: int | None, weight_bytes: int,
                 free_bytes: int | None = None, max_kv_tokens: int = 0, state_bytes: int = 0,
                 window_group: WindowGroupNeed | None = None) -> KVPoolPlan:
    """budget: -1 = auto, None = unbounded, else bytes. max_kv_tokens (--max-kv-size) caps the pool
    and each slot's window in tokens; 0 = no cap. state_bytes (hybrid models' recurrent-state slots) come
    out of the budget first, then the sliding group's share (window_group: what it needs at most, never more
    than a full table would), and the rest is the full group's."""
    window = per_slot_window(model_max_len, ctx_size, num_slots, kv_unified)
    if max_kv_tokens:
        if max_kv_tokens < MIN_TOKENS_PER_SLOT:
            raise ValueError(f"--max-kv-size {max_kv_tokens} is below the {MIN_TOKENS_PER_SLOT}-token minimum")
        window = min(window, max_kv_tokens)
    blocks_per_slot = -(-window // block_size)
    # What every slot filling its window would need; more than that is never useful.
    wanted = blocks_per_slot * (1 if kv_unified and ctx_size else num_slots)
    if max_kv_tokens:
        wanted = min(wanted, max(max_kv_tokens // block_size, blocks_per_slot))
    window_blocks = window_bytes = 0
    if window_group is not None:
        window_blocks, window_bytes = window_group.blocks(num_slots, block_size, window, wanted), window_group.bytes_per_block
    if budget is None:
        return KVPoolPlan(window, wanted, bytes_per_block, None, "none", window_blocks, window_bytes)
    source = "explicit"
    if budget == -1:
        free = available_memory_bytes() if free_bytes is None else free_bytes
        budget = max(int((free - weight_bytes) * AUTO_BUDGET_FRACTION) - ACTIVATION_HEADROOM_BYTES, 0)
        source = "auto"
    if not bytes_per_block:  # no attention layer (a pure Mamba2 model): blocks only count positions
        if source == "explicit" and budget < state_bytes:
            raise ValueError(f"--kv-cache-budget {budget} bytes is less than the recurrent state needs "
                             f"({state_bytes} bytes)")
        return KVPoolPlan(window, wanted, 0, budget, source)
    num_blocks = min(wanted, max(budget - state_bytes - window_blocks * window_bytes, 0) // bytes_per_block)
    if num_blocks < blocks_per_slot:
        if source == "explicit":
            state = f" after {state_bytes} bytes of recurrent state" if state_bytes else ""
            if window_blocks:
                state += f" after {window_blocks * window_bytes} bytes of sliding-window blocks"
            raise ValueError(f"--kv-cache-budget {budget} bytes holds {num_blocks} blocks{state}, "
                             f"fewer than one slot's window needs ({blocks_per_slot})")
        num_blocks = blocks_per_slot  # auto never makes one request impossible
    return KVPoolPlan(window, num_blocks, bytes_per_block, budget, source, window_blocks, window_bytes)
