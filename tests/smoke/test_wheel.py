"""The package as a user gets it: a built wheel installed into a fresh virtual environment.

Every other test imports modules from the source tree, so a command whose import only fails once
installed (a module path that exists only in the checkout, a package left out of the wheel) passes
them all. Here the wheel is built from a copy of the tree, installed into a venv, and every
console command and every ``python -m`` entry point the README and ``docs/`` name is run from a
directory outside the repository, each with an effect a user would see:

* ``pd-router sim`` serves simulated engines on every endpoint of a pool file;
* ``pd-router sidecar`` in front of one of them answers a completion with a remote prefill leg;
* ``pd-router serve`` answers ``/health``, a completion and the ``/debug/pool`` view;
* ``pd-router check-config`` accepts ``examples/pool.yaml`` and refuses a broken file, naming it;
* ``pd-router demo`` completes a short run;
* every ``python -m router|kvindex|simulator…`` module the docs name answers ``--help`` (``--help``
  proves the module is in the wheel, imports from it, and parses its arguments — what a packaging
  mistake breaks); the benchmarks under ``loadtests/`` are not shipped, and the wheel holds only
  the shipped packages.

The venv reuses the installed dependencies (``--system-site-packages``), where the editable
install of pd-router also lives; the wheel is force-installed into the venv so its copy comes
first on ``sys.path``, and a test checks that every package resolves there, not to the tree.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadtests.servers.ports import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
# What the wheel ships; loadtests/ (benchmarks, load generators) runs from a checkout only.
PACKAGES = ("router", "kvindex", "simulator")
# The sub-commands below give each a real effect; a new one fails the coverage test until it has one.
SMOKED_COMMANDS = {"serve", "check-config", "sidecar", "demo", "sim"}
STARTUP_S = 30.0  # a server that is not answering after this is broken, not slow
COMMAND_S = 60.0
# Not what a fresh clone has: VCS data, caches, build output, .ci/bin's helm binary (60 MB).
COPY_IGNORE = shutil.ignore_patterns(
    ".git", ".ci", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".venv", "node_modules"
)
# urllib would send loopback requests through a proxy named in the environment.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

T = TypeVar("T")


@dataclass
class Installed:
    """The venv the wheel went into, and how to run things in it from outside the repository."""

    venv: Path
    cwd: Path
    env: dict[str, str]
    wheel: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def pd_router(self) -> Path:
        return self.venv / "bin" / "pd-router"

    def run(self, *args: str | Path, timeout: float = COMMAND_S) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(a) for a in args],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    @contextlib.contextmanager
    def started(self, name: str, *args: str | Path) -> Iterator[Server]:
        """A long-running command, stopped (SIGTERM, then SIGKILL) however the test ends."""
        log = self.cwd / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [str(a) for a in args],
                cwd=self.cwd,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        server = Server(name, proc, log)
        try:
            yield server
        finally:
            server.stop()


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def until(self, probe: Callable[[], T | None], what: str, timeout: float = STARTUP_S) -> T:
        """Poll ``probe`` until it returns a value; fail at once if the process exits."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.proc.returncode} before {what}:\n{self.output()}")
            try:
                value = probe()
            except OSError as exc:  # not listening yet
                last = exc
            else:
                if value is not None:
                    return value
                last = "not yet"
            time.sleep(0.05)  # the interval between polls, not a wait for the state
        pytest.fail(f"{self.name}: no {what} within {timeout:.0f} s (last: {last}):\n{self.output()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def http(
    method: str, url: str, body: Any = None, headers: dict[str, str] | None = None, timeout: float = 10.0
) -> tuple[int, dict[str, str], bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with OPENER.open(request, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def ok_json(url: str) -> Any | None:
    status, _, body = http("GET", url, timeout=2.0)
    return json.loads(body) if status == 200 else None


def _can_build_offline() -> bool:
    """setuptools as new as pyproject's build-system asks for, so no build environment is fetched."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    import setuptools

    return int(setuptools.__version__.split(".")[0]) >= 68


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("wheel")
    assert not root.is_relative_to(REPO), "the venv must not sit inside the source tree"
    # Built from a copy, so the tree gets no build/ or egg-info from the test.
    src = root / "src"
    shutil.copytree(REPO, src, ignore=COPY_IGNORE, symlinks=True)
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q"]
    if _can_build_offline():
        build.append("--no-build-isolation")
    done = subprocess.run(
        [*build, "-w", str(root / "dist"), str(src)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (root / "dist").glob("pd_router-*.whl")

    venv = root / "venv"
    # The dependencies come from the running interpreter's site-packages (no network); pip too,
    # which with the venv's python installs into the venv.
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
        check=True,
        timeout=120,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}  # no PYTHONPATH leak
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    cwd = root / "elsewhere"
    cwd.mkdir()
    result = Installed(venv, cwd, env, wheel)
    # --force-reinstall: the editable install seen through the system site-packages already
    # satisfies "pd-router"; the wheel's copy must be installed anyway, into the venv.
    done = result.run(
        result.python,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-index",
        "--force-reinstall",
        "--disable-pip-version-check",
        "-q",
        wheel,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return result


def test_the_venv_runs_the_wheel_not_the_source_tree(installed: Installed) -> None:
    probe = (
        "import importlib, importlib.metadata as md, json\n"
        f"mods = {{name: importlib.import_module(name).__file__ for name in {PACKAGES!r}}}\n"
        "dist = md.distribution('pd-router')\n"
        "scripts = [e.name for e in dist.entry_points if e.group == 'console_scripts']\n"
        "print(json.dumps({'mods': mods, 'dist': str(dist.locate_file('')), 'scripts': scripts}))\n"
    )
    done = installed.run(installed.python, "-c", probe)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    site = installed.venv / "lib"
    for name, path in seen["mods"].items():
        assert Path(path).is_relative_to(site), f"{name} resolves to {path}, not the venv's copy"
    assert Path(seen["dist"]).is_relative_to(site)
    # Each console script gets a real run below; a new one fails here until it has one.
    assert seen["scripts"] == ["pd-router"]


def test_the_wheel_ships_the_service_and_the_simulator_not_the_benchmarks(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        tops = {name.split("/", 1)[0] for name in wheel.namelist() if "/" in name}
    assert {top for top in tops if not top.endswith(".dist-info")} == set(PACKAGES)


def test_every_sub_command_is_smoked(installed: Installed) -> None:
    done = installed.run(installed.pd_router, "--help")
    assert done.returncode == 0, done.stderr
    choices = re.search(r"\{([a-z,-]+)\} \.\.\.", done.stdout)  # the sub-command positional
    assert choices is not None, done.stdout
    assert set(choices.group(1).split(",")) == SMOKED_COMMANDS


def test_version_is_the_wheels(installed: Installed) -> None:
    done = installed.run(installed.pd_router, "--version")
    assert done.returncode == 0, done.stderr
    read = "import importlib.metadata as m; print(m.version('pd-router'))"
    wheel = installed.run(installed.python, "-c", read).stdout.strip()
    assert done.stdout.strip() == f"pd-router {wheel}" and wheel != "unknown"


def test_check_config_accepts_the_example_and_names_what_is_wrong_in_a_broken_file(
    installed: Installed,
) -> None:
    example = REPO / "examples" / "pool.yaml"
    done = installed.run(installed.pd_router, "check-config", "--config", example)
    assert done.returncode == 0, done.stderr
    assert f"{example}: ok (4 endpoints, model 'sim-model')" in done.stdout

    broken = yaml.safe_load(example.read_text())
    broken["endpoints"][1]["role"] = "both"  # the README's example of a refused value
    path = installed.cwd / "broken.yaml"
    path.write_text(yaml.safe_dump(broken))
    done = installed.run(installed.pd_router, "check-config", "--config", path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "pd-router: invalid configuration:" in done.stderr
    assert "endpoints.1.role" in done.stderr and "'both'" in done.stderr
    assert "Traceback" not in done.stderr


def test_serve_on_a_port_in_use_says_which_listener_and_exits_1(installed: Installed) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        example = REPO / "examples" / "pool.yaml"
        for flags, listener in ((["--port", str(port)], "proxy"), (["--grpc-port", str(port)], "ext_proc")):
            done = installed.run(installed.pd_router, "serve", "--config", example, "--port", "0", *flags)
            assert done.returncode == 1, done.stdout + done.stderr
            said = f"the {listener} listener cannot listen on 127.0.0.1:{port}: Address already in use"
            assert f"pd-router: {said}" in done.stderr
            assert "Traceback" not in done.stderr


def test_demo_completes_a_short_run(installed: Installed) -> None:
    done = installed.run(installed.pd_router, "demo", "--requests", "8")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "-> decode-" in done.stdout  # the chosen routes and why
    assert done.stdout.count("8 ok / 8 sent") == 2  # pd-router's column and least-loaded's


def test_demo_without_the_baseline_and_below_one_request(installed: Installed) -> None:
    done = installed.run(installed.pd_router, "demo", "--requests", "4", "--no-baseline")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("4 ok / 4 sent") == 1 and "least-loaded" not in done.stdout
    done = installed.run(installed.pd_router, "demo", "--requests", "0")
    assert done.returncode == 2
    assert "--requests: a whole number of requests, at least 1, not '0'" in done.stderr


@dataclass
class SimPool:
    config: Path
    addresses: dict[str, str]  # endpoint name -> ip:port


@pytest.fixture(scope="module")
def sim_pool(installed: Installed) -> Iterator[SimPool]:
    """``pd-router sim`` on examples/pool.yaml with its endpoints moved to free ports."""
    config = yaml.safe_load((REPO / "examples" / "pool.yaml").read_text())
    addresses = {}
    for endpoint in config["endpoints"]:
        endpoint["address"] = addresses[endpoint["name"]] = f"127.0.0.1:{free_port()}"
    path = installed.cwd / "pool.yaml"
    path.write_text(yaml.safe_dump(config))
    with installed.started("sim", installed.pd_router, "sim", "--config", path) as sim:
        for address in addresses.values():
            models = sim.until(lambda a=address: ok_json(f"http://{a}/v1/models"), f"/v1/models on {address}")
            assert [m["id"] for m in models["data"]] == ["sim-model"]
        yield SimPool(path, addresses)


def test_sim_serves_every_endpoint_of_the_pool_file(sim_pool: SimPool) -> None:
    for address in sim_pool.addresses.values():
        status, _, body = http("GET", f"http://{address}/metrics")
        assert status == 200 and b"vllm:num_requests_running" in body


@pytest.mark.parametrize("client", ["builtin", "aiohttp"])
def test_sidecar_answers_a_completion_with_a_remote_prefill(
    installed: Installed, sim_pool: SimPool, client: str
) -> None:
    port = free_port()
    decode, prefill = sim_pool.addresses["decode-a"], sim_pool.addresses["prefill-a"]
    args = ("sidecar", "--decode", decode, "--port", str(port), "--allow", "127.0.0.1")
    args += ("--http-client", client)  # the engine legs' client, either kind
    with installed.started("sidecar", installed.pd_router, *args) as sidecar:
        base = f"http://127.0.0.1:{port}"
        # Not a completion: passed through to the engine, so this is up once the sidecar listens.
        sidecar.until(lambda: ok_json(f"{base}/v1/models"), "/v1/models through the sidecar")
        body = {"model": "sim-model", "prompt": "Hello from the smoke test", "max_tokens": 4}
        status, headers, answer = http(
            "POST", f"{base}/v1/completions", body, headers={"x-prefiller-host-port": prefill}
        )
    assert status == 200, answer
    assert headers.get("x-pd-sidecar-prefill") == "remote"
    # The leg's report a picker behind Envoy learns the prefill speed from.
    assert headers.get("server-timing", "").startswith("pd-prefill;dur="), headers
    assert headers.get("content-length") == str(len(answer)), headers  # a whole answer in one piece
    assert json.loads(answer)["choices"][0]["text"]


def test_serve_answers_health_a_completion_and_the_debug_view(
    installed: Installed, sim_pool: SimPool
) -> None:
    port, metrics_port = free_port(), free_port()
    args = ("serve", "--config", sim_pool.config, "--port", str(port), "--metrics-port", str(metrics_port))
    with installed.started("serve", installed.pd_router, *args) as serve:
        base = f"http://127.0.0.1:{port}"
        serve.until(lambda: http("GET", f"{base}/health", timeout=2.0)[0] == 200 or None, "200 on /health")
        body = {"model": "sim-model", "prompt": "Hello from the smoke test", "max_tokens": 4}
        status, _, answer = http("POST", f"{base}/v1/completions", body)
        assert status == 200, answer
        assert json.loads(answer)["choices"][0]["text"]
        # What docs/admission.md's `curl …/debug/pool | jq '.groups[] | {key, state, …}'` reads.
        view = ok_json(f"http://127.0.0.1:{metrics_port}/debug/pool")
        version = installed.run(installed.pd_router, "--version").stdout.split()[-1]
        _, _, exposition = http("GET", f"http://127.0.0.1:{metrics_port}/metrics")
    assert f'pd_router_build_info{{python="{platform.python_version()}",version="{version}"}} 1.0' in (
        exposition.decode()
    )
    assert view is not None and view["groups"]
    for group in view["groups"]:
        assert {"key", "state", "epoch", "last_failure"} <= group.keys()
    assert any(group["state"] == "admitted" for group in view["groups"])


def test_serve_with_grpc_port_serves_the_endpoint_picker_and_its_health(
    installed: Installed, sim_pool: SimPool
) -> None:
    """``pd-router serve --grpc-port`` as the README's endpoint-picker line runs it: the port answers
    gRPC health for the ext_proc service (h2c here; TLS on the same port), SERVING once the pool's
    groups are admitted."""
    grpc_port, port, metrics_port = free_port(), free_port(), free_port()
    args = ("serve", "--config", sim_pool.config, "--grpc-port", str(grpc_port))
    args += ("--port", str(port), "--metrics-port", str(metrics_port))
    service = "envoy.service.ext_proc.v3.ExternalProcessor"
    with (
        installed.started("serve --grpc-port", installed.pd_router, *args) as serve,
        grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
    ):
        health = health_pb2_grpc.HealthStub(channel)

        def serving() -> bool | None:
            try:
                answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
            except grpc.RpcError:  # not listening yet
                return None
            return True if answer.status == health_pb2.HealthCheckResponse.SERVING else None

        serve.until(serving, f"SERVING for {service} on --grpc-port")


def modules_named_in_docs() -> list[str]:
    """``python -m X`` / ``python3 -m X`` for our packages, anywhere in README.md and docs/*.md."""
    text = "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    named = set(re.findall(r"\bpython3? -m ([A-Za-z_][\w.]*)", text))
    return sorted(m for m in named if m.split(".")[0] in PACKAGES)


def test_docs_name_python_m_entry_points() -> None:
    # The extraction below must keep finding what the README documents.
    assert {"router.server.config_reference"} <= set(modules_named_in_docs())


def test_every_python_m_entry_point_in_the_docs_answers_help(installed: Installed) -> None:
    def answers_help(module: str) -> str | None:
        """None, or why ``python -m module --help`` did not answer with a usage."""
        try:
            done = subprocess.run(
                [str(installed.python), "-m", module, "--help"],
                cwd=installed.cwd,
                env=installed.env,
                capture_output=True,
                text=True,
                timeout=COMMAND_S,
            )
        except subprocess.TimeoutExpired:
            return f"no answer to --help within {COMMAND_S:.0f} s"
        if done.returncode != 0 or "usage:" not in done.stdout:
            return f"exit {done.returncode}: {done.stderr.strip()[-800:]}"
        return None

    # A few at a time: each is an interpreter start plus heavy imports, on a machine of 2 cores.
    modules = modules_named_in_docs()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        failed = {m: why for m, why in zip(modules, pool.map(answers_help, modules), strict=True) if why}
    assert not failed, "\n".join(f"python -m {m} --help: {why}" for m, why in failed.items())
