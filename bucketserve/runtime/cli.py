"""`bucketserve offline`: chat completions for a few prompts with the in-process engine;
`bucketserve kernels build`: the CPU kernel library, built now rather than on first use."""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Name one fruit.",
    "Explain in two sentences what a KV cache is in a transformer.",
    "Write a haiku about continuous batching.",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "offline",
        help="generate replies to chat prompts in this process (no Ray, no server)",
        description="Generate replies to chat prompts with the in-process engine "
        "(continuous batching over a paged KV cache) and print them.",
    )
    parser.add_argument(
        "prompts", nargs="*", metavar="PROMPT", help="user messages (default: a few examples)"
    )
    parser.add_argument(
        "--model", default=None, help="HF model dir or .gguf file (default: embedded SmolLM2)"
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per reply (128)")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default), else sampling"
    )
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--device", default="auto", help="cpu, cuda, hpu or auto")
    parser.add_argument(
        "--quantization", choices=["auto", "none"], default="auto",
        help="auto: a GGUF's quantized weights stay in their blocks on CPU; none: float32",
    )
    parser.set_defaults(func=run)
    _register_kernels(subparsers)


def _register_kernels(subparsers: argparse._SubParsersAction) -> None:
    kernels = subparsers.add_parser(
        "kernels",
        help="the CPU kernels (C, built with the system compiler)",
        description="Manage the CPU kernels, built once per machine, source and ISA.",
    )
    kernels.set_defaults(func=lambda args: kernels.print_help() or 2)
    actions = kernels.add_subparsers(dest="kernels_command", metavar="ACTION")
    build = actions.add_parser(
        "build",
        help="build the kernel library now (or find it cached)",
        description="Build the CPU kernel library for this machine, or find it cached, and "
        "print its path. A failed build is recorded and later processes run the torch code "
        "without retrying it; --force clears the record and builds again.",
    )
    build.add_argument(
        "--isa", default=None,
        help="the -march target, e.g. x86-64-v3 (default: $BUCKETSERVE_CPU_ISA, else native)",
    )
    build.add_argument(
        "--force", action="store_true",
        help="forget a recorded failure and build again even where a library is cached",
    )
    build.set_defaults(func=build_kernels)


def build_kernels(args: argparse.Namespace) -> int:
    """One line: the library, its ISA and how long the build took; or why it failed."""
    from bucketserve.runtime.cpu.kernels.build import KernelBuild, KernelBuildError

    try:
        build = KernelBuild(args.isa)
        path = build.library(force=args.force)
    except (KernelBuildError, OSError) as exc:
        print(f"bucketserve kernels build: {exc}", file=sys.stderr)
        return 1
    took = "cached" if build.seconds is None else f"built in {build.seconds:.1f} s"
    print(f"{path} (-march={build.isa}, {took})")
    return 0


def run(args: argparse.Namespace) -> int:
    from bucketserve.runtime.core.sampling_params import SamplingParams
    from bucketserve.runtime.engine.llm import LLM

    try:
        params = SamplingParams(
            temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
        )
    except ValueError as exc:
        raise SystemExit(f"bucketserve offline: {exc}") from exc
    prompts = args.prompts or list(DEFAULT_PROMPTS)
    llm = LLM(args.model, device=args.device, quantization=args.quantization)
    start = time.perf_counter()
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, False)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs, strict=True):
        print(f"### {prompt}\n{out.text.strip()}\n[{len(out.token_ids)} tokens, "
              f"{out.finish_reason.value}]\n")
    total = sum(len(out.token_ids) for out in outputs)
    print(f"{len(outputs)} replies, {total} tokens in {elapsed:.1f} s "
          f"({total / elapsed:.1f} tok/s)")
    return 0
