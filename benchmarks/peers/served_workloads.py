"""What `vllm bench serve` sends in the served comparison, per `--workload`:

- `random`: random prompts sharing nothing but the chat template (`--dataset-name random`),
  `--input-len` tokens give or take `--range-ratio`, through `/v1/chat/completions`;
- `prefix`: `--num-prefixes` random prefixes of `--prefix-len` tokens (system prompts,
  documents), each request one of them and a random `--suffix-len`-token question
  (`--dataset-name prefix_repetition`, shuffled), through `/v1/chat/completions`;
- `multiturn`: `--conversations` conversations of `--turns` turns, every turn resending the
  history (`conversations.py`), pre-rendered with the chat template and sent as a JSONL
  dataset (`--dataset-name custom`) to `/v1/completions`, so both servers get the same text;
- `structured`: support emails to extract into JSON under a JSON schema (`structured.py`),
  through `/v1/chat/completions` with the schema as `response_format` (`--extra-body`);
  vLLM runs its llguidance backend (`--structured-outputs-config`), bucketserve's only one.

Every workload but `structured` asks for exactly `--output-len` tokens (`--ignore-eos`);
`structured` stops where the JSON ends, `--output-len` its cap. `--temperature` is 0
(greedy) unless given.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.peers import structured
from benchmarks.peers.conversations import ConversationSpec, conversation_prompts, write_jsonl

WORKLOADS = ("random", "prefix", "multiturn", "structured")
# Per workload, what --rates / --num-prompts / --output-len mean when not given.
DEFAULTS = {
    "random": {"rates": "1,2,3,4", "num_prompts": 100, "output_len": 96},
    "prefix": {"rates": "0.5,1,1.5,2,3", "num_prompts": 40, "output_len": 64},
    "multiturn": {"rates": "0.5,1,1.5,2,3", "num_prompts": None, "output_len": 64},
    # replies run ~190 tokens, twice the others: the 2-core box saturates near 0.5 req/s
    "structured": {"rates": "0.25,0.5,0.75,1", "num_prompts": 40, "output_len": 256},
}
# What the peer venv must import for a workload's dataset (custom reads JSONL with pandas).
PEER_MODULES = {"multiturn": ("pandas",), "structured": ("pandas",)}
# vLLM's grammar engine for the structured workload: llguidance, as bucketserve's.
VLLM_STRUCTURED = ["--structured-outputs-config", json.dumps({"backend": "guidance"})]
CHAT = ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions"]
COMPLETIONS = ["--backend", "openai", "--endpoint", "/v1/completions"]


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="random", choices=WORKLOADS)
    parser.add_argument("--rates", default=None, help="comma-separated req/s; default per "
                        "workload: " + "; ".join(f"{w} {d['rates']}" for w, d in DEFAULTS.items()))
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="per rate; default random 100, prefix 40, multiturn every turn "
                        "of every conversation, structured 40")
    parser.add_argument("--output-len", type=int, default=None,
                        help="tokens out; default random 96, structured 256 (a cap), "
                        "otherwise 64")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (the default), else sampled on both servers")
    parser.add_argument("--input-len", type=int, default=384, help="random")
    parser.add_argument("--range-ratio", type=float, default=0.9, help="random")
    parser.add_argument("--num-prefixes", type=int, default=4, help="prefix")
    parser.add_argument("--prefix-len", type=int, default=768, help="prefix")
    parser.add_argument("--suffix-len", type=int, default=48, help="prefix")
    parser.add_argument("--conversations", type=int, default=8, help="multiturn")
    parser.add_argument("--turns", type=int, default=6, help="multiturn")
    parser.add_argument("--user-len", type=int, default=96,
                        help="multiturn: tokens per user message (each resent reply has "
                        "--output-len)")


def resolve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fill the per-workload defaults in `args` and check the sizes fit the workload."""
    defaults = DEFAULTS[args.workload]
    args.rates = args.rates or defaults["rates"]
    args.output_len = args.output_len or defaults["output_len"]
    if args.workload == "multiturn":
        turns = conversation_spec(args).num_requests
        if args.num_prompts not in (None, turns):
            parser.error(f"multiturn sends every turn once: --num-prompts is "
                         f"--conversations x --turns = {turns}")
        args.num_prompts = turns
    args.num_prompts = args.num_prompts or defaults["num_prompts"]
    if args.workload == "prefix" and args.num_prompts % args.num_prefixes:
        # vLLM's prefix_repetition makes num_prompts // num_prefixes requests per prefix
        parser.error(f"--num-prompts ({args.num_prompts}) must be a multiple of "
                     f"--num-prefixes ({args.num_prefixes})")


def conversation_spec(args: argparse.Namespace) -> ConversationSpec:
    return ConversationSpec(args.conversations, args.turns, args.user_len, args.output_len)


def prepare(args: argparse.Namespace, model: Path, out: Path) -> Path | None:
    """The dataset file the workload reads (multiturn, structured), written once per seed;
    else None."""
    if args.workload == "structured":
        return structured.write_dataset(
            args.num_prompts, args.seed, out / f"structured-s{args.seed}.jsonl"
        )
    if args.workload != "multiturn":
        return None
    from bucketserve.runtime.io.tokenizer import Tokenizer

    prompts = conversation_prompts(Tokenizer.from_dir(model), conversation_spec(args), args.seed)
    return write_jsonl(prompts, out / f"multiturn-s{args.seed}.jsonl")


def dataset_args(args: argparse.Namespace, dataset: Path | None) -> list[str]:
    """The endpoint and dataset options of `vllm bench serve` for `args.workload`."""
    out = str(args.output_len)
    if args.workload == "random":
        return [*CHAT, "--dataset-name", "random", "--random-input-len", str(args.input_len),
                "--random-range-ratio", str(args.range_ratio), "--random-output-len", out]
    if args.workload == "prefix":
        return [*CHAT, "--dataset-name", "prefix_repetition",
                "--prefix-repetition-num-prefixes", str(args.num_prefixes),
                "--prefix-repetition-prefix-len", str(args.prefix_len),
                "--prefix-repetition-suffix-len", str(args.suffix_len),
                "--prefix-repetition-output-len", out]
    if dataset is None:
        raise ValueError(f"the {args.workload} workload needs its dataset file (prepare)")
    if args.workload == "structured":
        return [*CHAT, "--dataset-name", "custom", "--dataset-path", str(dataset),
                "--skip-chat-template", "--disable-shuffle", "--custom-output-len", out,
                "--extra-body", json.dumps({"response_format": structured.RESPONSE_FORMAT})]
    return [*COMPLETIONS, "--dataset-name", "custom", "--dataset-path", str(dataset),
            "--skip-chat-template", "--disable-shuffle", "--custom-output-len", out]


def ignores_eos(args: argparse.Namespace) -> bool:
    """Whether the workload's requests run to `--output-len` past EOS (all but structured,
    whose grammar ends at the JSON's end)."""
    return args.workload != "structured"


def vllm_serve_args(args: argparse.Namespace) -> list[str]:
    """What `vllm serve` needs for the workload beyond the common options."""
    return VLLM_STRUCTURED if getattr(args, "workload", None) == "structured" else []


def schema_valid(args: argparse.Namespace, raw: dict) -> float | None:
    """The share of a run's requests whose reply validates (structured); else None."""
    if args.workload != "structured":
        return None
    texts = raw.get("generated_texts") or []
    return structured.valid_fraction(texts, raw.get("errors"), raw.get("num_prompts") or len(texts))
