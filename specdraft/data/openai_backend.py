"""`specdraft regenerate --backend openai`: answers from OpenAI-compatible servers (vLLM, SGLang,
`transformers serve`), over the standard library's HTTP client (no client package needed).

Requests go to the servers round robin, at most `concurrency` in flight; a failed request is
retried with exponential backoff. The answer's token ids are asked for (`return_token_ids`, vLLM);
a server that refuses the field (transformers serve answers 422) is asked again without it, and its
answers carry no ids (training then tokenises their text).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from specdraft.data.generation import Answer, Request, Sampling, prompt_ids
from specdraft.errors import SpecdraftError


@dataclass
class OpenAIBackend:
    servers: List[str]  # base URLs, e.g. http://localhost:8000 (with or without /v1)
    tokenizer: object  # the target's: prompt lengths for max_length
    sampling: Sampling
    concurrency: int = 8
    retries: int = 4
    backoff_s: float = 0.5
    timeout_s: float = 600.0
    model: Optional[str] = None  # the served model's name; None: the server's only model
    name: str = field(default="openai", init=False)

    def __post_init__(self):
        if not self.servers:
            raise SpecdraftError("the openai backend needs at least one server URL (--servers)")
        self.servers = [_chat_url(s) for s in self.servers]
        self._next = itertools.cycle(range(len(self.servers)))
        self._lock = threading.Lock()
        self._no_ids = set()  # servers that refuse return_token_ids

    def generate(self, requests: List[Request], progress: Callable[[int], None] = lambda n: None) -> List[Answer]:
        def one(request: Request) -> Answer:
            answer = self._answer(request)
            progress(answer.tokens)
            return answer

        with ThreadPoolExecutor(max_workers=max(1, self.concurrency)) as pool:
            return list(pool.map(one, requests))

    def _answer(self, request: Request) -> Answer:
        _, budget, error = prompt_ids(self.tokenizer, request, self.sampling)
        if error:
            return Answer(error=error)
        body = {"messages": [{"role": m["role"], "content": m["content"]} for m in request.messages],
                "max_tokens": budget, "temperature": self.sampling.temperature, "seed": request.seed}
        if self.sampling.top_p < 1:
            body["top_p"] = self.sampling.top_p
        if self.sampling.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.sampling.thinking}
        if self.model:
            body["model"] = self.model
        last = "no attempt"
        for attempt in range(self.retries + 1):
            with self._lock:
                url = self.servers[next(self._next)]
            ask_ids = url not in self._no_ids
            try:
                reply = _post(url, {**body, "return_token_ids": True} if ask_ids else body, self.timeout_s)
                return _parse(reply)
            except urllib.error.HTTPError as err:
                detail = err.read().decode("utf-8", "replace")[:300]
                if ask_ids and err.code in (400, 422) and "return_token_ids" in detail:
                    self._no_ids.add(url)  # not an error: this server cannot return ids
                    continue
                last = f"HTTP {err.code} from {url}: {detail}"
            except (urllib.error.URLError, OSError, ValueError, KeyError) as err:
                last = f"{url}: {err}"
            time.sleep(self.backoff_s * 2 ** attempt)
        return Answer(error=f"server error after {self.retries + 1} attempts: {last}")


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


def _parse(reply: dict) -> Answer:
    choice = reply["choices"][0]
    message = choice["message"]
    text = message.get("content") or ""
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:  # the server split the think block off: put it back as the target wrote it
        text = f"<think>\n{reasoning.strip()}\n</think>\n\n{text.lstrip()}"
    ids = choice.get("token_ids")
    tokens = len(ids) if ids else int((reply.get("usage") or {}).get("completion_tokens", 0))
    finish = "length" if choice.get("finish_reason") == "length" else "stop"
    return Answer(text=text, token_ids=[int(t) for t in ids] if ids else None, tokens=tokens, finish=finish)
