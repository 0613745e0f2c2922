"""`specdraft regenerate --backend openai`: answers from OpenAI-compatible servers (vLLM, SGLang,
`transformers serve`), over the standard library's HTTP client (no client package needed).

Every server is checked (GET /v1/models, else /health) before the first row. Requests go to the servers round
robin, at most `concurrency` in flight. Every sampling parameter is sent, so no server fills one in
from the model's generation_config.json (vLLM and SGLang do: Qwen3's top_k 20, Qwen2.5's
repetition_penalty 1.05): temperature, top_p, top_k -1 and min_p 0 (off), repetition_penalty 1,
max_tokens, the row's seed. A server that refuses one of these fields (HTTP 400/422 naming it;
`transformers serve` refuses top_k, min_p, repetition_penalty) is asked again without it where
that cannot change the answer (top_k and min_p when greedy; the seed; the token ids), else the row
fails naming the field. The answer's token ids are asked for (`return_token_ids`, vLLM); answers
from a server that refuses the field carry none (training then tokenises their text).

A request that fails in transport (refused or reset connection, a reply cut short, a reply without
choices) or with HTTP 408, 429 or 5xx is retried with exponential backoff and full jitter (servers
that failed together are not asked again together); another 4xx (a prompt over the server's
context) is not retried. A row whose retries run out is an error row, never the end of the run.
"""

from __future__ import annotations

import http.client
import itertools
import json
import random
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set

from specdraft.regenerate.backends import Answer, Request, Sampling, prompt_ids
from specdraft.errors import SpecdraftError

RETRIED_4XX = (408, 429)  # request timeout, too many requests: the server may take it later
TRANSPORT_ERRORS = (urllib.error.URLError, OSError, http.client.HTTPException)  # IncompleteRead, resets
# fields a server may refuse -> whether the request may go on without it (a function of the sampling)
OPTIONAL_FIELDS: Dict[str, Callable[[Sampling], bool]] = {
    "return_token_ids": lambda s: True,  # the answer's text is tokenised instead
    "seed": lambda s: True,  # reproducibility only
    "top_k": lambda s: s.temperature == 0,  # greedy ignores it
    "min_p": lambda s: s.temperature == 0,
    "repetition_penalty": lambda s: True,  # 1 is every server's own default
}


@dataclass
class OpenAIBackend:
    servers: List[str]  # base URLs, e.g. http://localhost:8000 (with or without /v1)
    tokenizer: object  # the target's: prompt lengths for max_length
    sampling: Sampling
    concurrency: int = 8
    retries: int = 4
    backoff_s: float = 0.5
    timeout_s: float = 600.0  # per request (regenerate's `timeout`)
    model: Optional[str] = None  # the served model's name; None: the server's only model
    name: str = field(default="openai", init=False)

    def __post_init__(self):
        if not self.servers:
            raise SpecdraftError("the openai backend needs at least one server URL (--servers)")
        self.given = list(self.servers)
        self.servers = [_chat_url(s) for s in self.servers]
        self._next = itertools.cycle(range(len(self.servers)))
        self._lock = threading.Lock()
        self._random = random.Random()  # backoff jitter: seeded from the OS, differs per process
        self.refused: Dict[str, Set[str]] = {}  # server -> the optional fields it refuses

    def check(self) -> None:
        """Every server answers, before any row is asked: GET /v1/models gives a model list, or (a
        server whose listing fails: `transformers serve` scans the Hugging Face cache and answers 500
        without one) GET /health answers 200. One line naming the first that does not."""
        for given, url in zip(self.given, self.servers):
            models = url[: -len("/chat/completions")] + "/models"
            try:
                listed = _get(models, min(self.timeout_s, 30.0))
                if isinstance(listed, dict) and isinstance(listed.get("data"), list):
                    continue
                reason = "its reply is not a model list"
            except urllib.error.HTTPError as err:
                reason = f"HTTP {err.code}"
            except (*TRANSPORT_ERRORS, ValueError) as err:
                raise SpecdraftError(
                    f"--servers {given}: no server answers GET {models} ({getattr(err, 'reason', None) or err})"
                ) from None
            try:
                _get(models[: -len("/v1/models")] + "/health", min(self.timeout_s, 30.0), parse=False)
            except (*TRANSPORT_ERRORS, ValueError):
                raise SpecdraftError(
                    f"--servers {given}: not an OpenAI-compatible server: GET {models} "
                    f"answered {reason}, and GET /health did not answer 200"
                ) from None

    def refused_fields(self) -> Dict[str, List[str]]:
        return {url: sorted(fields) for url, fields in self.refused.items() if fields}

    def generate(self, requests: List[Request], progress: Callable[[int], None] = lambda n: None) -> List[Answer]:
        def one(request: Request) -> Answer:
            answer = self._answer(request)
            progress(answer.tokens)
            return answer

        pool = ThreadPoolExecutor(max_workers=max(1, self.concurrency))
        try:
            return list(pool.map(one, requests))
        finally:  # stopped (Ctrl-C): the queued requests are dropped, not sent (those in flight end)
            pool.shutdown(wait=False, cancel_futures=True)

    def body(self, request: Request, budget: int) -> dict:
        """Everything that decides the answer, explicitly."""
        s = self.sampling
        body = {
            "messages": [{"role": m["role"], "content": m["content"]} for m in request.messages],
            "max_tokens": budget,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "seed": request.seed,
            "return_token_ids": True,
        }
        if s.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": s.thinking}
        if self.model:
            body["model"] = self.model
        return body

    def _answer(self, request: Request) -> Answer:
        _, budget, error = prompt_ids(self.tokenizer, request, self.sampling)
        if error:
            return Answer(error=error)
        body = self.body(request, budget)
        last, attempt = "no attempt", 0
        while attempt <= self.retries:
            with self._lock:
                url = self.servers[next(self._next)]
            refused = self.refused.get(url, set())
            try:
                return _parse(_post(url, {k: v for k, v in body.items() if k not in refused}, self.timeout_s))
            except urllib.error.HTTPError as err:
                detail = _error_detail(err)
                named = [f for f in OPTIONAL_FIELDS if f in detail and f in body and f not in refused]
                if err.code in (400, 422) and named:
                    cannot = [f for f in named if not OPTIONAL_FIELDS[f](self.sampling)]
                    if cannot:
                        return Answer(
                            error=f"{url} refuses {', '.join(cannot)}: it would sample with its own "
                            f"default; use a server that takes it (vLLM, SGLang) or temperature 0",
                            server_error=True,
                        )
                    with self._lock:
                        self.refused.setdefault(url, set()).update(named)
                    continue  # not an attempt: the same request without the fields it refuses
                last = f"HTTP {err.code} from {url}: {detail}"
                if 400 <= err.code < 500 and err.code not in RETRIED_4XX:
                    return Answer(error=last, server_error=True)  # the same request would be refused again
            except (*TRANSPORT_ERRORS, ValueError) as err:
                last = f"{url}: {type(err).__name__}: {err}"
            if attempt < self.retries:
                time.sleep(self._random.uniform(0, self.backoff_s * 2**attempt))
            attempt += 1
        return Answer(error=f"server error after {self.retries + 1} attempts: {last}", server_error=True)


def _chat_url(base: str) -> str:
    base = base.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


def _post(url: str, body: dict, timeout: float) -> dict:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _get(url: str, timeout: float, parse: bool = True):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        data = response.read()
    return json.loads(data) if parse else data


def _error_detail(err: urllib.error.HTTPError) -> str:
    try:
        return err.read().decode("utf-8", "replace")[:300]
    except (*TRANSPORT_ERRORS, ValueError):
        return str(err.reason)


def _parse(reply: dict) -> Answer:
    """The reply's first choice; ValueError when the reply has none (a transport error: retried)."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not choices or not isinstance(choices[0], dict) or not isinstance(choices[0].get("message"), dict):
        raise ValueError("the reply holds no choice with a message")
    choice = choices[0]
    message = choice["message"]
    text = message.get("content") or ""
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:  # the server split the think block off: put it back as the target wrote it
        text = f"<think>\n{reasoning.strip()}\n</think>\n\n{text.lstrip()}"
    ids = choice.get("token_ids")
    tokens = len(ids) if ids else int((reply.get("usage") or {}).get("completion_tokens", 0))
    finish = "length" if choice.get("finish_reason") == "length" else "stop"
    return Answer(text=text, token_ids=[int(t) for t in ids] if ids else None, tokens=tokens, finish=finish)
