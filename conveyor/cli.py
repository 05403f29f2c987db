"""`conveyor` command line: generate, run (chat REPL), serve, bench."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from conveyor.config import ConfigError, add_flags, load_configs

# Engine flags that make sense for the single-slot CLI paths.
_CLI_ENGINE_FLAGS = {"model", "hf_file", "revision", "dtype", "weight_dtype", "device", "threads", "seed", "block_size", "kv_cache_budget",
                     "cache_type_k", "cache_type_v", "ctx_size",
                     "enable_prefix_caching", "prefill_chunk_size", "batch_invariant", "mmproj"}


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--max-tokens", type=int, default=256, help="tokens to generate")
    parser.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description="Continuous-batching LLM inference server")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", required=True)

    generate = subparsers.add_parser("generate", help="generate text for one prompt")
    generate.add_argument("-p", "--prompt", required=True, help="prompt text")
    generate.add_argument("--raw", action="store_true", help="do not apply the chat template")
    generate.add_argument("--system", default=None, help="system message (chat mode)")
    _add_sampling_flags(generate)
    add_flags(generate, _CLI_ENGINE_FLAGS)
    generate.set_defaults(func=_run_generate)

    run = subparsers.add_parser("run", help="interactive chat REPL")
    run.add_argument("-p", "--prompt", default=None, help="answer this one message and exit")
    run.add_argument("--system", default=None, help="system message")
    run.add_argument("--image", action="append", default=[], metavar="FILE",
                     help="an image for the first message (a vision model; may be given several times)")
    _add_sampling_flags(run)
    add_flags(run, _CLI_ENGINE_FLAGS)
    run.set_defaults(func=_run_chat)

    env = subparsers.add_parser("env", help="the kernel backend, CPU, torch build and compiler (for bug reports)")
    env.add_argument("--json", action="store_true", help="print JSON")
    add_flags(env, {"kernel_arch", "require_kernels", "disable_kernel", "batch_invariant"})
    env.set_defaults(func=_run_env)

    pull = subparsers.add_parser("pull", help="download a Hugging Face Hub model (ORG/NAME[:QUANT]) into the cache")
    pull.add_argument("name", help="ORG/NAME, or ORG/NAME:QUANT for a GGUF repo")
    add_flags(pull, {"hf_file", "revision"})
    pull.set_defaults(func=_run_pull)
    ls = subparsers.add_parser("ls", help="the models in the Hugging Face cache (shared with other tools)")
    ls.set_defaults(func=_run_ls)
    rm = subparsers.add_parser("rm", help="delete a model from the Hugging Face cache")
    rm.add_argument("name", help="ORG/NAME, as `conveyor ls` lists it")
    rm.set_defaults(func=_run_rm)

    vocab = subparsers.add_parser("draft-vocab", help="count text files' tokens into a --draft-vocab file (FR-Spec)")
    vocab.add_argument("files", nargs="+", metavar="TEXT", help="text files like what the server will write")
    vocab.add_argument("-o", "--output", required=True, help="the TOKEN_ID COUNT file to write")
    add_flags(vocab, {"model", "hf_file", "revision"})
    vocab.set_defaults(func=_run_draft_vocab)

    from conveyor.bench import cli as bench_cli

    bench_cli.add_parser(subparsers)
    serve = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                                  description="Serve the OpenAI-compatible HTTP API with continuous batching "
                                              "(or a disaggregated role: --node-role, docs/distributed.md).")
    add_flags(serve)
    serve.set_defaults(func=_run_serve)
    return parser


def _run_serve(args: argparse.Namespace) -> int:
    """`conveyor serve`: one node (server/), or the role --node-role names (cluster/)."""
    from conveyor.server import cli as server_cli  # imported here so `conveyor --help` stays fast

    configs = server_cli.load_serve_configs(args)
    if configs is None:
        return 2
    engine_config, server_config, cluster_config, models_config = configs
    if cluster_config.node_role is None:
        return server_cli.serve_until_signal(
            lambda: server_cli.build_node_server(engine_config, server_config, models_config))
    from conveyor.cluster.serve import build_cluster_server

    return server_cli.serve_until_signal(lambda: build_cluster_server(engine_config, server_config, cluster_config,
                                                                      models_config.models))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"conveyor: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _run_pull(args: argparse.Namespace) -> int:
    from conveyor.loading import LoadError
    from conveyor.loading.hub import parse_hub_spec, resolve_model

    if parse_hub_spec(args.name) is None:
        print(f"conveyor: {args.name!r} is not a Hugging Face Hub name (ORG/NAME[:QUANT])", file=sys.stderr)
        return 2
    try:
        print(resolve_model(args.name, args.hf_file, args.revision))
    except LoadError as exc:
        print(f"conveyor: {exc}", file=sys.stderr)
        return 1
    return 0


def _run_draft_vocab(args: argparse.Namespace) -> int:
    """`conveyor draft-vocab`: the model's tokenizer over the files, counts written most frequent first."""
    from conveyor.engine.draft_vocab import count_text_files, coverage, write_token_counts
    from conveyor.loading import LoadError, load_checkpoint

    config, _ = load_configs(args)
    try:
        tokenizer = load_checkpoint(config.model, hf_file=config.hf_file, revision=config.revision).tokenizer
        try:
            counts = write_token_counts(args.output, count_text_files(tokenizer, args.files))
        except OSError as exc:  # the output (a missing folder, no permission); a TEXT file's is a LoadError
            raise LoadError(f"draft-vocab: cannot write {args.output} ({exc.strerror or exc})") from None
    except LoadError as exc:
        print(f"conveyor: {exc}", file=sys.stderr)
        return 1
    shares = ", ".join(f"top {n}: {share:.1%}" for n, share in coverage(counts, (4096, 16384, 32768)).items())
    print(f"{args.output}: {sum(counts.values())} tokens, {len(counts)} distinct ids" + (f" ({shares})" if shares else ""))
    return 0


def _run_ls(args: argparse.Namespace) -> int:
    from conveyor.loading.hub import cached_models

    for model in cached_models():
        weights = [f for f in model.files if f.endswith((".gguf", ".safetensors"))]
        print(f"{model.repo_id:48} {model.size_bytes / 2**20:10.1f} MiB  {', '.join(weights) or '(no weights)'}")
    return 0


def _run_rm(args: argparse.Namespace) -> int:
    from conveyor.loading import LoadError
    from conveyor.loading.hub import remove_cached

    try:
        freed = remove_cached(args.name)
    except LoadError as exc:
        print(f"conveyor: {exc}", file=sys.stderr)
        return 1
    print(f"removed {args.name.partition(':')[0]} ({freed / 2**20:.1f} MiB)")
    return 0


def _run_env(args: argparse.Namespace) -> int:
    from conveyor import env

    engine_config, _ = load_configs(args)
    return env.main(engine_config, as_json=args.json)


def _single_slot_engine(args: argparse.Namespace):
    """The server's engine path at one slot (CLI and server share every step)."""
    from conveyor.engine.async_engine import AsyncEngine
    from conveyor.loading import LoadError

    engine_config, _ = load_configs(args, parallel=1, max_batch_size=1)
    try:
        return AsyncEngine.from_config(engine_config)
    except LoadError as exc:
        print(f"conveyor: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def _sampling_params(args: argparse.Namespace):
    from conveyor.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed)


async def _stream_reply(engine, prompt_ids: list[int], params, images: list | None = None) -> str:
    request = engine.core.make_request(prompt_ids, params, images=images or ())
    text = []
    async for out in engine.generate(request):
        print(out.new_text, end="", flush=True)
        text.append(out.new_text)
        if out.error:
            print(f"\n[error: {out.error}]", file=sys.stderr)
    print()
    return "".join(text)


def _prompt_ids(engine, messages: list[dict] | None, raw_text: str | None) -> list[int]:
    tokenizer = engine.core.tokenizer
    if messages is None:
        return tokenizer.encode(raw_text)
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                            add_special_tokens=False)


def _run_generate(args: argparse.Namespace) -> int:
    from conveyor.errors import InvalidRequestError

    async def go() -> int:
        engine = _single_slot_engine(args)
        engine.start(asyncio.get_running_loop())
        try:
            messages = None if args.raw else _with_system(args.system, [{"role": "user", "content": args.prompt}])
            await _stream_reply(engine, _prompt_ids(engine, messages, args.prompt), _sampling_params(args))
            return 0
        except InvalidRequestError as exc:
            print(f"conveyor: invalid request: {exc}", file=sys.stderr)
            return 2
        finally:
            engine.shutdown()

    return asyncio.run(go())


def _run_chat(args: argparse.Namespace) -> int:
    from conveyor.errors import InvalidRequestError

    async def go() -> int:
        images = _read_images(args.image)  # they stay in the first message, so every turn shows them again
        engine = _single_slot_engine(args)
        engine.start(asyncio.get_running_loop())
        history = _with_system(args.system, [])
        try:
            while True:
                if args.prompt is not None:
                    line = args.prompt
                else:
                    try:
                        line = await asyncio.to_thread(input, "> ")
                    except EOFError:
                        return 0
                if line.strip() in ("/exit", "/quit"):
                    return 0
                if not line.strip():
                    continue
                first = images and not any(m["role"] == "user" for m in history)
                content = [{"type": "image"}] * len(images) + [{"type": "text", "text": line}] if first else line
                history.append({"role": "user", "content": content})
                try:
                    reply = await _stream_reply(engine, _prompt_ids(engine, history, None), _sampling_params(args),
                                                images)
                except InvalidRequestError as exc:
                    print(f"[invalid request: {exc}]", file=sys.stderr)
                    history.pop()
                    continue
                history.append({"role": "assistant", "content": reply})
                if args.prompt is not None:
                    return 0
        finally:
            engine.shutdown()

    return asyncio.run(go())


def _read_images(paths: list[str]) -> list:
    """--image files as ImageInputs (first frame, RGB); a bad file ends the command with its error."""
    if not paths:
        return []
    from PIL import Image

    from conveyor.multimodal.image_input import ImageInput

    images = []
    for path in paths:
        try:
            with Image.open(path) as image:
                images.append(ImageInput.from_pil(image.convert("RGB")))
        except (OSError, ValueError) as exc:
            print(f"conveyor: --image {path}: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
    return images


def _with_system(system: str | None, messages: list[dict]) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + messages


if __name__ == "__main__":
    sys.exit(main())
