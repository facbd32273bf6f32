"""Fixtures of the OpenAI API conformance suite: real `stage-server run` processes and official clients for them.

Environment:
  STAGE_SERVER_BIN     the binary (default: target/debug/stage-server under the workspace root)
  STAGE_SERVER_MODEL   the GGUF model (default: ~/.cache/stage-server/models/SmolLM2-135M-Instruct.Q4_1.gguf)
  STAGE_SERVER_STAGES  the stage counts to run the suite over, comma-separated (default: 3,1)

Each server is started once per session (per stage count), waited for on /health, and stopped with SIGINT at
the end (killed if still running 10 s later). Its stdout and stderr go to a file, not a pipe: a pipe nobody
reads fills up and blocks the server's logging, and the file is what a failed start shows.
"""

import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import openai
import pytest

WORKSPACE = Path(__file__).resolve().parents[3]
DEFAULT_BINARY = WORKSPACE / "target" / "debug" / "stage-server"
DEFAULT_MODEL = Path.home() / ".cache" / "stage-server" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

# The server's capacity in the suite: requests beyond LANES + QUEUE at once must be refused with 429.
LANES = 2
QUEUE = 2
# Loading a 100 MB model in three processes of a debug build takes seconds; two minutes means it is stuck.
START_TIMEOUT_SECONDS = 120
STOP_TIMEOUT_SECONDS = 10
# The key of the server that checks authentication.
API_KEY = "conformance-secret"
AUTH_MODEL_ID = "conformance-model"


@dataclass
class Server:
    """A running `stage-server run` and what the tests need to talk to it."""

    stages: int
    base_url: str
    process: subprocess.Popen
    log_path: Path
    api_key: str | None
    model_id: str = ""
    arguments: list = field(default_factory=list)

    def client(self, api_key: str | None = None, **options) -> openai.OpenAI:
        """An official client for this server; retries are off so every status is seen as sent."""
        key = api_key if api_key is not None else (self.api_key or "unused")
        options.setdefault("timeout", 60.0)
        options.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=key, **options)

    def log_tail(self, lines: int = 60) -> str:
        """The end of the server's output, for failure messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as error:
            return f"(no server log: {error})"
        return "\n".join(text.splitlines()[-lines:])

    def headers(self) -> dict:
        """Headers for raw requests: the bearer key when the server wants one."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def selected_stage_counts() -> list[int]:
    """The stage counts from STAGE_SERVER_STAGES, or 3 and 1."""
    text = os.environ.get("STAGE_SERVER_STAGES", "").strip()
    if not text:
        return [3, 1]
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise pytest.UsageError(f"STAGE_SERVER_STAGES={text!r} should be stage counts such as 3 or 3,1")
    if not counts or any(count < 1 for count in counts):
        raise pytest.UsageError(f"STAGE_SERVER_STAGES={text!r} should list stage counts of 1 or more")
    return counts


def binary_path() -> Path:
    return Path(os.environ.get("STAGE_SERVER_BIN") or DEFAULT_BINARY)


def model_path() -> Path:
    return Path(os.environ.get("STAGE_SERVER_MODEL") or DEFAULT_MODEL).expanduser()


def free_port() -> int:
    """A port nothing listens on right now (the server binds it a moment later; a clash fails the start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(stages: int, extra: list[str], api_key: str | None) -> Server:
    binary = binary_path()
    model = model_path()
    if not binary.is_file():
        pytest.fail(f"no stage-server binary at {binary}; build it (cargo build -p stage-server) or set STAGE_SERVER_BIN")
    if not model.is_file():
        pytest.fail(f"no model at {model}; run `cargo xtask fetch-models smollm2` or set STAGE_SERVER_MODEL")
    port = free_port()
    address = f"127.0.0.1:{port}"
    arguments = [
        str(binary), "run",
        "--stages", str(stages),
        "--model", str(model),
        "--http", address,
        "--lanes", str(LANES),
        "--queue", str(QUEUE),
        *extra,
    ]
    log = tempfile.NamedTemporaryFile(prefix=f"stage-server-{stages}-", suffix=".log", delete=False)
    process = subprocess.Popen(arguments, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    server = Server(stages, f"http://{address}", process, Path(log.name), api_key, arguments=arguments)
    wait_until_ready(server)
    return server


def wait_until_ready(server: Server) -> None:
    """Polls /health until 200; fails with the server's output when it exits or the timeout passes."""
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    last = "no answer yet"
    while time.monotonic() < deadline:
        code = server.process.poll()
        if code is not None:
            pytest.fail(
                f"`{' '.join(server.arguments)}` exited with {code} before /health said ok; its output:\n"
                f"{server.log_tail()}"
            )
        try:
            response = httpx2.get(f"{server.base_url}/health", timeout=5.0)
            if response.status_code == 200:
                return
            last = f"{response.status_code} {response.text[:200]}"
        except httpx2.TransportError as error:
            last = f"{type(error).__name__}: {error}"
        time.sleep(0.25)
    stop_server(server)
    pytest.fail(
        f"/health was not 200 within {START_TIMEOUT_SECONDS} s (last: {last}) for "
        f"`{' '.join(server.arguments)}`; its output:\n{server.log_tail()}"
    )


def stop_server(server: Server) -> None:
    """SIGINT, then SIGKILL after STOP_TIMEOUT_SECONDS; the log file is removed once the process is gone."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGINT)
        try:
            server.process.wait(timeout=STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            print(
                f"\nstage-server ({server.stages} stages) was still running {STOP_TIMEOUT_SECONDS} s after "
                f"SIGINT; killing it. Its output:\n{server.log_tail()}"
            )
            server.process.kill()
            server.process.wait()
    try:
        server.log_path.unlink()
    except OSError:
        pass


def discover_model_id(server: Server) -> str:
    response = httpx2.get(f"{server.base_url}/v1/models", headers=server.headers(), timeout=10.0)
    assert response.status_code == 200, f"GET /v1/models answered {response.status_code}: {response.text[:300]}"
    data = response.json().get("data") or []
    assert data, f"GET /v1/models lists no model: {response.text[:300]}"
    return data[0]["id"]


@pytest.fixture(scope="session", params=selected_stage_counts(), ids=lambda count: f"stages{count}")
def server(request) -> Server:
    """`stage-server run --stages N` with LANES lanes and a queue of QUEUE, once per stage count."""
    running = start_server(request.param, [], api_key=None)
    try:
        running.model_id = discover_model_id(running)
        yield running
    finally:
        stop_server(running)


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    """The official client for the session's server."""
    with server.client() as official:
        yield official


@pytest.fixture(scope="session")
def auth_server() -> Server:
    """A server started with --api-key and --model-id, on the fewest stages selected (auth is stage 0's)."""
    stages = min(selected_stage_counts())
    running = start_server(stages, ["--api-key", API_KEY, "--model-id", AUTH_MODEL_ID], api_key=API_KEY)
    running.model_id = AUTH_MODEL_ID
    try:
        yield running
    finally:
        stop_server(running)
