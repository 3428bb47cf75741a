"""KV pages between two processes: JAX's transfer server (``--kv-transfer jax``) against the gRPC byte stream
(``--kv-transfer grpc``), the two ways a prefill process hands pages to a decode process.

    python scripts/bench_kv_transfer.py [--sizes-mib 1,16,64] [--repeats 5]

The script starts a second process that plays the prefill side: for each request it gathers nothing, it offers
a ready array of the asked size through ``jaxserve.disagg.kv_transfer.JaxTransfer`` and also streams the same array's
bytes over a gRPC unary-stream call in ``CHUNK_BYTES`` chunks (as ``PrefillServer`` does, the device-to-host
copy included). This process plays the decode side: it pulls the array onto its device, or reads the stream,
rebuilds the array with ``np.frombuffer`` and ``jax.device_put`` s it. The two ways alternate, ``--repeats``
times per size, and the median seconds and GB/s of each are printed (and the ratio).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVE = "/bench.KV/Get"
sys.path.insert(0, str(ROOT))

from scripts import bench_results  # noqa: E402


def serve(port_file: str) -> None:
    """The prefill side: a gRPC service that offers (JAX transfer) and streams (bytes) a fresh array per call."""
    import concurrent.futures

    import grpc
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.disagg.kv_transfer import JaxTransfer
    from jaxserve.disagg.wire import CHUNK_BYTES

    transfer = JaxTransfer("127.0.0.1")
    arrays: dict[int, jax.Array] = {}

    def array(n: int) -> jax.Array:
        if n not in arrays:
            arrays[n] = jax.block_until_ready(jnp.arange(n // 4, dtype=jnp.float32))
        return arrays[n]

    def get(request: bytes, context):
        msg = json.loads(request)
        a = array(int(msg["bytes"]))
        if msg["way"] == "jax":
            yield json.dumps(transfer.offer([a + 0])).encode()  # a fresh buffer, as a gather makes one
            return
        host = np.asarray(a + 0).tobytes()  # the device-to-host copy the byte stream needs
        yield b"{}"
        for i in range(0, len(host), CHUNK_BYTES):
            yield host[i:i + CHUNK_BYTES]

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(4),
                         options=[("grpc.max_send_message_length", 4 * CHUNK_BYTES)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.KV", {
        "Get": grpc.unary_stream_rpc_method_handler(get)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(port_file).write_text(str(port))
    server.wait_for_termination()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", default="1,16,64")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--serve", help=argparse.SUPPRESS)
    bench_results.add_arguments(p)
    args = p.parse_args()
    figures = bench_results.Results(args)
    if args.serve:
        serve(args.serve)
        return 0

    import grpc
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.disagg.kv_transfer import JaxTransfer
    from jaxserve.disagg.wire import CHUNK_BYTES

    port_file = Path("/tmp") / f"bench_kv_transfer.{time.time_ns()}.port"
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file)], cwd=ROOT)
    try:
        while not port_file.exists() or not port_file.read_text():
            if proc.poll() is not None:
                raise SystemExit("the serving process failed")
            time.sleep(0.1)
        url = f"127.0.0.1:{port_file.read_text()}"
        channel = grpc.insecure_channel(url, options=[("grpc.max_receive_message_length", 4 * CHUNK_BYTES)])
        call = channel.unary_stream(SERVE)
        transfer = JaxTransfer("127.0.0.1")
        device = jax.devices()[0]

        def once(way: str, nbytes: int) -> float:
            t0 = time.perf_counter()
            it = call(json.dumps({"way": way, "bytes": nbytes}).encode())
            head = json.loads(next(it))
            parts = [{"shape": [nbytes // 4], "dtype": "float32"}]
            if way == "jax":
                a = transfer.pull(head, parts, "127.0.0.1")[0]
                list(it)
            else:
                data = b"".join(it)
                a = jax.device_put(np.frombuffer(data, np.float32), device)
            jax.block_until_ready(a)
            seconds = time.perf_counter() - t0
            assert float(a[-1]) == nbytes // 4 - 1
            return seconds

        print(f"| KV bytes | JAX transfer server: s (GB/s) | gRPC byte stream: s (GB/s) | gRPC / JAX |")
        print("| --- | --- | --- | --- |")
        for mib in (float(x) for x in args.sizes_mib.split(",")):
            nbytes = int(mib * 2**20) // 4 * 4
            once("jax", nbytes), once("grpc", nbytes)  # first calls: connections, compiles
            times = {"jax": [], "grpc": []}
            for _ in range(args.repeats):
                for way in ("jax", "grpc"):
                    times[way].append(once(way, nbytes))
            j, g = statistics.median(times["jax"]), statistics.median(times["grpc"])
            print(f"| {mib:g} MiB | {j:.4f} ({nbytes / j / 1e9:.2f}) | {g:.4f} ({nbytes / g / 1e9:.2f}) | "
                  f"{g / j:.2f}x |", flush=True)
            figures.add(f"{mib:g} MiB: JAX transfer server", j * 1e3, "ms")
            figures.add(f"{mib:g} MiB: gRPC byte stream", g * 1e3, "ms")
            figures.add(f"{mib:g} MiB: gRPC byte stream / JAX transfer server", g / j, "x")
        figures.save()
    finally:
        proc.kill()
        proc.wait()
        port_file.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
