"""DFlash drafting over HTTP: /v1/internal/spec-policy (and /props) show the drafter (kind, name, drafts per row
capped at its block - 1), and a greedy reply is plain decoding's."""

from __future__ import annotations

import httpx

from conveyor.config import EngineConfig
from conveyor.testing import write_tiny_dflash


def test_the_policy_endpoint_shows_the_dflash_drafter(tiny, serve_tiny, tmp_path):
    drafter = write_tiny_dflash(tmp_path, tiny, target_layer_ids=[0], block_size=4)
    body = {"prompt": "alpha beta gamma", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    with serve_tiny(EngineConfig(parallel=2, speculative_ngram=0)) as plain:
        want = httpx.post(f"{plain.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    config = EngineConfig(parallel=2, speculative_ngram=0, draft_kind="dflash", draft_model=drafter,
                          draft_policy="enable")
    with serve_tiny(config) as served:
        got = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        policy = httpx.get(f"{served.url}/v1/internal/spec-policy").json()
        props = httpx.get(f"{served.url}/props").json()
    assert got == want
    assert policy == props["speculation"]
    draft = policy["draft_model"]
    assert draft["enabled"] and draft["kind"] == "dflash" and draft["block_size"] == 3
    assert draft["name"].endswith(":dflash:" + tmp_path.name) and draft["draft_tokens"] > 0
    assert policy["policy"]["mode"] == "enable"
