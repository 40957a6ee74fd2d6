"""Deployment files under docker/: what can be checked without a Docker engine.

- docker-compose (1.29 here) validates and resolves the compose files (`config`), and the
  resolved YAML is checked for the things the deployment relies on: Redis as an LRU cache,
  several health-checked replicas sharing one Redis, a balancer in front of all of them,
  a GPU per replica in the CUDA overlay.
- nginx.conf is syntax-checked by `nginx -t` where an nginx binary exists, and its key
  directives (consistent hash, WebSocket upgrade, unbuffered streaming) are asserted.
- The Dockerfile is read for what matters at run time (non-root user, health check, stop
  signal), and the entrypoint and health-check scripts are run against stand-ins.

docker-compose missing: skipped on a developer machine, a failure in CI (CI=true), where
.ci/run installs it.
"""

from __future__ import annotations

import http.server
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
BASE = DOCKER / "docker-compose.yml"
CUDA = DOCKER / "docker-compose.cuda.yml"
NGINX_CONF = DOCKER / "nginx.conf"
NGINX_UPSTREAMS = DOCKER / "nginx-upstreams.conf"
DOCKERFILE = DOCKER / "Dockerfile"
ENTRYPOINT = DOCKER / "entrypoint.sh"
HEALTHCHECK = DOCKER / "healthcheck.py"

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
SERVER_SHUTDOWN_TIMEOUT_S = 30  # `pagestream serve --shutdown-timeout` default
ENGINE_RE = re.compile(r"^engine\d+$")


# ---------------------------------------------------------------------------------------
# helpers


def _compose_bin() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        msg = "docker-compose not installed (apt-get install docker-compose)"
        if IN_CI:
            pytest.fail(msg + "; CI must validate the compose files")
        pytest.skip(msg)
    return exe


def _compose_env(**overrides: str) -> dict[str, str]:
    """The caller's environment without anything that would change how the files resolve."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PAGESTREAM_", "COMPOSE_", "REDIS_", "DOCKER_"))
    }
    env.update(overrides)
    return env


def _compose(*files: Path, quiet: bool = False, **env: str) -> subprocess.CompletedProcess[str]:
    # An empty --env-file: a developer's docker/.env must not change what is checked.
    empty_env_file = ROOT / ".pytest_cache" / "deploy-empty.env"
    empty_env_file.parent.mkdir(exist_ok=True)
    empty_env_file.write_text("")
    args = [_compose_bin(), "--env-file", str(empty_env_file)]
    for f in files:
        args += ["-f", str(f)]
    args += ["config"] + (["-q"] if quiet else [])
    proc = subprocess.run(
        args, cwd=ROOT, env=_compose_env(**env), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stderr}"
    return proc


def _resolved(*files: Path, **env: str) -> dict[str, Any]:
    return yaml.safe_load(_compose(*files, **env).stdout)


def _seconds(value: str | int | float) -> float:
    """Compose durations as `config` prints them: 45s, 3m, 1m30s, 1h, 500ms."""
    if isinstance(value, int | float):
        return float(value)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, value
    return sum(float(n) * units[u] for n, u in parts)


def _engines(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in cfg["services"].items() if ENGINE_RE.match(k)}


def _published_ports(svc: dict[str, Any]) -> list[str]:
    out = []
    for p in svc.get("ports", []):
        out.append(str(p["published"]) if isinstance(p, dict) else str(p))
    return out


def _healthcheck_cmd(svc: dict[str, Any]) -> str:
    test = svc["healthcheck"]["test"]
    return " ".join(test) if isinstance(test, list) else test


@pytest.fixture(scope="module")
def base() -> dict[str, Any]:
    return _resolved(BASE)


@pytest.fixture(scope="module")
def cuda() -> dict[str, Any]:
    return _resolved(BASE, CUDA)


def _nginx_text() -> str:
    """nginx.conf without comments (so assertions match directives, not prose)."""
    return "\n".join(line.split("#", 1)[0] for line in NGINX_CONF.read_text().splitlines())


def _nginx_upstream_servers() -> list[str]:
    """The replicas: the upstream block includes docker/nginx-upstreams.conf."""
    block = re.search(r"upstream\s+pagestream_engines\s*\{(.*?)\}", _nginx_text(), re.S)
    assert block, "upstream pagestream_engines block not found"
    assert re.search(r"^\s*include\s+pagestream-upstreams\.conf;", block.group(1), re.M)
    servers = NGINX_UPSTREAMS.read_text()
    return re.findall(r"^\s*server\s+([\w.-]+):8000\b", servers, re.M)


def _location(path_re: str) -> str:
    m = re.search(r"location\s+" + path_re + r"\s*\{(.*?)\}", _nginx_text(), re.S)
    assert m, f"location {path_re} not found"
    return m.group(1)


# ---------------------------------------------------------------------------------------
# compose files


@pytest.mark.parametrize("files", [(BASE,), (BASE, CUDA)], ids=["base", "base+cuda"])
def test_compose_config_is_valid(files: tuple[Path, ...]) -> None:
    _compose(*files, quiet=True)


def test_redis_is_a_bounded_lru_cache(base: dict[str, Any]) -> None:
    redis = base["services"]["redis"]
    cmd = redis["command"]
    cmd = cmd if isinstance(cmd, list) else cmd.split()
    assert cmd[0] == "redis-server"
    assert "--maxmemory" in cmd and cmd[cmd.index("--maxmemory") + 1]
    assert cmd[cmd.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert cmd[cmd.index("--appendonly") + 1] == "no"
    assert cmd[cmd.index("--save") + 1] == ""
    assert "ping" in _healthcheck_cmd(redis)
    assert _published_ports(redis) == [], "Redis has no password: never publish it"


def test_engine_replicas(base: dict[str, Any]) -> None:
    engines = _engines(base)
    assert len(engines) >= 2, "need several replicas behind the balancer"
    urls = {svc["environment"]["PAGESTREAM_REDIS_URL"] for svc in engines.values()}
    assert len(urls) == 1, f"replicas must share one Redis: {urls}"
    (url,) = urls
    assert re.fullmatch(r"redis://redis:6379/\d+", url), url
    for name, svc in engines.items():
        assert "pagestream-healthcheck" in _healthcheck_cmd(svc), name
        assert _seconds(svc["stop_grace_period"]) > SERVER_SHUTDOWN_TIMEOUT_S, name
        assert svc.get("stop_signal", "SIGTERM") == "SIGTERM", name
        assert "redis" in svc["depends_on"], name
        assert any(str(v).split(":")[1] == "/models" for v in svc["volumes"]), name
        assert _published_ports(svc) == [], f"{name}: reach replicas through the balancer"
        assert svc["image"] == "pagestream:cpu", name
        assert svc["build"]["dockerfile"] == "docker/Dockerfile", name
        assert Path(svc["build"]["context"]).resolve() == ROOT, name


def test_balancer_fronts_every_engine(base: dict[str, Any]) -> None:
    lb = base["services"]["lb"]
    engines = set(_engines(base))
    assert engines <= set(lb["depends_on"])
    assert _published_ports(lb) == ["8000"]
    assert any(str(v).endswith(":/etc/nginx/nginx.conf:ro") for v in lb["volumes"])
    assert any(
        str(v).startswith(str(NGINX_UPSTREAMS)) or "nginx-upstreams.conf:" in str(v)
        for v in lb["volumes"]
    )
    assert any(str(v).endswith(":/etc/nginx/pagestream-upstreams.conf:ro") for v in lb["volumes"])
    assert "/lb/health" in _healthcheck_cmd(lb)
    # `resolve` in the upstream block needs nginx >= 1.27.3.
    m = re.fullmatch(r"nginx:(\d+)\.(\d+)(?:\.\d+)?-alpine", lb["image"])
    assert m and (int(m.group(1)), int(m.group(2))) >= (1, 28), lb["image"]
    # nginx.conf and the compose file name the same replicas.
    assert sorted(_nginx_upstream_servers()) == sorted(engines)


def test_compose_variables(base: dict[str, Any]) -> None:
    """Unset variables resolve to "" (the entrypoint treats that as unset) or a default."""
    env = _engines(base)["engine1"]["environment"]
    assert env["PAGESTREAM_MODEL"] == "" and env["PAGESTREAM_API_KEY"] == ""
    # nginx passes the client's Host on: the replicas answer any unless told the names.
    assert env["PAGESTREAM_ALLOWED_HOSTS"] == "*"
    custom = _resolved(
        BASE,
        PAGESTREAM_ALLOWED_HOSTS="chat.example.com",
        PAGESTREAM_API_KEY="sk-test",
        PAGESTREAM_MODEL="/models/m",
        PAGESTREAM_MODELS="/srv/models",
        PAGESTREAM_HTTP_PORT="9100",
        REDIS_MAXMEMORY="4gb",
    )
    for svc in _engines(custom).values():
        assert svc["environment"]["PAGESTREAM_API_KEY"] == "sk-test"
        assert svc["environment"]["PAGESTREAM_ALLOWED_HOSTS"] == "chat.example.com"
        assert svc["environment"]["PAGESTREAM_MODEL"] == "/models/m"
        assert "/srv/models:/models:ro" in svc["volumes"]
    assert _published_ports(custom["services"]["lb"]) == ["9100"]
    cmd = custom["services"]["redis"]["command"]
    assert cmd[cmd.index("--maxmemory") + 1] == "4gb"


def test_cuda_overlay_reserves_one_gpu_per_engine(cuda: dict[str, Any]) -> None:
    engines = _engines(cuda)
    assert len(engines) >= 2
    gpus = []
    for name, svc in engines.items():
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        (dev,) = devices
        assert dev["driver"] == "nvidia", name
        assert "gpu" in dev["capabilities"], name
        gpus += dev["device_ids"]
        assert svc["image"] == "pagestream:cuda", name
        args = svc["build"]["args"]
        assert args["TORCH_INDEX_URL"] == "", name  # the default (CUDA) wheel
        assert "gcc" in args["RUNTIME_APT_PACKAGES"].split(), name  # Triton's launcher
        # The overlay keeps what the base file set.
        assert svc["environment"]["PAGESTREAM_REDIS_URL"].startswith("redis://redis:"), name
        assert _seconds(svc["stop_grace_period"]) > SERVER_SHUTDOWN_TIMEOUT_S, name
    assert len(set(gpus)) == len(gpus), f"replicas default to distinct GPUs: {gpus}"


# ---------------------------------------------------------------------------------------
# nginx


def test_nginx_affinity_and_streaming_directives() -> None:
    text = _nginx_text()
    assert re.search(r"^\s*hash\s+\$ps_affinity\s+consistent;", text, re.M)
    # The affinity key falls back from the session id to the API key to the address.
    for var in ("$http_x_session_id", "$http_authorization", "$remote_addr"):
        assert var in text, var
    # The key (which may be an API key) never reaches the log.
    log_format = re.search(r"log_format\s+\w+(.*?);", text, re.S)
    assert log_format and "ps_key" not in log_format.group(1)
    assert "ps_affinity" not in log_format.group(1)
    assert "authorization" not in log_format.group(1).lower()
    # Nor does ?api_key= (browsers' WebSocket auth): no $request, $request_uri or raw $args.
    for var in ("$request ", '$request"', "$request_uri", "$args", "$query_string"):
        assert var not in log_format.group(1), var
    # Browsers' WebSocket Origin is compared with the Host the replica sees: nginx must
    # pass the client's Host with its port ($host drops it).
    assert not re.search(r"proxy_set_header\s+Host\s+\$host;", text)
    assert re.search(r"proxy_set_header\s+Host\s+\$ps_host;", text)
    assert re.search(r"^\s*proxy_buffering\s+off;", text, re.M)
    assert re.search(r"^\s*proxy_cache\s+off;", text, re.M)
    assert re.search(r"X-Accel-Buffering\s+no", text)
    read_timeouts = [int(s) for s in re.findall(r"proxy_read_timeout\s+(\d+)s;", text)]
    assert read_timeouts and min(read_timeouts) >= 600
    assert re.search(r"proxy_next_upstream\s[^;]*http_503", text)

    ws = _location(r"=\s*/v1/ws")
    assert "proxy_pass http://pagestream_engines;" in ws
    assert re.search(r"proxy_http_version\s+1\.1;", text)
    assert re.search(r"proxy_set_header\s+Upgrade\s+\$http_upgrade;", ws)
    assert re.search(r"proxy_set_header\s+Connection\s+\$ps_connection_upgrade;", ws)
    assert "proxy_pass http://pagestream_engines;" in _location("/")


def test_nginx_config_syntax(tmp_path: Path) -> None:
    exe = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if exe is None:
        pytest.skip("no nginx binary (the directive assertions above still ran)")
    # The same file as compose mounts, the replica addresses (which exist only inside the
    # compose network) filled in as the loopback fleet does (bench/fleet.py).
    from bench.fleet import render_nginx

    conf = render_nginx(tmp_path, ["127.0.0.1:8010", "127.0.0.1:8020"], "127.0.0.1:8000")
    proc = subprocess.run(
        [exe, "-t", "-q", "-p", str(tmp_path), "-c", str(conf), "-e", "stderr"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------------------
# Dockerfile


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_runtime_settings() -> None:
    ins = _dockerfile_instructions()
    stages = [i for i, (word, _) in enumerate(ins) if word == "FROM"]
    assert len(stages) >= 2, "multi-stage: build tools stay out of the runtime image"
    final = ins[stages[-1] :]
    users = [args for word, args in final if word == "USER"]
    assert users, "the runtime stage must switch to a non-root USER"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}
    assert any(word == "HEALTHCHECK" and "pagestream-healthcheck" in a for word, a in final)
    assert ("EXPOSE", "8000") in final
    assert ("STOPSIGNAL", "SIGTERM") in final
    entry = [a for word, a in final if word == "ENTRYPOINT"]
    assert entry and "tini" in entry[-1] and "pagestream-entrypoint" in entry[-1]
    assert any(word == "VOLUME" and "/models" in a for word, a in final)
    args = dict(a.split("=", 1) for word, a in ins if word == "ARG" and "=" in a)
    assert args["TORCH_SPEC"] == "torch==2.13.0"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


def test_dockerfile_copies_existing_paths() -> None:
    """Every COPY from the build context names something that exists (globs may match none)
    and that the ignore files (an allowlist: `*`, then `!path` lines) let through."""
    ignore_files = [DOCKER / "Dockerfile.dockerignore", ROOT / ".dockerignore"]
    allowlists = []
    for f in ignore_files:
        if f.exists():
            lines = [x.strip() for x in f.read_text().splitlines()]
            lines = [x for x in lines if x and not x.startswith("#")]
            if lines and lines[0] == "*":
                allowlists.append((f, {x[1:].rstrip("/") for x in lines if x.startswith("!")}))
    assert allowlists, "docker/Dockerfile.dockerignore must keep .venv out of the context"
    for word, args in _dockerfile_instructions():
        if word != "COPY" or args.startswith("--from"):
            continue
        *sources, _dest = args.split()
        for src in sources:
            if any(c in src for c in "*?["):
                continue
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            src = src.rstrip("/")
            for f, allowed in allowlists:
                assert src in allowed, f"COPY {src}: excluded by {f.relative_to(ROOT)}"


# ---------------------------------------------------------------------------------------
# entrypoint and health check


def _run_entrypoint(tmp_path: Path, *args: str, **env: str) -> list[str]:
    """Run docker/entrypoint.sh with a stand-in `pagestream` that prints its argv and env."""
    sh = shutil.which("sh")
    if sh is None:  # pragma: no cover
        pytest.skip("no POSIX sh")
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    fake = bindir / "pagestream"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\necho "MODEL=${PAGESTREAM_MODEL-<unset>}"\n')
    fake.chmod(0o755)
    full_env = _compose_env(PATH=f"{bindir}:{os.environ.get('PATH', '')}", **env)
    proc = subprocess.run(
        [sh, str(ENTRYPOINT), *args], env=full_env, capture_output=True, text=True, timeout=10
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_entrypoint_serves_on_all_interfaces(tmp_path: Path) -> None:
    out = _run_entrypoint(tmp_path, PAGESTREAM_MODEL="")
    assert out == ["serve", "--host", "0.0.0.0", "--port", "8000", "MODEL=<unset>"]
    out = _run_entrypoint(
        tmp_path,
        "--model",
        "/models/x",
        PAGESTREAM_MODEL="/models/y",
        PAGESTREAM_PORT="9000",
        PAGESTREAM_EXTRA_ARGS="--dtype bfloat16  --max-num-seqs 8",
    )
    assert out == [
        "serve", "--host", "0.0.0.0", "--port", "9000",
        "--dtype", "bfloat16", "--max-num-seqs", "8",
        "--model", "/models/x", "MODEL=/models/y",
    ]  # fmt: skip
    out = _run_entrypoint(tmp_path, "serve", "--max-num-seqs", "4")
    assert out[:5] == ["serve", "--host", "0.0.0.0", "--port", "8000"]
    assert out[5:7] == ["--max-num-seqs", "4"]


def test_entrypoint_passes_other_commands_through(tmp_path: Path) -> None:
    out = _run_entrypoint(tmp_path, "make-model", "/models/tiny", "--preset", "tiny")
    assert out[:4] == ["make-model", "/models/tiny", "--preset", "tiny"]
    # A program on PATH runs as itself.
    assert _run_entrypoint(tmp_path, "echo", "hello") == ["hello"]


class _HealthHandler(http.server.BaseHTTPRequestHandler):
    status = 200
    seen_auth: str | None = None

    def do_GET(self) -> None:
        type(self).seen_auth = self.headers.get("Authorization")
        code = self.status if self.path == "/health" else 404
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[tuple[int, type[_HealthHandler]]]:
    handler = type("Handler", (_HealthHandler,), {})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv.server_address[1], handler
    finally:
        srv.shutdown()
        srv.server_close()


def _health(port: int, **env: str) -> int:
    proc = subprocess.run(
        [sys.executable, str(HEALTHCHECK)],
        env=_compose_env(PAGESTREAM_PORT=str(port), **env),
        capture_output=True,
        timeout=20,
    )
    return proc.returncode


def test_healthcheck_script(health_server: tuple[int, type[_HealthHandler]]) -> None:
    port, handler = health_server
    assert _health(port) == 0
    assert handler.seen_auth is None
    assert _health(port, PAGESTREAM_API_KEY="k") == 0
    assert handler.seen_auth == "Bearer k"
    handler.status = 503  # loading or draining
    assert _health(port) == 1


def test_healthcheck_script_nothing_listening() -> None:
    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert _health(port) == 1
