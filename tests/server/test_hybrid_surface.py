"""A hybrid model served: the layer kinds and state bytes in /props and /v1/models, the recurrent-state
slots in /v1/cache/stats, /slots, /metrics and the dashboard snapshot, while a stream runs and after."""

import httpx

from conveyor.config import EngineConfig
from conveyor.testing import tiny_hybrid_checkpoint
from tests.server.conftest import serve


def test_hybrid_state_is_reported_everywhere():
    with serve(tiny_hybrid_checkpoint("qwen3_5_text"), EngineConfig(parallel=2, state_snapshots=3)) as served:
        http = httpx.Client(base_url=served.url, timeout=60)
        props = http.get("/props").json()
        per_sequence = props["layers"]["state_bytes_per_sequence"]
        # 3 DeltaNet layers: conv window (2*32 + 64 channels x 3) + state (4 heads x 16 x 16), fp32
        assert per_sequence == 3 * 4 * (128 * 3 + 4 * 16 * 16)
        assert props["layers"]["layer_kinds"] == {"linear_attention": 3, "full_attention": 1}
        card = http.get("/v1/models").json()["data"][0]
        assert card["meta"]["state_bytes_per_sequence"] == per_sequence and card["meta"]["attention_layers"] == 1

        stream = served.client().completions.create(model=served.model, prompt="Tell me about " * 20,
                                                    max_tokens=64, temperature=0, stream=True)
        next(iter(stream))  # the request is running: it holds a state slot
        served.wait_until(lambda: served.core.states.stats().num_live == 1, what="a live state slot")
        slots = http.get("/slots").json()
        assert [s["state_slot"] is not None for s in slots if s["is_processing"]] == [True]
        state = http.get("/v1/cache/stats").json()["recurrent_state"]
        # 2 sequences + 2 rollback (prompt lookup is on) + 3 snapshots
        assert state["slots"] == 7 and state["bytes_per_slot"] == per_sequence and state["max_snapshots"] == 3
        for _ in stream:
            pass
        served.wait_until(lambda: served.core.states.stats().num_live == 0, what="the slot released")
        metrics = http.get("/metrics").text
        assert "conveyor_state_slots_total 7.0" in metrics and "conveyor_state_slots_used 0.0" in metrics
        state = http.get("/v1/cache/stats").json()["recurrent_state"]
        assert state["live"] == 0 and state["snapshots"] >= 1  # the prompt's last whole block was snapshotted
