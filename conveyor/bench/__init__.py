"""`conveyor bench`: a serving benchmark for OpenAI-compatible servers (see docs/bench.md)."""
