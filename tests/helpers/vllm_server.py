"""A real `grpo vllm-serve` on vLLM's CPU build for the vLLM tier (tests/test_vllm.py, tests/test_vllm_vlm.py)."""

import os
import signal
import subprocess
import sys

from grpo.generation.vllm.client import VLLMClient, VLLMServerError


def start_server(model_path, port, log_path, key, *extra, max_model_len=1024, timeout=180):
    """A server process for `model_path` that requires `key` (GRPO_VLLM_API_KEY, or --api-key in `extra`: one given
    no key would make its own, which the tests' clients, sending theirs, could not use), and a client that waited
    until it answered. A server that does not start fails the test with the end of its log."""
    env = {**os.environ, "GRPO_VLLM_API_KEY": key}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    command = [sys.executable, "-m", "grpo", "vllm-serve", "--model", str(model_path), "--port", str(port)]
    command += ["--enforce-eager", "--dtype", "float32", "--max-model-len", str(max_model_len), *extra]
    log = open(log_path, "w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    client = VLLMClient(port=port, timeout=timeout)
    try:
        client.wait_until_ready()
    except VLLMServerError:
        process.kill()
        raise AssertionError(f"the server did not start; its log:\n{open(log_path).read()[-4000:]}") from None
    return process, client


def stop_server(process):
    """Stop the server's process group: SIGTERM, then SIGKILL after 20 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
