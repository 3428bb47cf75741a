"""A scripted stand-in for ``Engine`` (no model, no compiles): one token per request per step, a tokenizer that
maps characters to ids, and a page ledger, for tests whose point is the server around the engine."""

from __future__ import annotations

import dataclasses
import threading
import time

from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.text.request_checks import RequestChecks


class _Tokenizer:
    chat_template = "{{ messages }}"

    def __init__(self, engine):
        self.engine = engine
        self.encode_delay = 0.0  # seconds each encode takes (asleep: the GIL is free, as in a real tokenizer)
        self.threads: list[threading.Thread] = []
        self.steps_during_encode: list[int] = []  # engine steps taken while each encode ran

    def __deepcopy__(self, memo):
        return self

    def get_vocab(self):
        return {chr(65 + i): i for i in range(26)}

    def encode(self, text, add_special_tokens=True):
        self.threads.append(threading.current_thread())
        steps = self.engine.steps
        time.sleep(self.encode_delay)
        self.steps_during_encode.append(self.engine.steps - steps)
        return [ord(c) % 100 for c in text]

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)

    def convert_ids_to_tokens(self, ids):  # a transformers tokenizer's: one id or a list
        return f"<{ids}>" if isinstance(ids, int) else [f"<{i}>" for i in ids]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **template_options):
        self.threads.append(threading.current_thread())
        return [len(m["content"]) for m in messages]


class _LenientChecks(RequestChecks):
    """The intake checks, except that max_tokens may run past max_model_len (the fake keeps no KV cache)."""

    def params(self, params, prompt_len):
        if params.max_tokens is None or prompt_len + params.max_tokens <= self.max_model_len:
            super().params(params, prompt_len)


@dataclasses.dataclass
class _Seq:
    request_id: str


@dataclasses.dataclass
class _Req:
    rid: str
    ids: list[int]
    params: SamplingParams
    tokens: list[int] = dataclasses.field(default_factory=list)


class _Weights:
    """The executor's weight reader for ``AsyncEngine.update_weights``: each read waits while ``hold`` is clear
    (a test keeps an update running), and the folders read are recorded."""

    def __init__(self):
        self.hold = threading.Event()
        self.hold.set()
        self.reads: list[str] = []

    def read(self, path):
        self.reads.append(path)
        self.hold.wait(30)
        return {"path": path}


class FakeEngine:
    """One token per request per step; ``fail_steps`` makes that many steps raise first. Adapters are a registry
    (``add_lora`` reads nothing), weight updates go through ``executor.weights`` (``_Weights``)."""

    def __init__(self, config):
        self.max_num_seqs = config.max_num_seqs
        self.tokenizer = _Tokenizer(self)
        self.model_config = type("Cfg", (), {"vocab_size": 100, "architecture": "Fake", "family": "fake"})()
        self.max_model_len = 64
        self.requests: dict[str, _Req] = {}
        self.steps = 0
        self.fail_steps = 0
        self.paused = False  # while True, steps produce nothing: live requests neither advance nor finish
        self.step_thread = None
        self.scheduler = type("Sched", (), {})()
        self.scheduler.running = []
        self.pages_used = 0
        self.step_delay = 0.0  # seconds each step takes (asleep, as a step waiting on its device frees the GIL)
        self.check_lengths = False  # True: refuse prompt + max_tokens beyond max_model_len, as the engine does
        self.grammars = None  # no structured-output grammars to compile ahead
        self.executor = type("Executor", (), {})()
        self.executor.weights = _Weights()
        self.loras: dict = {}
        self.weights_from = None  # the folder of the last weights swapped in

    def add_lora(self, lora_request):
        self.loras[lora_request.lora_name] = lora_request
        return lora_request.lora_name

    def remove_lora(self, name):
        if self.loras.pop(name, None) is None:
            raise ValueError(f"lora_name: no adapter named {name!r} is loaded")

    def update_weights(self, state):
        self.weights_from = state["path"]

    @property
    def checks(self):
        """What the servers check at intake; max_tokens against max_model_len only with ``check_lengths``."""
        return (RequestChecks if self.check_lengths else _LenientChecks)(self.max_model_len, 100)

    def tokenize(self, prompt):
        ids = [ord(c) % 100 for c in prompt] if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if any(not 0 <= t < 100 for t in ids):
            raise ValueError("prompt token id is outside the vocabulary [0, 100)")
        return prompt if isinstance(prompt, str) else None, ids

    def add_request(self, rid, ids, params, arrival_time=None, checked=False):
        self.tokenize(ids)  # the id range check, as the engine's add_request does
        if self.check_lengths and params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"SamplingParams.max_tokens={params.max_tokens} with a {len(ids)}-token prompt exceeds "
                             f"max_model_len={self.max_model_len}")
        self.requests[rid] = _Req(rid, ids, params)
        self.pages_used += self._pages(self.requests[rid])
        self.scheduler.running = [_Seq(r) for r in self.requests]

    def _pages(self, req):  # a page per 4 tokens of every sequence, as a ledger leaks would show in
        return -(-(len(req.ids) + self._max_tokens(req)) // 4) * req.params.n

    def _max_tokens(self, req):
        return req.params.max_tokens or self.max_model_len - len(req.ids)

    def has_unfinished(self):
        return bool(self.requests)

    def _out(self, req, reason, new, error=None):
        text = "".join(f"<{t}>" for t in req.tokens)
        c = CompletionOutput(0, text, list(req.tokens), reason, None, None, "".join(f"<{t}>" for t in new), new)
        m = RequestMetrics(0.0, 0.0, 0.0, 1.0 if reason else None)
        return RequestOutput(req.rid, None, req.ids, [c], reason is not None, m, error)

    def abort_request(self, rid, reason="abort", *, error=None):
        req = self.requests.pop(rid, None)
        if req is not None:
            self.pages_used -= self._pages(req)
        self.scheduler.running = [_Seq(r) for r in self.requests]
        return None if req is None else self._out(req, reason, [], error)

    def step(self):
        self.step_thread = threading.current_thread()
        self.steps += 1
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("injected step failure")
        if self.paused:
            time.sleep(0.001)
            return []
        if self.step_delay:
            time.sleep(self.step_delay)
        outs = []
        for req in list(self.requests.values()):
            req.tokens.append(len(req.tokens) + 1)
            done = len(req.tokens) >= self._max_tokens(req)
            if done:
                del self.requests[req.rid]
                self.pages_used -= self._pages(req)
            outs.append(self._out(req, "length" if done else None, [req.tokens[-1]]))
        self.scheduler.running = [_Seq(r) for r in self.requests]
        return outs

    warmup_summary = None

    def close(self):
        pass

    def describe(self):
        return {"model_path": "", "architecture": "Fake", "family": "fake", "vocab_size": 100, "max_model_len": 64,
                "num_layers": 0, "hidden_size": 0, "eos_token_ids": [], "page_size": 0, "num_pages": 0,
                "has_chat_template": False, "dtype": "float32"}

    def stats(self):
        running = min(len(self.requests), self.max_num_seqs)
        return {"num_running": running, "num_waiting": len(self.requests) - running, "steps": self.steps,
                "pages_used": self.pages_used, "pages_total": 1 << 20}
