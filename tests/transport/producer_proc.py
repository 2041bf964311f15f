"""A producer in its own process: serves a TensorStore on 127.0.0.1 and exports on request.

stdin lines:  export <transport> <dtype> <d0,d1,...> <seed> <ttl_s> <device>  -> HANDLE <hex of TensorHandle>
              stats                                                -> STATS <num_open_leases> <open_bytes>
              cuda_memory                                          -> CUDA_MEMORY <bytes allocated by torch>
              quit
Handles cross as protobuf bytes (hex), never pickled.
"""
from __future__ import annotations

import sys

from epd.transport import TensorStore, serve_tensor_store
from tests.transport.helpers import make_tensor


def main() -> None:
    store = TensorStore()
    store.start_sweeper(0.25)  # as a worker does: exports nobody imports end with their lease
    server = serve_tensor_store(store)
    print("ADDRESS", store.address, flush=True)
    try:
        for line in sys.stdin:
            command, *args = line.split()
            if command == "export":
                transport, dtype, shape, seed, ttl_s, device = args
                dims = tuple(int(d) for d in shape.split(",") if d)
                tensor = make_tensor(dtype, dims, int(seed)).to(device)
                handle = store.export(tensor, transport=transport, ttl_s=float(ttl_s))
                print("HANDLE", handle.SerializeToString().hex(), flush=True)
            elif command == "stats":
                print("STATS", store.num_open_leases, store.open_bytes, flush=True)
            elif command == "cuda_memory":  # what the producer's GPU still holds (exports in limbo)
                import torch
                allocated = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
                print("CUDA_MEMORY", allocated, flush=True)
            elif command == "quit":
                break
    finally:
        server.stop(0)
        store.close()


if __name__ == "__main__":
    main()
