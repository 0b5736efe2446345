"""Fixtures shared by the server suites; each test module names its server with module constants:
SERVER, CONFIG (its config class), KEY_ENV and KEY (the live API key), and optionally API_ROOT."""

from __future__ import annotations

import pytest

from mcp_servers import build_server

from .standins import StandIn


@pytest.fixture(scope="session")
def api():
    """The four APIs' stand-ins, on one loopback port."""
    with StandIn() as standin:
        yield standin


@pytest.fixture
def live(api, monkeypatch, request):
    m = request.module
    api.reset()
    monkeypatch.setenv(m.KEY_ENV, m.KEY)
    return build_server(m.SERVER, m.CONFIG(backend="live", base_url=api.url + getattr(m, "API_ROOT", "")))


@pytest.fixture
def offline(request):
    return build_server(request.module.SERVER, request.module.CONFIG())
