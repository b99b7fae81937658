"""A live server for the load-test runner: the application as serve_config.yaml builds it (one replica)."""

from __future__ import annotations

import pytest

from serve_app.app import SERVE_RUNTIME_ENV, build_app
from tests.serve_app.test_server import ENGINE, free_port


@pytest.fixture(scope="module")
def base_url():
    import ray
    from ray import serve

    port = free_port()
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, runtime_env=SERVE_RUNTIME_ENV)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"engine": ENGINE}), name="llm", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()
