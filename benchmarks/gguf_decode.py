"""One GGUF file, three servers of it: bucketserve keeping its quantized blocks
(`quantization: auto`), bucketserve expanding it to float32 (`none`, what it did before),
and llama.cpp's `llama-server` (built by `benchmarks/peers/llama_server.sh`) where present.

The file is a Qwen2.5-0.5B-shaped model with seeded random weights, written here with the
`gguf` package in one of the types it quantizes (Q8_0, Q4_0, ...), or a Llama-3-8B-shaped
one (`--shape llama8b`) whose blocks are random bytes with small scales (quantizing 8 G
floats in numpy takes too long; the speed is the same), or a file you pass.
Each server runs in its own process on the same cores; per engine: decode at batch 1
(a 64-token prompt, 256 tokens out, EOS ignored), decode at batch 16, a 512-token prefill,
and the process tree's resident memory once warmed. llama-server's figures are its own
`timings` (prompt and decode rates of the request, no HTTP); ours are the offline engine's
wall time over the same token counts.

    python -m benchmarks.gguf_decode --qtype Q8_0 Q4_0 --out benchmarks/results/gguf/decode.json
    python -m benchmarks.gguf_decode --shape llama8b --qtype Q4_0 --quick --out ...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

LLAMA_SERVER = Path(__file__).parent / "peers" / "llama.cpp" / "bin" / "llama-server"
SHAPES = {
    # Qwen2.5-0.5B (tied embeddings, q/k/v biases)
    "qwen05b": dict(arch="qwen2", hidden=896, ffn=4864, layers=24, heads=14, kv_heads=2,
                    vocab=151936, rope_base=1_000_000.0),
    # Llama-3-8B (its own head; no rope scaling: the GGUF converter refuses rope_freqs)
    "llama8b": dict(arch="llama", hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8,
                    vocab=128256, rope_base=500_000.0),
}
PROMPT_LEN, DECODE_TOKENS, BATCH, PREFILL_LEN, RUNS = 64, 256, 16, 512, 3
CONTEXT = 4096  # tokens of KV both servers hold (llama-server's -c; our pool's blocks)


def write_random_gguf(path: Path, qtype: str, shape: dict, seed: int = 0) -> Path:
    """A GGUF of `shape` with seeded random weights, its matrices in `qtype` (quantized by
    the gguf package, or random blocks for `llama8b`); the vocabulary is the embedded
    SmolLM2's, padded with control tokens to `vocab`."""
    import gguf

    from bucketserve.runtime.io.default_model import default_gguf_path
    from bucketserve.runtime.io.gguf_file import GGUFFile

    fields = GGUFFile(default_gguf_path()).fields
    tokens = list(fields["tokenizer.ggml.tokens"])
    types = list(fields["tokenizer.ggml.token_type"])
    pad = shape["vocab"] - len(tokens)
    tokens += [f"<|pad_{i}|>" for i in range(pad)]
    types += [gguf.TokenType.CONTROL] * pad
    h, f, heads, kv = shape["hidden"], shape["ffn"], shape["heads"], shape["kv_heads"]
    head_dim = h // heads
    w = gguf.GGUFWriter(str(path), shape["arch"])
    w.add_block_count(shape["layers"])
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(shape["rope_base"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(fields["tokenizer.ggml.merges"]))
    w.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
    w.add_chat_template(fields["tokenizer.chat_template"])
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[qtype]

    weights, size = gguf.GGML_QUANT_SIZES[kind]
    random_blocks = shape["hidden"] >= 4096

    def matrix(name: str, rows: int, cols: int) -> None:
        if random_blocks:  # random quants, every block's float16 scale (its first 2 bytes) 1e-3
            blocks = rng.integers(0, 256, (rows, cols // weights, size), dtype=np.uint8)
            blocks[..., :2] = np.full((rows, cols // weights, 1), 1e-3, np.float16).view(np.uint8)
            w.add_tensor(name, blocks.reshape(rows, -1), raw_dtype=kind)
            return
        data = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)

    def vector(name: str, size: int, value: float | None = None) -> None:
        data = np.full(size, value, np.float32) if value is not None else (
            rng.standard_normal(size, dtype=np.float32) * 0.02)
        w.add_tensor(name, data)

    matrix("token_embd.weight", shape["vocab"], h)
    if shape["arch"] == "llama":
        matrix("output.weight", shape["vocab"], h)
    vector("output_norm.weight", h, 1.0)
    for i in range(shape["layers"]):
        vector(f"blk.{i}.attn_norm.weight", h, 1.0)
        vector(f"blk.{i}.ffn_norm.weight", h, 1.0)
        for part, rows in (("q", h), ("k", kv * head_dim), ("v", kv * head_dim)):
            matrix(f"blk.{i}.attn_{part}.weight", rows, h)
            if shape["arch"] == "qwen2":
                vector(f"blk.{i}.attn_{part}.bias", rows)
        matrix(f"blk.{i}.attn_output.weight", h, h)
        matrix(f"blk.{i}.ffn_gate.weight", f, h)
        matrix(f"blk.{i}.ffn_up.weight", f, h)
        matrix(f"blk.{i}.ffn_down.weight", h, f)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1000, 40000, length).tolist() for _ in range(count)]


def tree_rss(pid: int) -> int:
    import psutil

    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


def run_bucketserve(model: str, quantization: str, quick: bool) -> dict:
    """This file in a child process (`--engine`): its figures as JSON on the last line."""
    command = [sys.executable, "-m", "benchmarks.gguf_decode", "--engine", model, quantization]
    out = subprocess.run(command + ["--quick"] * quick, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def engine_figures(model: str, quantization: str, quick: bool) -> dict:
    """Decode at batch 1 (and with `quick` nothing else: one run of 32 tokens), at batch
    BATCH, a PREFILL_LEN prefill; resident memory; seconds to load the model."""
    from bucketserve.runtime import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, quantization=quantization, num_kv_blocks=CONTEXT // 16)
    load_s = time.perf_counter() - start
    decode = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0, ignore_eos=True)
    llm.generate(prompts(1, PROMPT_LEN, 9), SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)

    runs = 1 if quick else RUNS

    def rate(count: int, length: int, params: SamplingParams, tokens: int) -> float:
        """Median rate over `runs` runs, each on new prompts (no prefix-cache hits)."""
        times = []
        for run in range(runs):
            batch = prompts(count, length, seed=100 * length + run)
            start = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        return tokens / statistics.median(times)

    runner = llm.engine.runner
    common = {"load_s": load_s, "weights": runner.weight_formats,
              "weight_mib": runner.weight_bytes / 2**20}
    if quick:
        quick_decode = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        one = rate(1, PROMPT_LEN, quick_decode, 32)
        return {"decode_tok_s_batch1": one, "rss_mib": tree_rss(os.getpid()) / 2**20, **common}
    # decode rates: the prompt's own prefill is a few % of these runs' time
    one = rate(1, PROMPT_LEN, decode, DECODE_TOKENS)
    batch_params = SamplingParams(max_tokens=DECODE_TOKENS // 4, temperature=0, ignore_eos=True)
    batched = rate(BATCH, PROMPT_LEN, batch_params, BATCH * DECODE_TOKENS // 4)
    prefill = rate(1, PREFILL_LEN, SamplingParams(max_tokens=1), PREFILL_LEN)
    return {
        "decode_tok_s_batch1": one, f"decode_tok_s_batch{BATCH}": batched,
        "prefill_tok_s": prefill, "rss_mib": tree_rss(os.getpid()) / 2**20, **common,
    }


def run_llama_server(model: str, threads: int, quick: bool) -> dict | None:
    if not LLAMA_SERVER.is_file():
        return None
    port = 18080
    server = subprocess.Popen(
        [str(LLAMA_SERVER), "-m", model, "-t", str(threads), "-c", str(CONTEXT),
         "--port", str(port), "--no-webui", "-np", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)

        def complete(prompt: list[int], n: int) -> dict:
            body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True,
                    "cache_prompt": False}
            req = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                return json.loads(r.read())["timings"]

        complete(prompts(1, PROMPT_LEN, 9)[0], 8)
        runs, tokens = (1, 32) if quick else (RUNS, DECODE_TOKENS)
        decode = [complete(prompts(1, PROMPT_LEN, 100 * PROMPT_LEN + run)[0], tokens)
                  for run in range(runs)]
        if quick:
            return {"decode_tok_s_batch1": decode[0]["predicted_per_second"],
                    "prefill_tok_s": float("nan"), "rss_mib": tree_rss(server.pid) / 2**20}
        prefill = [complete(prompts(1, PREFILL_LEN, 100 * PREFILL_LEN + run)[0], 1)
                   for run in range(RUNS)]
        return {
            "decode_tok_s_batch1": statistics.median(t["predicted_per_second"] for t in decode),
            "prefill_tok_s": statistics.median(t["prompt_per_second"] for t in prefill),
            "rss_mib": tree_rss(server.pid) / 2**20,
        }
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qtype", nargs="+", default=["Q8_0", "Q4_0"])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen05b")
    parser.add_argument("--quick", action="store_true",
                        help="decode at batch 1 only, one run of 32 tokens (large models)")
    parser.add_argument("--modes", nargs="+", default=["auto", "none"],
                        help="bucketserve's quantization modes to run")
    parser.add_argument("--gguf", help="a GGUF file to use instead of writing one")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gguf/decode.json"))
    parser.add_argument("--engine", nargs=2, metavar=("MODEL", "QUANTIZATION"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        print(json.dumps(engine_figures(*args.engine, args.quick)))
        return
    import torch

    from bucketserve.runtime.loader.model_files import resolve_model

    threads = torch.get_num_threads()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        files = [(Path(args.gguf), "file")] if args.gguf else [
            (write_random_gguf(Path(tmp) / f"{args.shape}-{q}.gguf", q, SHAPES[args.shape]), q)
            for q in args.qtype]
        for path, qtype in files:
            row = {"file": path.name, "qtype": qtype, "size_mib": path.stat().st_size / 2**20}
            for mode in ("auto", "none"):
                if mode in args.modes:  # converted here, so the measured processes only load
                    start = time.perf_counter()
                    resolve_model(path, keep_blocks=mode == "auto")
                    row[f"convert_s_{mode}"] = time.perf_counter() - start
                    row[f"bucketserve_{mode}"] = run_bucketserve(str(path), mode, args.quick)
            row["llama_server"] = run_llama_server(str(path), threads, args.quick)
            results.append(row)
            print(json.dumps(row, indent=1), flush=True)
    print(f"\n{'file':24} {'engine':18} {'decode b1':>10} {f'b{BATCH}':>8} {'prefill':>8} "
          f"{'RSS MiB':>8}")
    for row in results:
        for engine in ("bucketserve_auto", "bucketserve_none", "llama_server"):
            r = row.get(engine)
            if r is None:
                continue
            batched = r.get(f"decode_tok_s_batch{BATCH}", float("nan"))
            print(f"{row['file']:24} {engine:18} {r['decode_tok_s_batch1']:10.1f} "
                  f"{batched:8.1f} {r.get('prefill_tok_s', float('nan')):8.0f} "
                  f"{r['rss_mib']:8.0f}")
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines()
                       if ln.startswith("Model name")), platform.processor())
    flags = next((ln for ln in cpu.splitlines() if ln.startswith("Flags")), "")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "results": results, "threads": threads, "cpu": model_name,
        "isa": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f" {f}" in flags],
        "command": "python -m benchmarks.gguf_decode " + " ".join(sys.argv[1:]),
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
