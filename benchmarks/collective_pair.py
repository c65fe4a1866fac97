"""The collective KV transport between one prefill and one decode endpoint: every batch
delivered intact with two in flight (claimed in reverse order), and the bandwidth of a
prefill batch's KV (SmolLM2's shape by default).

gloo on CPU, NCCL on CUDA. Both endpoints are threads of this process, as in local mode,
so NCCL needs two GPUs (`--devices cuda:0,cuda:1`): it refuses two ranks on one GPU.

    python -m benchmarks.collective_pair --backend gloo --devices cpu,cpu
    python -m benchmarks.collective_pair --backend nccl --devices cuda:0,cuda:1
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from bucketserve.kv_transfer.collective import CollectiveTransport, PairSpec
from bucketserve.kv_transfer.collective_group import RECEIVER_RANK, SENDER_RANK
from bucketserve.kv_transfer.kv_format import KVBlockHandle, KVFormat


def connect(backend: str, prefill: CollectiveTransport, decode: CollectiveTransport) -> Any:
    """Form the pair; returns the store, which must outlive the groups (NCCL forms its
    communicator at the first send through it, and its watchdog polls it)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    sides = [(prefill, PairSpec(decode.worker, "pair/", SENDER_RANK)),
             (decode, PairSpec(prefill.worker, "pair/", RECEIVER_RANK))]
    threads = [threading.Thread(target=t.connect, args=(backend, "127.0.0.1", store.port,
                                                         [spec], 60.0)) for t, spec in sides]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not (prefill.peers() and decode.peers()):
        raise RuntimeError(f"the {backend} pair did not form")
    return store


def batch(fmt: KVFormat, blocks: int, seed: int, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, fmt.dtype)
    return [torch.randn(fmt.chunk_shape(blocks), generator=gen).to(device, dtype)
            for _ in range(fmt.num_layers)]


def send(prefill: CollectiveTransport, handle: KVBlockHandle, layers: list[torch.Tensor]):
    sender = prefill.sender(handle, handle.format)
    for i, chunk in enumerate(layers):
        sender.send_layer(i, chunk)
    return sender.finish()


def receive(decode: CollectiveTransport, handle: KVBlockHandle, payload) -> list[torch.Tensor]:
    got: dict[int, torch.Tensor] = {}
    decode.receive(handle, payload, lambda layer, chunk: got.__setitem__(layer, chunk.clone()))
    return [got[i] for i in range(handle.format.num_layers)]


def transfer(
    prefill: CollectiveTransport,
    decode: CollectiveTransport,
    batches: list[tuple[KVBlockHandle, list[torch.Tensor]]],
    claim_order: list[int],
) -> tuple[dict[int, list[torch.Tensor]], float]:
    """The prefill side sends every batch on its thread while the decode side claims them
    in `claim_order` on another, as the two workers do (NCCL forms the pair's communicator
    at the first send and recv, which must meet). Returns what arrived and the seconds."""
    payloads: dict[int, Any] = {}
    arrived: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []
    posted = threading.Condition()

    def prefill_side() -> None:
        for i, (h, layers) in enumerate(batches):
            payload = send(prefill, h, layers)
            with posted:
                payloads[i] = payload
                posted.notify_all()

    def decode_side() -> None:
        for i in claim_order:
            with posted:
                posted.wait_for(lambda i=i: i in payloads)
            arrived[i] = receive(decode, batches[i][0], payloads[i])
        if decode.device.type == "cuda":
            torch.cuda.synchronize(decode.device)

    def guarded(fn) -> None:
        try:
            fn()
        except BaseException as exc:  # reported on the main thread
            errors.append(exc)
            with posted:
                payloads.update({i: None for i in range(len(batches))})
                posted.notify_all()

    threads = [threading.Thread(target=guarded, args=(f,)) for f in (prefill_side, decode_side)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return arrived, time.perf_counter() - start


def run(args: argparse.Namespace) -> dict:
    src, dst = (torch.device(d) for d in args.devices.split(","))
    fmt = KVFormat(dtype=args.dtype, block_size=16, num_layers=args.layers,
                   num_kv_heads=args.kv_heads, head_dim=args.head_dim)
    prefill = CollectiveTransport("prefill-0", src)
    decode = CollectiveTransport("decode-0", dst)
    store = connect(args.backend, prefill, decode)  # noqa: F841 (kept alive for the groups)

    def handle(lease: str) -> KVBlockHandle:
        return KVBlockHandle("decode-0", lease, (lease,), (tuple(range(args.blocks)),), fmt)

    # two batches in flight, the second claimed first: each must still get its own KV
    two = [(handle(f"in-flight-{i}"), batch(fmt, args.blocks, i, src)) for i in range(2)]
    arrived, _ = transfer(prefill, decode, two, [1, 0])
    intact = all(
        torch.equal(a.cpu(), b.cpu())
        for i, (_, layers) in enumerate(two)
        for a, b in zip(layers, arrived[i], strict=True)
    )
    layers = batch(fmt, args.blocks, 3, src)
    nbytes = sum(t.numel() * t.element_size() for t in layers)
    timed = [(handle(f"timed-{i}"), layers) for i in range(args.iters)]
    _, seconds = transfer(prefill, decode, timed, list(range(args.iters)))
    per_batch = seconds / args.iters
    return {"backend": args.backend, "devices": args.devices, "intact_two_in_flight": intact,
            "batch_bytes": nbytes, "blocks": args.blocks, "s_per_batch": per_batch,
            "gb_s": nbytes / per_batch / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl", "hccl"))
    parser.add_argument("--devices", default="cpu,cpu", help="prefill,decode")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--blocks", type=int, default=24, help="a 384-token prompt's blocks")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = run(args)
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in result.items()))
    if args.out:
        from benchmarks.offline_throughput import write_json

        write_json(result, args.out)
    if not result["intact_two_in_flight"]:
        raise SystemExit("KV delivered wrong with two batches in flight")


if __name__ == "__main__":
    main()
