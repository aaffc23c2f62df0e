"""vLLM's OpenAI server (``vllm serve``) for the tests: start it on a free local port, wait
until it answers, sample the memory of its process tree, and stop every process it started.

The server runs in its own process group (and session), so that stopping it reaches the
engine core and worker processes vLLM spawns; processes seen in its tree while it ran are
killed by id if any outlived the group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODEL_NAME = "smollm2"  # --served-model-name
K = 4  # speculative tokens per step (n-gram)


class ServerError(RuntimeError):
    """The server did not start, or died; the message ends with its log's tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_args(model: str, port: int) -> list[str]:
    """``vllm serve`` for SmolLM2 on CPU with n-gram speculation (K drafts per step)."""
    speculative = {
        "method": "ngram",
        "num_speculative_tokens": K,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    return [
        sys.executable,
        str(HERE / "vllm_cli.py"),
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        MODEL_NAME,
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "16",
        # no torch.compile warm-up (minutes on two cores); the grammar path is the same
        "--enforce-eager",
        "--seed",
        "0",
        "--disable-uvicorn-access-log",
        "--speculative-config",
        json.dumps(speculative),
    ]


class Server:
    """One ``vllm serve`` process tree. Use as a context manager: ``start`` on enter,
    ``stop`` on exit (always, also when the body raised)."""

    def __init__(self, model: str, env: dict[str, str], log_path: Path, start_s: float) -> None:
        self.model = model
        self.env = env
        self.log_path = log_path
        self.start_s = start_s
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.seen: dict[int, psutil.Process] = {}  # every process of the tree sampled
        #: (time, {pid: (RSS, anonymous RSS)}), bytes; anonymous: resident pages less the
        #: file-backed and shared ones (what a leak grows; the kernel may drop and re-read
        #: file pages of a library at any time, under other processes' memory pressure)
        self.samples: list[tuple[float, dict[int, tuple[int, int]]]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the server and wait until ``/health`` answers 200 (retried on a new port if
        the one picked was taken meanwhile). Raises ServerError with the log's tail."""
        for _ in range(3):
            self.port = free_port()
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    serve_args(self.model, self.port),
                    cwd=ROOT,
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            if self._wait_ready():
                return
            if "Address already in use" not in self.log_tail():
                break
            self.stop()
        raise ServerError(f"vllm serve did not start:\n{self.log_tail()}")

    def _wait_ready(self) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            self._note_tree()
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise ServerError(
            f"vllm serve not ready after {self.start_s:.0f} s (start-up deadline):\n"
            + self.log_tail()
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def tree(self) -> list[psutil.Process]:
        """The server process and every process below it, now."""
        if not self.alive():
            return []
        assert self.proc is not None
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _note_tree(self) -> dict[int, tuple[int, int]]:
        rss = {}
        for proc in self.tree():
            self.seen.setdefault(proc.pid, proc)
            with contextlib.suppress(psutil.Error):
                info = proc.memory_info()  # /proc/PID/statm: shared = file-backed + shmem
                rss[proc.pid] = (info.rss, info.rss - info.shared)
        return rss

    def labels(self) -> dict[int, str]:
        """Process titles of the tree (vLLM names its processes: ``VLLM::EngineCore``...)."""
        out = {}
        for pid, proc in self.seen.items():
            try:
                out[pid] = " ".join(proc.cmdline()[:1]).rsplit("/", 1)[-1][:40]
            except psutil.Error:
                out[pid] = "?"
        return out

    def cpu_seconds(self) -> float:
        """User and system CPU time of the tree's processes so far (children they reaped
        included)."""
        total = 0.0
        for proc in self.tree():
            with contextlib.suppress(psutil.Error):
                t = proc.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
        return total

    def sample(self) -> None:
        """Append the RSS and anonymous RSS of every process of the tree now to ``samples``."""
        self.samples.append((time.monotonic(), self._note_tree()))

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 60 s; then any process seen
        in its tree that is still running is killed by id. Idempotent."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group's id is the server's pid
        self._signal_group(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=60)
        deadline = time.monotonic() + 60
        while _group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.5)
        self._signal_group(pgid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait()
        for proc in self.seen.values():
            try:
                if proc.is_running():  # the same process (psutil checks its start time)
                    proc.kill()
                    proc.wait(10)
            except psutil.Error:
                pass
        self.proc = None

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    def leftovers(self) -> list[int]:
        """Processes started by the server that still run (none after ``stop``)."""
        alive = []
        for pid, proc in self.seen.items():
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.Error:
                pass
        return alive


def _group_members(pgid: int) -> list[int]:
    members = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) == pgid:
                members.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return members


def server_env(mode: str, log_every: int) -> dict[str, str]:
    """The server's environment: the hub off, a 1 GiB KV cache unless set, the plugin's mode
    (``PORTABLE_SPEC_VLLM``) and its summary line every ``log_every`` calls."""
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: a separate engine core
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PORTABLE_SPEC_VLLM=mode,
        PORTABLE_SPEC_VLLM_LOG_EVERY=str(log_every),
    )
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


__all__ = ["MODEL_NAME", "K", "Server", "ServerError", "free_port", "serve_args", "server_env"]
