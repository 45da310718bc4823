"""SIGTERM / Ctrl-C: the server stops accepting, lets the open stream finish, drains the engine
and the process exits 0 without a traceback (a real process, tiny models, greedy only)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.procs import free_port

SCRIPT = r"""
import sys
from dspark_jax import drafters
from dspark_jax.server.app import create_app
from dspark_jax.server.run import run_server
from dspark_jax.engine.engine import ServingEngine
from dspark_jax.models import init_params
from dspark_jax.testing import tiny_drafter_config, tiny_target_config
from dspark_jax.testing import tiny_tokenizer

tok = tiny_tokenizer(sys.argv[2])
tcfg = tiny_target_config(vocab_size=512)
tp = init_params(tcfg, 0)
dcfg = tiny_drafter_config("dspark", tcfg, mask_token_id=3)
eng = ServingEngine(tcfg, dcfg, tp, drafters.init_params(dcfg, target_params=tp), num_slots=2,
                    max_len=256, prompt_buckets=(32,), token_buckets=(10,), modes=("greedy",))
eng.warmup()
run_server(create_app(eng, tok, "tiny", stop_ids=[2]), "127.0.0.1", int(sys.argv[1]),
           drain_timeout_s=60, log_level="warning")
print("exited cleanly", flush=True)
"""


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)]
)
def test_signal_drains_open_stream_and_exits_cleanly(sig, tmp_path_factory):
    port = free_port()
    cache = tmp_path_factory.getbasetemp() / "tok_cache"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(port), str(cache)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.25)
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True,
                "temperature": 0, "stream": True, "return_token_ids": True}  # fmt: skip
        n, reason, done, signalled = 0, None, False, False
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    c = json.loads(line[6:])["choices"][0]
                    n += len(c.get("token_ids") or [])
                    reason = c["finish_reason"] or reason
                    if not signalled:
                        proc.send_signal(sig)  # mid-stream
                        signalled = True
        assert done and reason == "length" and n == 200  # the open request was drained
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    assert "exited cleanly" in out and "Traceback" not in err
