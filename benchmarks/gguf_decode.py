"""One GGUF file, three servers of it: bucketserve keeping its quantized blocks
(`quantization: auto`), bucketserve expanding it to float32 (`none`, what it did before),
and llama.cpp's `llama-server` (built by `benchmarks/peers/llama_server.sh`) where present.

The file is a Qwen2.5-0.5B-shaped model with seeded random weights, written here with the
`gguf` package in one of the types it quantizes (Q8_0, Q4_0, ...), or a file you pass.
Each server runs in its own process on the same cores; per engine: decode at batch 1
(a 64-token prompt, 256 tokens out, EOS ignored), decode at batch 16, a 512-token prefill,
and the process tree's resident memory once warmed. llama-server's figures are its own
`timings` (prompt and decode rates of the request, no HTTP); ours are the offline engine's
wall time over the same token counts.

    python -m benchmarks.gguf_decode --qtype Q8_0 Q4_0 --out benchmarks/results/gguf/decode.json
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
# Qwen2.5-0.5B's shapes (tied embeddings, q/k/v biases)
QWEN05B = dict(hidden=896, ffn=4864, layers=24, heads=14, kv_heads=2, vocab=151936)
PROMPT_LEN, DECODE_TOKENS, BATCH, PREFILL_LEN, RUNS = 64, 256, 16, 512, 3
CONTEXT = 4096  # tokens of KV both servers hold (llama-server's -c; our pool's blocks)


def write_qwen_like(path: Path, qtype: str, seed: int = 0, shape: dict = QWEN05B) -> Path:
    """A qwen2 GGUF of `shape` with seeded random weights, its matrices in `qtype`; the
    vocabulary is the embedded SmolLM2's, padded with control tokens to `vocab`."""
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
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(shape["layers"])
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
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

    def matrix(name: str, rows: int, cols: int) -> None:
        data = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)

    def vector(name: str, size: int, value: float | None = None) -> None:
        data = np.full(size, value, np.float32) if value is not None else (
            rng.standard_normal(size, dtype=np.float32) * 0.02)
        w.add_tensor(name, data)

    matrix("token_embd.weight", shape["vocab"], h)
    vector("output_norm.weight", h, 1.0)
    for i in range(shape["layers"]):
        vector(f"blk.{i}.attn_norm.weight", h, 1.0)
        vector(f"blk.{i}.ffn_norm.weight", h, 1.0)
        for part, rows in (("q", h), ("k", kv * head_dim), ("v", kv * head_dim)):
            matrix(f"blk.{i}.attn_{part}.weight", rows, h)
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


def run_bucketserve(model: str, quantization: str) -> dict:
    """This file in a child process (`--engine`): its figures as JSON on the last line."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.gguf_decode", "--engine", model, quantization],
        capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def engine_figures(model: str, quantization: str) -> dict:
    from bucketserve.runtime import LLM, SamplingParams

    llm = LLM(model, quantization=quantization, num_kv_blocks=CONTEXT // 16)
    decode = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0, ignore_eos=True)
    llm.generate(prompts(1, PROMPT_LEN, 9), SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)

    def rate(count: int, length: int, params: SamplingParams, tokens: int) -> float:
        """Median rate over RUNS runs, each on new prompts (no prefix-cache hits)."""
        times = []
        for run in range(RUNS):
            batch = prompts(count, length, seed=100 * length + run)
            start = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        return tokens / statistics.median(times)

    # decode rates: the prompt's own prefill is a few % of these runs' time
    one = rate(1, PROMPT_LEN, decode, DECODE_TOKENS)
    batch_params = SamplingParams(max_tokens=DECODE_TOKENS // 4, temperature=0, ignore_eos=True)
    batched = rate(BATCH, PROMPT_LEN, batch_params, BATCH * DECODE_TOKENS // 4)
    prefill = rate(1, PREFILL_LEN, SamplingParams(max_tokens=1), PREFILL_LEN)
    runner = llm.engine.runner
    return {
        "decode_tok_s_batch1": one, f"decode_tok_s_batch{BATCH}": batched,
        "prefill_tok_s": prefill, "rss_mib": tree_rss(os.getpid()) / 2**20,
        "weights": runner.weight_formats, "weight_mib": runner.weight_bytes / 2**20,
    }


def run_llama_server(model: str, threads: int) -> dict | None:
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
        decode = [complete(prompts(1, PROMPT_LEN, 100 * PROMPT_LEN + run)[0], DECODE_TOKENS)
                  for run in range(RUNS)]
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
    parser.add_argument("--gguf", help="a GGUF file to use instead of writing one")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gguf/decode.json"))
    parser.add_argument("--engine", nargs=2, metavar=("MODEL", "QUANTIZATION"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        print(json.dumps(engine_figures(*args.engine)))
        return
    import torch

    from bucketserve.runtime.io.weights import resolve_model

    threads = torch.get_num_threads()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        files = [(Path(args.gguf), "file")] if args.gguf else [
            (write_qwen_like(Path(tmp) / f"qwen05b-{q}.gguf", q), q) for q in args.qtype]
        for path, qtype in files:
            for keep in (True, False):  # converted here, so the measured processes only load
                resolve_model(path, keep_blocks=keep)
            row = {"file": path.name, "qtype": qtype, "size_mib": path.stat().st_size / 2**20}
            for mode in ("auto", "none"):
                row[f"bucketserve_{mode}"] = run_bucketserve(str(path), mode)
            row["llama_server"] = run_llama_server(str(path), threads)
            results.append(row)
            print(json.dumps(row, indent=1), flush=True)
    print(f"\n{'file':24} {'engine':18} {'decode b1':>10} {f'b{BATCH}':>8} {'prefill':>8} "
          f"{'RSS MiB':>8}")
    for row in results:
        for engine in ("bucketserve_auto", "bucketserve_none", "llama_server"):
            r = row[engine]
            if r is None:
                continue
            batched = r.get(f"decode_tok_s_batch{BATCH}", float("nan"))
            print(f"{row['file']:24} {engine:18} {r['decode_tok_s_batch1']:10.1f} "
                  f"{batched:8.1f} {r['prefill_tok_s']:8.0f} {r['rss_mib']:8.0f}")
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
