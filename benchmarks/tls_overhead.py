"""What mutual TLS costs the data plane: a tensor handed over inline (its bytes streamed through a
TensorStore gRPC server on 127.0.0.1) over a plain channel and over a mutual-TLS one, measured in
one run, rounds interleaved.

    python benchmarks/tls_overhead.py [--max-mib 64]

Shared-memory and CUDA IPC handoffs send only a small handle over the channel, so they pay the TLS
cost once per call, not per byte; this is the worst case: every byte encrypted and decrypted.
Certificates are made for the run (``cryptography``; the test extra). The last line is the
headline: ``tls/plain bandwidth ratio at <size>: <ratio>``.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from transfer import fmt, handoff, interleaved_medians_s, release_all  # noqa: E402  (the script next door)

from epd.config import TlsConfig  # noqa: E402
from epd.transport import TensorStore, close_all, serve_tensor_store  # noqa: E402
from epd.wire.rpc import open_channel  # noqa: E402
from epd.wire.tls import MutualTls  # noqa: E402
from tests.security.certs import issue, make_pki  # noqa: E402

MiB = 1024 * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-mib", type=int, default=64, help="largest tensor, MiB (sizes go up by 4x from 1 MiB)")
    args = parser.parse_args()
    sizes = [MiB * 4 ** i for i in range(8) if MiB * 4 ** i <= args.max_mib * MiB]
    with tempfile.TemporaryDirectory() as directory:
        pki = Path(directory)
        identity = issue(pki, make_pki(pki, "bench"), "worker")
        tls = MutualTls.from_config(TlsConfig(tls_cert=str(identity.cert), tls_key=str(identity.key),
                                              tls_ca=str(identity.ca)))
        plain_store, tls_store = TensorStore(), TensorStore()
        servers = [serve_tensor_store(plain_store), serve_tensor_store(tls_store, tls=tls)]
        tls_channel = open_channel(tls_store.address, tls)
        print(f"torch {torch.__version__}; inline handoff (export + stream + first read); medians")
        print(f"{'size':>9} | {'plain ms':>9} {'GB/s':>7} | {'tls ms':>9} {'GB/s':>7} | {'tls/plain':>9}")
        last = None
        try:
            for nbytes in sizes:
                src = torch.rand(nbytes // 4)
                held: list = []
                reps = max(3, 48 // (nbytes // MiB))
                methods = {"plain": (handoff(plain_store, src, "inline", held), release_all(held), reps),
                           "tls": (handoff(tls_store, src, "inline", held, channel_factory=lambda _: tls_channel),
                                   release_all(held), reps)}
                medians_s = interleaved_medians_s(methods)
                plain_s, tls_s = medians_s["plain"], medians_s["tls"]
                print(f"{nbytes // MiB:>5} MiB | {fmt(plain_s, nbytes)} | {fmt(tls_s, nbytes)} | {plain_s / tls_s:9.3f}")
                last = (nbytes, plain_s / tls_s)
        finally:
            tls_channel.close()
            for server in servers:
                server.stop(0)
            plain_store.close()
            tls_store.close()
            close_all()
    if last is not None:
        print(f"tls/plain bandwidth ratio at {last[0] // MiB} MiB: {last[1]:.3f}")


if __name__ == "__main__":
    main()
