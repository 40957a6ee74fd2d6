"""The compose topology, run natively on loopback: one redis-server, N `pagestream serve`
replicas and Debian's nginx with the project's own docker/nginx.conf in front.

`make fleet` (python -m bench.fleet_checks) starts it, runs the scenarios in bench/fleet_checks.py
(affinity, the shared prefix tier, Redis restarted under load, failover, drain) and prints
the per-replica request counts, Redis-hit TTFT against a cold one, and the failover
timeline.  tests/fleet/test_fleet.py runs the same scenarios and asserts on them.

nginx runs the very file compose mounts; only what differs outside compose is filled in:
the replica addresses (its upstream include, with the server parameters of
docker/nginx-upstreams.conf), the listen address, and pid/temp paths under a scratch dir.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[1]
NGINX_CONF = ROOT / "docker" / "nginx.conf"
NGINX_UPSTREAMS = ROOT / "docker" / "nginx-upstreams.conf"
UPSTREAM_INCLUDE = "pagestream-upstreams.conf"  # the name nginx.conf includes
SERVED_NAME = "tiny"


def _load_prctl():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux/glibc
        return None


_PRCTL = _load_prctl()  # looked up here: the child may take no locks before exec


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the process that started it dies, so a
    killed test run or `make fleet` leaves no replica or nginx behind (Linux).  The
    signal follows the forking *thread*: start processes from the main thread."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nginx_binary() -> str | None:
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


def render_nginx(dst: Path, servers: list[str], listen: str) -> Path:
    """docker/nginx.conf, unchanged but for the listen address and the pid/temp paths,
    in `dst`, beside an upstream include naming `servers` (host:port) with the compose
    include's server parameters.  Returns the path of the config to pass to `nginx -c`."""
    text = NGINX_CONF.read_text()
    text, n = re.subn(r"^(\s*)listen\s+8080;", rf"\1listen {listen};", text, flags=re.M)
    if n != 1:
        raise RuntimeError("docker/nginx.conf: expected exactly one `listen 8080;`")
    text = re.sub(r"^pid .*;$", f"pid {dst}/nginx.pid;", text, flags=re.M)
    temp = "".join(
        f"    {kind}_temp_path {dst}/{kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    text = text.replace("\nhttp {\n", "\nhttp {\n" + temp, 1)
    m = re.search(r"^server\s+engine1:8000\s+(.*);$", NGINX_UPSTREAMS.read_text(), re.M)
    if m is None:
        raise RuntimeError("docker/nginx-upstreams.conf: no `server engine1:8000 ...;` line")
    # `resolve` re-resolves names; these addresses are literal (and nginx < 1.27.3,
    # Debian's included, lacks the parameter).
    params = [p for p in m.group(1).split() if p != "resolve"]
    (dst / UPSTREAM_INCLUDE).write_text(
        "".join(f"server {s} {' '.join(params)};\n" for s in servers)
    )
    conf = dst / "nginx.conf"
    conf.write_text(text)
    return conf


def scrape(url: str, timeout: float = 5.0) -> dict[str, float]:
    """A replica's /metrics as {name{labels}: value}."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[key] = float(value)
    return out


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    """Sum of a metric over the series whose labels include `labels`."""
    total = 0.0
    for key, v in values.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{val}"' in rest for k, val in labels.items()):
            total += v
    return total


@dataclass
class Replica:
    name: str
    port: int
    args: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "service.cli", "serve", "--port", str(self.port), *self.args],
                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                preexec_fn=_die_with_parent,
            )  # fmt: skip
        self.starts += 1

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not healthy after {timeout} s:\n{self.tail()}")
            time.sleep(0.1)

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def metrics(self) -> dict[str, float]:
        return scrape(self.url)

    def requests_done(self) -> float:
        return metric(self.metrics(), "pagestream_request_success_total")

    def tail(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""


@dataclass
class Fleet:
    """redis-server + replicas + nginx on free loopback ports, all stopped by stop()."""

    model: str
    replicas_n: int = 3
    api_keys: list[str] = field(default_factory=lambda: ["fleet-key-1", "fleet-key-2"])
    extra_args: list[str] = field(default_factory=list)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ps-fleet-")))
    redis: RedisServer | None = None
    replicas: list[Replica] = field(default_factory=list)
    nginx: subprocess.Popen[bytes] | None = None
    lb_port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.lb_port}"

    @property
    def nginx_log(self) -> Path:
        return self.workdir / "nginx.log"

    def replica(self, name: str) -> Replica:
        return next(r for r in self.replicas if r.name == name)

    def start(self) -> Fleet:
        exe = nginx_binary()
        if exe is None:
            raise FileNotFoundError("nginx is not installed")
        self.redis = RedisServer()
        keys = self.workdir / "api-keys"
        keys.write_text("# one key per line\n" + "".join(k + "\n" for k in self.api_keys))
        args = [
            "--model", self.model, "--served-model-name", SERVED_NAME, "--dtype", "float32",
            "--threads", "1", "--num-kv-blocks", "1024", "--redis-url", self.redis.url,
            "--api-key-file", str(keys), "--enable-prompt-tokens-details",
            "--forwarded-allow-ips", "127.0.0.1", "--shutdown-timeout", "20",
            *self.extra_args,
        ]  # fmt: skip
        for i in range(1, self.replicas_n + 1):
            r = Replica(f"engine{i}", free_port(), args, self.workdir / f"engine{i}.log")
            self.replicas.append(r)
            r.start()
        for r in self.replicas:
            r.wait_ready()
        self.lb_port = free_port()
        conf = render_nginx(
            self.workdir, [f"127.0.0.1:{r.port}" for r in self.replicas],
            f"127.0.0.1:{self.lb_port}",
        )  # fmt: skip
        with open(self.nginx_log, "ab") as log:
            self.nginx = subprocess.Popen(
                [exe, "-p", str(self.workdir), "-c", str(conf), "-e", "stderr",
                 "-g", "daemon off;"],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
            )  # fmt: skip
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(self.url + "/lb/health", timeout=2):
                    break
            except OSError as e:
                if self.nginx.poll() is not None or time.monotonic() > deadline:
                    log = self.nginx_log.read_text()
                    raise RuntimeError("nginx did not start:\n" + log) from e
                time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.nginx is not None and self.nginx.poll() is None:
            self.nginx.send_signal(signal.SIGTERM)  # fast shutdown, not a graceful drain
            try:
                self.nginx.wait(10)
            except subprocess.TimeoutExpired:
                self.nginx.kill()
                self.nginx.wait(5)
        for r in self.replicas:
            r.stop()
        if self.redis is not None:
            self.redis.stop()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def default_model() -> str:
    """The tiny preset, written once under the cache root (random weights, no download)."""
    from modelkit import make_model as mm

    path = mm.cache_root() / "models" / "fleet-tiny-llama"
    if not (path / "config.json").is_file():
        tmp = Path(
            tempfile.mkdtemp(
                prefix=".fleet-tiny-", dir=path.parent if path.parent.is_dir() else None
            )
        )
        mm.make_model(tmp, preset="tiny", arch="llama")
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.replace(tmp, path)
    return str(path)
