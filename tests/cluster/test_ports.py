"""The port a run listens on: a run with its own Ray moves off a default port another run holds (no Ray here),
and what preflight says of it beforehand."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cluster import ray_env
from cluster.ports import RAY_WORKER_PORTS, ephemeral_ports, free_port, port_in_use
from cluster.ray_env import listen_port
from configs.loader import load_config
from configs.schema import Config, HttpConfig
from jobs.preflight import Check, Preflight, check_tools_port

ROOT = Path(__file__).resolve().parents[2]
KEY = "tools.http.port"


@contextmanager
def listening(reuse_port: bool = False) -> Iterator[int]:
    """A listener on a free loopback port, as another run's Serve proxy (which sets SO_REUSEPORT) would hold it."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_free_port_is_one_no_outgoing_connection_or_ray_worker_takes() -> None:
    """A port chosen now and bound later (a Serve proxy, a rendezvous) lies outside the ephemeral range, where any
    process's outgoing connection could take it meanwhile, and above Ray's worker ports."""
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # chosen at random: two runs starting at once do not pick the same
    for port in ports:
        assert port not in ephemeral_ports() and port >= RAY_WORKER_PORTS.stop, port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free


@pytest.mark.parametrize("reuse_port", [False, True], ids=["plain", "SO_REUSEPORT like Serve's proxy"])
def test_a_listened_port_is_in_use_until_closed(reuse_port: bool) -> None:
    with listening(reuse_port) as port:
        assert port_in_use("127.0.0.1", port)
    assert not port_in_use("127.0.0.1", port)


def test_an_embedded_run_moves_off_a_taken_default_port_and_says_so(monkeypatch, caplog) -> None:
    monkeypatch.setattr(ray_env, "_started_embedded", True)
    caplog.set_level(logging.WARNING, logger="cluster.ray_env")
    with listening(reuse_port=True) as taken:
        moved = listen_port(KEY, "127.0.0.1", taken, explicit=False, serves="the MCP tool pool serves")
        assert moved != taken and not port_in_use("127.0.0.1", moved)
    [line] = caplog.messages
    assert line == f"{KEY} {taken} is in use (another run?): the MCP tool pool serves on 127.0.0.1:{moved}"


def test_a_free_port_is_kept_and_an_explicit_taken_one_is_an_error_naming_the_key(monkeypatch) -> None:
    monkeypatch.setattr(ray_env, "_started_embedded", True)
    port = free_port()
    assert listen_port(KEY, "127.0.0.1", port, explicit=True, serves="x") == port
    assert listen_port(KEY, "127.0.0.1", port, explicit=False, serves="x") == port
    with listening() as taken, pytest.raises(ValueError, match=rf"^{KEY} {taken} is in use on 127\.0\.0\.1 "):
        listen_port(KEY, "127.0.0.1", taken, explicit=True, serves="x")


def test_connected_to_a_cluster_the_port_is_left_as_configured(monkeypatch) -> None:
    """Serve there may already listen on the configured port, as it should: nothing moves, nothing fails."""
    monkeypatch.setattr(ray_env, "_started_embedded", False)
    with listening() as taken:
        assert listen_port(KEY, "127.0.0.1", taken, explicit=True, serves="x") == taken
        assert listen_port(KEY, "127.0.0.1", taken, explicit=False, serves="x") == taken


def test_the_port_counts_as_explicit_only_when_written() -> None:
    """What start_serve and preflight read: the default (and configs/tools.yaml, which leaves it so) may move."""
    assert not load_config(None).tools.http.port_is_explicit()
    assert not load_config(ROOT / "configs" / "tools.yaml").tools.http.port_is_explicit()
    assert load_config(None, [f"{KEY}=8001"]).tools.http.port_is_explicit()


def test_preflight_says_where_the_pool_will_serve_and_fails_on_a_taken_explicit_port(monkeypatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # the run would start its own Ray

    def check(cfg: Config) -> list[Check]:
        pf = Preflight()
        check_tools_port(cfg, pf)
        return pf.checks

    free = free_port()
    [ok] = check(load_config(None, [f"{KEY}={free}"]))
    assert ok.ok and ok.detail == f"the MCP tool pool will serve on 127.0.0.1:{free}"
    with listening() as taken:
        [failed] = check(load_config(None, [f"{KEY}={taken}"]))
        assert not failed.ok and failed.detail == f"{KEY} {taken} is in use on 127.0.0.1 (another run?)"
        assert f"--set {KEY}=N" in failed.fix
        cfg = load_config(None)
        cfg.tools.http = HttpConfig.model_construct(_fields_set=set(), host="127.0.0.1", port=taken)  # the default
        [moves] = check(cfg)
        assert moves.ok and moves.detail.startswith(f"{taken} is in use (another run?): the MCP tool pool will take")
        # On a cluster, Serve listens on the cluster's machines: nothing to check on this one.
        assert check(load_config(None, [f"{KEY}={taken}", "cluster.address=127.0.0.1:6379"])) == []
