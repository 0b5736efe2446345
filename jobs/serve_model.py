"""Serve a run's trained policy as an OpenAI-compatible endpoint: vLLM's own server on its export.

    python -m jobs.serve_model --run RUN [--host 127.0.0.1] [--port 8001] [--api-key-env NAME] [--lora]

The run is exported first (jobs/export.py) into this node's cache (`<mcprl cache>/exports/`, written
afresh at every start, so a run that trained on is served as it is now; it stays there after the server
stops, and the start says where and how large it is, to remove by hand): a LoRA run merged into plain
weights (the fast path on CPU), or with `--lora` as base + LoRA module; a full run as its weights. Then
it starts vLLM's OpenAI server (`python -m vllm.entrypoints.launchers.api_server.entry`) as its child, says
when it answers, and stays its parent: Ctrl-C or SIGTERM to this process stops the server cleanly (vLLM's
own shutdown, started by a SIGTERM to it alone) and ends in one line; the server dies with this process.
It prints vLLM's warnings and errors only, with uvicorn's access log off (`-v`: all of vLLM's output). The server runs
- `--enable-auto-tool-choice --tool-call-parser hermes`: our models write
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (envs/parsing.py), which the hermes parser turns
  into OpenAI `tool_calls`; the exported chat template shows `tools=` as training did, after the training
  tasks' system message when the request has none (envs/chat_template.py).
  Tool names are used as they are, on both sides: ours are `server.tool` (tasks/inventory.py), which vLLM
  accepts and the model writes as trained. OpenAI's own API allows only [a-zA-Z0-9_-]{1,64}, so a client
  that checks names against that pattern refuses them (the `openai` package does not check);
- the served model named after the run (`run_name`), `max_model_len` and `dtype` from the run's config;
- on CPU, no chunked prefill (a seeded request kills the engine otherwise; see actors/vllm_engine.py).

Security: it binds 127.0.0.1 unless --host says otherwise. Any other host needs a bearer token: the
environment variable named by --api-key-env must hold it (clients send `Authorization: Bearer <token>`);
without one the server refuses to start. The token reaches vLLM through its environment (VLLM_API_KEY),
never the command line, so `ps` and logs do not show it. Arguments after `--` go to vLLM as they are.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import shlex
import sys
from pathlib import Path
from typing import IO

LOOPBACK_NAMES = ("localhost",)
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM's --max-lora-rank accepts


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: reachable from this machine only."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname: it may resolve to anything


def api_key_for(host: str, api_key_env: str, environ: os._Environ[str] | dict[str, str] = os.environ) -> str:
    """The bearer token to require ("" = none). Beyond loopback one is mandatory: ValueError naming
    the host and the variable otherwise."""
    token = environ.get(api_key_env, "") if api_key_env else ""
    if api_key_env and not token:
        raise ValueError(f"--api-key-env {api_key_env}: the environment variable {api_key_env} is not set or empty")
    if not token and not is_loopback(host):
        raise ValueError(
            f"--host {host} is beyond loopback: the server would be open to the network. Require a bearer "
            f"token: put it in an environment variable and name it with --api-key-env (e.g. "
            f"--api-key-env MCPRL_MODEL_TOKEN), or serve on 127.0.0.1"
        )
    return token


def vllm_command(
    folder: Path,
    name: str,
    *,
    host: str,
    port: int,
    dtype: str,
    max_model_len: int,
    cpu: bool,
    lora: Path | None = None,
    lora_rank: int = 16,
    verbose: bool = False,
    extra: list[str] | None = None,
) -> list[str]:
    """vLLM's OpenAI server on an export. `lora`: serve `folder` as the base and this adapter as model `name`."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(folder)]
    if lora is None:
        cmd += ["--served-model-name", name]
    else:
        rank = next(r for r in _LORA_RANKS if r >= lora_rank)
        cmd += ["--served-model-name", f"{name}-base", "--enable-lora", "--max-lora-rank", str(rank)]
        cmd += ["--lora-modules", f"{name}={lora}"]
    cmd += ["--host", host, "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len)]
    cmd += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template-content-format", "string"]
    cmd += ["--generation-config", "vllm"]  # sampling defaults are the request's, not the folder's
    # Guided JSON (response_format, structured_outputs) without free whitespace: training wrote json.dumps
    # text. vLLM 0.32's own tool-call grammar (a named or "required" tool_choice, or tools with strict
    # true) ignores this setting: there a small model may pad its arguments with whitespace. With
    # tool_choice "auto" and no strict tool, the model's own text is parsed (tests/jobs/test_serve_model.py).
    cmd += ["--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
    if not verbose:  # vLLM's level comes from its logging config (serve_model sets it); uvicorn's from here
        cmd += ["--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", "--no-use-tqdm-on-load"]
    if cpu:
        cmd += [
            "--enforce-eager",
            "--no-enable-chunked-prefill",
            "--max-num-batched-tokens",
            str(max(max_model_len, 8192)),
        ]
    return cmd + list(extra or [])


def _max_positions(folder: Path) -> int:
    """The model's max_position_embeddings (0 when its config.json does not say, or is not local: an HF id)."""
    try:
        return int(json.loads((folder / "config.json").read_text()).get("max_position_embeddings") or 0)
    except (OSError, ValueError):
        return 0


def main(argv: list[str] | None = None) -> None:
    import argparse
    import logging

    from cluster.console import quiet_third_party
    from jobs.cli import usage_error

    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m jobs.serve_model", description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a run folder (runs/ci-tiny, s3://...) or a run name under --storage")
    p.add_argument("--storage", default="runs", help="where run names are looked up (train.storage; default runs)")
    p.add_argument("--checkpoint", default="", help="step_N: serve this checkpoint instead of the final weights")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback; others need a token)")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--api-key-env", default="", help="environment variable holding the bearer token clients send")
    p.add_argument("--lora", action="store_true", help="LoRA run: serve base + adapter (vLLM LoRA) instead of merged")
    p.add_argument("--max-model-len", type=int, default=0, help="default: the run's rollout.max_model_len")
    p.add_argument("-v", "--verbose", action="store_true", help="all of vLLM's and uvicorn's output")
    args = p.parse_args(argv)
    quiet_third_party(args.verbose)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not 0 < args.port < 65536:
        usage_error(f"--port {args.port}: not a TCP port")
    try:
        token = api_key_for(args.host, args.api_key_env)
    except ValueError as e:
        usage_error(str(e))

    import torch

    from actors.models import ModelNotFoundError
    from actors.precision import compute_dtype
    from cluster import storage
    from cluster.console import verbose, vllm_logging_config
    from jobs.export import ExportError, export, load_source

    try:
        src = load_source(args.run, args.checkpoint, args.storage)
        lora = src.cfg.finetune.trains_adapter  # lora and qlora
        if args.lora and not lora:
            usage_error(f"--lora: run {src.run!r} is a full fine-tune; serve it without --lora")
        if args.lora and src.cfg.finetune.mode == "qlora":  # vLLM would apply it over the full-precision base
            usage_error(f"--lora: run {src.run!r} trained over a 4-bit base; serve it without --lora (merged)")
        key = hashlib.sha1(f"{src.run}|{args.checkpoint}".encode()).hexdigest()[:12]
        kind = "lora" if args.lora else "merged" if lora else "full"
        out = storage.default_cache_dir() / "exports" / f"{storage.name(src.run)}-{key}-{kind}"
        export(
            src.run,
            str(out),
            merge=lora and not args.lora,
            checkpoint=args.checkpoint,
            force=True,
            progress=lambda line: print(line, flush=True),
        )
    except (ExportError, storage.StorageError) as e:
        usage_error(str(e))
    except ModelNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    size_mb = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e6
    print(
        f"export: {out} ({size_mb:.0f} MB) stays in this node's cache after the server stops; the next "
        f"serve_model of this run rewrites it. Remove it with: rm -r {shlex.quote(str(out))}",
        flush=True,
    )
    cfg = src.cfg
    if args.lora:
        base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
        folder, adapter = Path(base), out
    else:
        folder, adapter = out, None
    # The run's length, but never past the model's own (vLLM refuses a longer one).
    positions = _max_positions(folder)
    max_len = args.max_model_len or min(cfg.rollout.max_model_len, positions or cfg.rollout.max_model_len)
    cmd = vllm_command(
        folder,
        cfg.run_name,
        host=args.host,
        port=args.port,
        dtype=compute_dtype(cfg.model.dtype),
        max_model_len=max_len,
        cpu=not torch.cuda.is_available(),
        lora=adapter,
        lora_rank=cfg.finetune.lora.r,
        verbose=verbose(),
        extra=extra,
    )
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1"}
    env.pop("VLLM_API_KEY", None)  # only the token named here, never one left in the environment
    if token:
        env["VLLM_API_KEY"] = token
    if not torch.cuda.is_available():
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(cfg.rollout.vllm_kv_cache_gb))))
    config_file = vllm_logging_config("WARNING", out)  # in the export folder, rewritten at every start
    if config_file:  # read by the server and the engine core it starts
        env.update(VLLM_LOGGING_CONFIG_PATH=config_file, VLLM_LOGGING_LEVEL="WARNING")
    url = f"http://{args.host}:{args.port}"
    print(f"serving model {cfg.run_name!r} at {url}/v1 (OpenAI API)", flush=True)
    print(f"  auth: {'bearer token from $' + args.api_key_env if token else 'none (loopback only)'}", flush=True)
    print(f"  {shlex.join(cmd)}", flush=True)
    sys.exit(run_server(cmd, env, url, quiet=not verbose()))


def _die_with_parent() -> None:
    """In the server's process before it starts: a SIGTERM to it when serve_model dies (even by SIGKILL)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# What triton's bindings (nanobind) print at the server's exit, as line prefixes: a count of the objects
# triton never freed, about triton's code and harmless at exit, after every stop of a server that imported it.
_EXIT_REPORT = (
    "nanobind: leaked ",
    "nanobind: this is likely caused",
    " - leaked ",
    " - ... skipped",
    "See https://nanobind",
)


def _relay(stream: IO[str]) -> None:
    """The server's stderr onto ours, less triton's exit report (_EXIT_REPORT) and the notices it prints
    on start (cluster.console's printed_notice)."""
    from cluster.console import printed_notice

    for line in stream:
        if not line.startswith(_EXIT_REPORT) and not printed_notice(line):
            sys.stderr.write(line)
            sys.stderr.flush()


def run_server(cmd: list[str], env: dict[str, str], url: str, quiet: bool = True) -> int:
    """The server as this process's child, in its own session (a terminal's Ctrl-C reaches this process
    only: signalled all at once, vLLM's server and engine core tear down in a race that ends in leak
    reports). The first SIGINT or SIGTERM sends SIGTERM to the server, whose own shutdown stops its
    engine core; a second one kills its process group. Returns the exit status: 130 after SIGINT, 0
    after SIGTERM, else the server's."""
    import signal
    import subprocess
    import threading
    import time

    import httpx

    from jobs.cli import INTERRUPTED_EXIT

    stderr = subprocess.PIPE if quiet else None
    proc = subprocess.Popen(cmd, env=env, stderr=stderr, text=True, start_new_session=True, preexec_fn=_die_with_parent)
    relay = threading.Thread(target=_relay, args=(proc.stderr,), daemon=True) if proc.stderr else None
    if relay:
        relay.start()
    stops: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        stops.append(signum)
        try:
            if len(stops) == 1:
                proc.send_signal(signal.SIGTERM)
            else:
                os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it has exited already
            pass

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    host = url.replace("://0.0.0.0:", "://127.0.0.1:").replace("://[::]:", "://[::1]:")
    while proc.poll() is None and not stops:  # /health answers without the token
        try:
            if httpx.get(f"{host}/health", timeout=2).status_code == 200:
                print(f"ready: {url}/v1 (Ctrl-C stops it)", flush=True)
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    rc = proc.wait()
    if relay:
        relay.join(timeout=10)
    if stops:
        name = signal.Signals(stops[0]).name
        print(f"serve_model: stopped the server ({name})", file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT if stops[0] == signal.SIGINT else 0
    return rc


if __name__ == "__main__":
    main()
