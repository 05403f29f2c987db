"""Disaggregated serving: prefill and decode nodes, a model-free router, the wire between them.

wire.py       versioned, length-checked msgspec frames (no pickle on the wire)
transport.py  asyncio TCP streams: addresses, connect with timeout, frame read/write
registry.py   the router's view of the pools: health, round-robin choice, dispatch counts
health.py     the background TCP probe of every peer
prefill.py    prefill role: prefill, first token, KV handoff to a decode node, relay back
decode.py     decode role: import the handoff, decode in the continuous batch, stream back
router.py     router role: HTTP front (tokenizer only), dispatch, failover, merge, /router/stats
remote.py     one routed request: attempts, retries, the stream spliced across a retry
serve.py      `conveyor serve --node-role ...` wiring
"""
