"""Disaggregated serving: prefill and decode nodes, a model-free router, the wire between them.

wire.py       versioned, length-checked msgspec frames (no pickle on the wire)
transport.py  asyncio TCP streams: addresses, connect with timeout, frame read/write
registry.py   the router's view of the pools: health, models served, round-robin choice, dispatch counts
health.py     the background probe of every peer: reachable, and which models it serves
prefill.py    prefill role: prefill, first token, KV handoff to a decode node, relay back
decode.py     decode role: import the handoff, decode in the continuous batch, stream back
router.py     router role: HTTP front (tokenizers only), dispatch, failover, merge, /router/stats
models.py     which model a request through the router is for; /v1/models with the nodes serving each
remote.py     one routed request: attempts, retries, the stream spliced across a retry
forward.py    embeddings, rerank and score: forwarded over HTTP to a node serving the model
serve.py      `conveyor serve --node-role ...` wiring
"""
