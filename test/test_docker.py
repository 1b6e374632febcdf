"""The Docker deployment files, read by real parsers: the Dockerfile by Docker's own (Go) parser
(the ``dockerfile`` package), compose.yaml by a YAML parser. What they must say: the pinned SGLang
image in one ARG, a --no-deps install, a non-root user, port 30000, a health check on /health,
the sparse launcher as the entry point; one GPU service published on 127.0.0.1 only, with the
shared-memory and pinned-memory settings, whose flags all exist."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import dockerfile
import pytest
import yaml

from sparse_sglang.integration.registry import SGLANG_VERSION

DOCKER = Path(__file__).resolve().parents[1] / "docker"


@pytest.fixture(scope="module")
def instructions() -> list:
    return list(dockerfile.parse_file(str(DOCKER / "Dockerfile")))


def values(instructions, cmd: str) -> list[tuple]:
    return [i.value for i in instructions if i.cmd.upper() == cmd]


def test_dockerfile_pins_sglangs_image_in_one_arg_and_installs_without_deps(instructions):
    (arg,) = values(instructions, "ARG")
    name, image = arg[0].split("=", 1)
    assert image == f"lmsysorg/sglang:v{SGLANG_VERSION}-cu130"  # the CUDA 13 image: torch 2.11 cu130
    assert values(instructions, "FROM") == [(f"${{{name}}}",)]
    pip = [r[0] for r in values(instructions, "RUN") if "pip install" in r[0]]
    assert pip and all("--no-deps" in r for r in pip)


def test_dockerfile_runs_the_sparse_launcher_as_a_non_root_user(instructions):
    order = [i.cmd.upper() for i in instructions]
    users = values(instructions, "USER")
    assert users and users[-1][0] not in ("root", "0") and order.index("USER") < order.index("ENTRYPOINT")
    assert values(instructions, "EXPOSE") == [("30000",)]
    (health,) = [i for i in instructions if i.cmd.upper() == "HEALTHCHECK"]
    assert health.value[0] == "CMD" and "/health" in health.value[1]
    (entry,) = values(instructions, "ENTRYPOINT")
    assert entry[:3] == ("python3", "-m", "sparse_sglang.launch_server")
    assert importlib.util.find_spec(entry[2]) is not None
    assert entry[entry.index("--port") + 1] == "30000"


@pytest.fixture(scope="module")
def service() -> dict:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    (svc,) = compose["services"].values()
    return svc


def test_compose_is_one_gpu_service_on_loopback_with_shm_and_pinned_memory_limits(service):
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == 1 and "gpu" in device["capabilities"]
    assert all(p.startswith("127.0.0.1:") for p in service["ports"])
    assert service["shm_size"] and service["ulimits"]["memlock"] == -1
    assert any(v.endswith(":/models:ro") for v in service["volumes"])
    assert service["build"]["dockerfile"] == "docker/Dockerfile"
    assert "${SPARSE_HOST_CACHE_GB" in " ".join(service["command"])  # the host cache from the environment


def test_every_flag_compose_passes_exists(service):
    from sparse_sglang.integration.server_args import build_parser

    known = {opt for action in build_parser()._actions for opt in action.option_strings}
    flags = [a for a in service["command"] if a.startswith("--")]
    assert any(f.startswith("--sparse-") for f in flags)
    assert set(flags) <= known, set(flags) - known
    # Every variable compose substitutes has a default or a required-message.
    for var in re.findall(r"\$\{([^}]*)\}", (DOCKER / "compose.yaml").read_text()):
        assert ":-" in var or ":?" in var, var


def _container_engine() -> str | None:
    """A container engine that can build here: a Docker daemon that answers, or podman, and that
    has SGLang's image or can pull it (podman answers on machines without Docker Hub)."""
    import shutil
    import subprocess

    image = f"lmsysorg/sglang:v{SGLANG_VERSION}-cu130"
    for engine in ("docker", "podman"):
        if shutil.which(engine) is None:
            continue
        if subprocess.run([engine, "info"], capture_output=True, timeout=60).returncode != 0:
            continue
        for probe in (["image", "inspect", image], ["pull", image]):
            if subprocess.run([engine, *probe], capture_output=True, timeout=3600).returncode == 0:
                return engine
    return None


@pytest.mark.skipif(
    _container_engine() is None,
    reason="no container engine that can build (docker daemon or podman) with SGLang's image",
)
def test_image_builds_and_its_entrypoint_answers_help():
    """Build the image the README's way (pulls SGLang's image of the pinned release) and run the
    entry point's ``--help`` in it: the launcher imports and lists the ``--sparse-*`` flags."""
    import subprocess

    engine, root = _container_engine(), DOCKER.parent
    subprocess.run(
        [engine, "build", "-f", "docker/Dockerfile", "-t", "sparse-sglang:test", "."],
        cwd=root,
        check=True,
        timeout=3600,
    )
    help_text = subprocess.run([engine, "run", "--rm", "sparse-sglang:test", "--help"], capture_output=True, text=True,
                               check=True, timeout=600).stdout  # fmt: skip
    assert "--sparse-token-budget" in help_text and "--model-path" in help_text
