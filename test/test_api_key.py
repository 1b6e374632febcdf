"""--api-key and the bind address: sparse-sglang serves SGLang's own HTTP app and adds no route, so
SGLang's API-key middleware guards every route, the ones whose answers we extend included
(``/get_server_info`` carries the sparse pools); the default bind address stays SGLang's."""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from sglang.srt.entrypoints import http_server
    from sglang.srt.utils.auth import add_api_key_middleware

from sparse_sglang.integration.server_args import prepare_server_args
from sparse_sglang.testing.models import write_llama3_8b_dummy


def _routes() -> list[str]:
    return sorted(getattr(r, "path", type(r).__name__) for r in http_server.app.routes)


def test_no_route_is_added_and_the_api_key_guards_the_extended_ones():
    from starlette.testclient import TestClient

    import sparse_sglang.integration as integration

    before = _routes()
    integration.install()  # what the launcher does in the server's main process
    assert _routes() == before
    add_api_key_middleware(http_server.app, api_key="secret", admin_api_key=None)  # what launch_server does
    client = TestClient(http_server.app, raise_server_exceptions=False)
    for path in ("/get_server_info", "/server_info"):
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
        # The right key passes the middleware (the handler then fails here: no scheduler behind it).
        assert client.get(path, headers={"Authorization": "Bearer secret"}).status_code != 401, path
    assert client.post("/generate", json={"input_ids": [1, 2]}).status_code == 401
    assert client.post("/flush_cache").status_code == 401


def test_the_default_bind_address_is_sglangs_and_the_key_reaches_it(tmp_path):
    from sglang.srt.server_args import ServerArgs

    model = write_llama3_8b_dummy(tmp_path / "m")
    args = prepare_server_args(["--model-path", model, "--device", "cpu", "--api-key", "secret"])
    assert args.host == ServerArgs.host == "127.0.0.1"
    assert args.api_key == "secret"
