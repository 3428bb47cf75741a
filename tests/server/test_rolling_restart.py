"""A rolling restart under load loses no request: a router process (``--role router``) in front of two decode
processes (the real server around the stand-in engine, tests/fake_decode_server.py), each restarted in turn with
SIGTERM while streaming clients keep sending; the router retries what a draining or starting process refuses
before its first byte, on the live one (jaxserve/server/router.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import grpc
import httpx

from jaxserve.server.protos import jaxserve_pb2 as pb
from jaxserve.server.protos import jaxserve_pb2_grpc as pb_grpc

from server_harness import REPO, free_port, parse_metrics, server_env

TOKENS = 8
STEP_S = 0.02  # each fake step sleeps this long: a request streams for about TOKENS * STEP_S


class Proc:
    def __init__(self, args: list[str], log):
        self.proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=server_env(), stdout=subprocess.PIPE,
                                     stderr=log, stdin=subprocess.PIPE, text=True)

    def go(self) -> None:
        """A process started with --after-stdin-line: start serving now."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def wait_ready(self, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if re.search(r"jaxserve ready: ", line):
                return line
        raise RuntimeError("the process did not become ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def decode(ports: tuple[int, int], log, *, later: bool = False) -> Proc:
    return Proc(["tests/fake_decode_server.py", str(STEP_S), *(["--after-stdin-line"] if later else []),
                 "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--shutdown-grace-period", "10",
                 "--log-level", "warning"], log)


def test_rolling_restart_of_every_decode_process_under_load_loses_no_request(tmp_path):
    log = open(tmp_path / "processes.log", "w")
    ports = [(free_port(), free_port()) for _ in range(2)]
    decodes = [decode(p, log) for p in ports]
    # The processes that replace them, started now so that their imports overlap the others' (each waits for
    # its "go" before it binds the ports)
    successors = [decode(p, log, later=True) for p in ports]
    urls = ",".join(f"127.0.0.1:{h}:{g}" for h, g in ports)
    router = Proc(["-m", "jaxserve.serve", "--role", "router", "--decode-url", urls, "--http-port", "0",
                   "--grpc-port", "0", "--log-level", "warning"], log)
    stop = threading.Event()
    results: list[str] = []  # "ok" or what went wrong, one per request
    try:
        for d in decodes:
            d.wait_ready()
        m = re.search(r"http=(\S+) grpc=(\S+)", router.wait_ready())
        http, grpc_target = m.group(1), m.group(2)

        def metrics() -> dict:
            return parse_metrics(httpx.get(http + "/metrics", timeout=10).text)

        def wait_up(n: int) -> None:
            deadline = time.monotonic() + 30
            while metrics()["jaxserve_router_servers_live"] != n:
                assert time.monotonic() < deadline, metrics()
                time.sleep(0.02)

        wait_up(2)
        for base in [http] + [f"http://127.0.0.1:{h}" for h, _ in ports]:  # liveness, whatever the readiness
            assert httpx.get(base + "/live", timeout=10).json() == {"status": "live"}

        def http_client():
            with httpx.Client(timeout=30) as c:
                while not stop.is_set():
                    try:
                        with c.stream("POST", http + "/v1/completions", json={
                                "model": "jaxserve-demo", "prompt": "ABCD", "max_tokens": TOKENS,
                                "stream": True}) as r:
                            if r.status_code != 200:
                                results.append(f"http {r.status_code}: {r.read()[:200]!r}")
                                continue
                            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
                        texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]
                                 if json.loads(e).get("choices")]
                        ok = events[-1] == "[DONE]" and "".join(texts).count("<") == TOKENS
                        results.append("ok" if ok else f"http stream {events[-3:]}")
                    except Exception as e:  # noqa: BLE001 - every failure is counted
                        results.append(f"http {type(e).__name__}: {e}")

        def grpc_client():
            with grpc.insecure_channel(grpc_target) as ch:
                stub = pb_grpc.JaxServeStub(ch)
                while not stop.is_set():
                    try:
                        msgs = list(stub.Generate(pb.GenerateRequest(
                            token_ids=pb.TokenIds(ids=[1, 2, 3]),
                            sampling_params=pb.SamplingParams(max_tokens=TOKENS)), timeout=30))
                        n = sum(len(m.token_ids) for m in msgs)
                        results.append("ok" if n == TOKENS else f"grpc {n} tokens")
                    except grpc.RpcError as e:
                        results.append(f"grpc {e.code().name}: {e.details()}")

        clients = [threading.Thread(target=http_client) for _ in range(3)] + [threading.Thread(target=grpc_client)]
        for t in clients:
            t.start()
        time.sleep(0.5)
        for i in range(2):  # restart each in turn, the next once the router has the new one in rotation
            decodes[i].proc.terminate()  # SIGTERM: drain, refuse new requests with 503, exit
            assert decodes[i].proc.wait(30) == 0
            decodes[i] = successors[i]
            decodes[i].go()
            decodes[i].wait_ready()
            wait_up(2)
            time.sleep(0.3)
        stop.set()
        for t in clients:
            t.join(60)
        failures = [r for r in results if r != "ok"]
        assert not failures, failures[:5]
        assert len(results) > 40
        retried = sum(v for k, v in metrics().items() if k.startswith("jaxserve_router_retries_total"))
        failovers = sum(v for k, v in metrics().items() if k.startswith("jaxserve_router_failovers_total"))
        assert retried + failovers > 0
    finally:
        stop.set()
        router.stop()
        for d in decodes + successors:
            d.stop()
        log.close()


def test_sigterm_to_the_router_lets_in_flight_streams_finish_within_its_grace_period(tmp_path):
    """A router told to stop drains for its --shutdown-grace-period: a stream taking 8 s, begun before SIGTERM,
    ends with all its tokens and [DONE], and the router exits 0 after it (uvicorn's own 5-second graceful timeout
    used to cut every open request about 5 s after SIGTERM, whatever the flag said)."""
    import signal

    log = open(tmp_path / "processes.log", "w")
    ports = (free_port(), free_port())
    backend = Proc(["tests/fake_decode_server.py", "1.0", "--http-port", str(ports[0]), "--grpc-port", str(ports[1]),
                    "--log-level", "warning"], log)
    router = Proc(["-m", "jaxserve.serve", "--role", "router", "--decode-url", f"127.0.0.1:{ports[0]}:{ports[1]}",
                   "--http-port", "0", "--grpc-port", "0", "--shutdown-grace-period", "30", "--log-level", "info"],
                  log)
    try:
        backend.wait_ready()
        http = re.search(r"http=(\S+)", router.wait_ready()).group(1)
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", http + "/v1/completions", json={"model": "jaxserve-demo", "prompt": "ABCD",
                                                                   "max_tokens": TOKENS, "stream": True}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                events = [next(line for line in lines if line.startswith("data: "))[6:]]  # streaming has begun
                stopped = time.monotonic()
                router.proc.send_signal(signal.SIGTERM)
                events += [line[6:] for line in lines if line.startswith("data: ")]
        took = time.monotonic() - stopped
        texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e).get("choices")]
        assert events[-1] == "[DONE]" and "".join(texts).count("<") == TOKENS, events[-3:]
        assert took > 5.5, took  # it outlived uvicorn's default
        assert router.proc.wait(timeout=30) == 0
        text = (tmp_path / "processes.log").read_text()  # its start and stop lines under its own name
        assert "INFO jaxserve.server.router: routing: HTTP on 127.0.0.1:" in text, text[-3000:]
        assert "INFO jaxserve.server.router: stopped" in text and "uvicorn.error" not in text, text[-3000:]
    finally:
        router.stop()
        backend.stop()
