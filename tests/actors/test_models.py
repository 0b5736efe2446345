"""Model bootstrap: built-ins, resolution, determinism, concurrent builds.

Everything but the SmolLM2 conversion is fast; that one builds once per machine into the default
cache ($MCPRL_CACHE or ~/.cache/mcprl) and is reused by later runs.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from safetensors import safe_open

import actors.models
from actors.models import (
    BUILTIN_MODELS,
    ModelNotFoundError,
    count_parameters,
    ensure_built,
    load_causal_lm,
    load_tokenizer,
    main,
    resolve_model,
    smollm2_gguf_path,
)
from configs.schema import ModelConfig
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]

TINY_PARAMS = 6_587_008  # 49152x128 tied embedding + 2 layers of 147,712 + final norm
SMOLLM2_PARAMS = 134_515_008
# Digest of tiny-random's tensors (names, dtypes, shapes, bytes): the same on every machine.
# It changes only when the recipe does (then bump _RECIPES["tiny-random"] in actors/models.py).
TINY_DIGEST = "f938d58ca5a041033c55a3fae9144b745f0febc2d4aa45acabec0950615eeec9"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_price",
            "description": "Last price of a stock.",
            "parameters": {
                "type": "object",
                "properties": {"ticker": {"type": "string"}},
                "required": ["ticker"],
            },
        },
    }
]


def tensor_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        for key in sorted(f.keys()):
            t = f.get_tensor(key)
            digest.update(f"{key}:{t.dtype}:{tuple(t.shape)}".encode())
            digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("mcprl-cache")
    ensure_built("tiny-random", cache)
    return cache


@pytest.fixture(scope="session")
def tiny_folder(tiny_cache: Path) -> Path:
    return resolve_model("tiny-random", str(tiny_cache))


# --------------------------------------------------------------------------- tiny-random


def test_tiny_random_folder(tiny_cache: Path, tiny_folder: Path) -> None:
    assert tiny_folder == tiny_cache / "models" / "tiny-random"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (tiny_folder / name).is_file(), name
    config = json.loads((tiny_folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] == config["head_dim"] == 32
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] == 49152
    assert "quantization_config" not in config
    assert count_parameters(tiny_folder) == TINY_PARAMS
    assert not list((tiny_cache / "models").glob(".tiny-random.tmp-*"))


def test_tiny_random_reused_without_rebuilding(tiny_cache: Path, tiny_folder: Path) -> None:
    mtime = (tiny_folder / "model.safetensors").stat().st_mtime_ns
    folder, built = ensure_built("tiny-random", tiny_cache)
    assert (folder, built) == (tiny_folder, False)
    assert (tiny_folder / "model.safetensors").stat().st_mtime_ns == mtime


def test_tiny_random_is_deterministic(tiny_folder: Path, tmp_path: Path) -> None:
    other, built = ensure_built("tiny-random", tmp_path)
    assert built
    assert (other / "model.safetensors").read_bytes() == (tiny_folder / "model.safetensors").read_bytes()
    assert tensor_digest(other) == TINY_DIGEST


def test_tiny_random_loads_and_generates(tiny_cache: Path) -> None:
    cfg = ModelConfig(name="tiny-random", cache_dir=str(tiny_cache), dtype="float32")
    tokenizer = load_tokenizer(cfg)
    model = load_causal_lm(cfg)
    assert model.dtype == torch.float32 and not model.training
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**enc, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape == (1, enc["input_ids"].shape[1] + 5)
    assert len(load_tokenizer(cfg)) == model.config.vocab_size


def test_chat_template_ignores_tools(tiny_cache: Path) -> None:
    # SmolLM2's template renders role + content only: `tools=` is accepted and left out, so the
    # tool schemas have to be written into a message (the system prompt) by the caller.
    tokenizer = load_tokenizer(ModelConfig(name="tiny-random", cache_dir=str(tiny_cache)))
    messages = [{"role": "user", "content": "Price of AAPL?"}]
    with_tools = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert with_tools == plain
    assert with_tools == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nPrice of AAPL?<|im_end|>\n<|im_start|>assistant\n"
    )
    # A tool result is one more turn with the role `tool`; assistant turns need string content.
    turns = [
        *messages,
        {"role": "assistant", "content": '<tool_call>{"name": "get_price"}</tool_call>'},
        {"role": "tool", "content": '{"price": 185.1}'},
    ]
    text = tokenizer.apply_chat_template(turns, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.endswith('<|im_start|>tool\n{"price": 185.1}<|im_end|>\n<|im_start|>assistant\n')


# --------------------------------------------------------------------------- resolution


def test_local_folder_resolves_to_itself(tiny_folder: Path, tmp_path: Path) -> None:
    assert resolve_model(str(tiny_folder)) == tiny_folder.resolve()
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        resolve_model(str(tmp_path))


def test_unknown_name_lists_the_choices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    for name in ("no-such-org/no-such-model", "not/an/id"):
        with pytest.raises(ModelNotFoundError) as info:
            resolve_model(name)
        message = str(info.value)
        assert isinstance(info.value, ValueError)
        assert repr(name) in message
        assert "a local folder with config.json" in message
        for builtin in BUILTIN_MODELS:
            assert builtin in message


def test_offline_mode_names_the_model_and_the_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    assert constants.is_offline_mode(), "tests/conftest.py sets HF_HUB_OFFLINE=1 before huggingface_hub loads"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("Qwen/Qwen2.5-1.5B-Instruct")
    message = str(info.value)
    assert f"'Qwen/Qwen2.5-1.5B-Instruct' is not in the HF cache of node {socket.gethostname()}" in message
    assert "HF_HUB_OFFLINE is set" in message


def test_the_library_leaves_offline_mode_to_the_user() -> None:
    """Importing our model code does not turn offline mode on; the test config does, for subprocesses too."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    code = "import actors.models, huggingface_hub.constants as c; print(c.HF_HUB_OFFLINE)"
    for child_env, expected in ((env, "False"), (os.environ, "True")):
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env, capture_output=True, text=True)
        assert out.stdout.strip() == expected, out.stderr


class _NotFoundHub(http.server.BaseHTTPRequestHandler):
    """A Hub on loopback that knows no repository: every request gets a 404, and its path is kept."""

    paths: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        type(self).paths.append(self.path)
        body = b'{"error": "Repository not found"}'
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, *args: object) -> None:  # keep pytest's output clean
        pass


@pytest.fixture
def not_found_hub() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFoundHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("hub", ["nothing listening", "a 404 server"])
def test_failed_download_names_the_model_and_the_node(hub: str, tmp_path: Path, request) -> None:
    """Online mode (HF_HUB_OFFLINE unset) against a Hub on loopback: never the real one."""
    endpoint = request.getfixturevalue("not_found_hub") if hub == "a 404 server" else f"http://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env |= {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "actors.models", "acme/missing"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"model 'acme/missing' could not be downloaded from the Hub ({endpoint}) on node {socket.gethostname()}" in (
        proc.stderr
    )
    if hub == "a 404 server":
        assert "RepositoryNotFoundError" in proc.stderr
        assert any("acme/missing" in path for path in _NotFoundHub.paths), _NotFoundHub.paths
    assert not list((tmp_path / "hf" / "hub").glob("models--*/snapshots/*/*")), "nothing was downloaded"


def test_hf_id_from_the_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    # The HF cache layout: refs/main names a snapshot whose files link to blobs.
    repo = tmp_path / "models--acme--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "cafe").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to("../../blobs/cafe")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))

    # The config and tokenizer are there, the weights not: enough for the driver, not to load the model.
    assert resolve_model("acme/tiny", weights=False) == snapshot
    with pytest.raises(ModelNotFoundError, match="'acme/tiny' is not in the HF cache"):
        resolve_model("acme/tiny")
    (repo / "blobs" / "beef").write_text("weights")
    (snapshot / "model.safetensors").symlink_to("../../blobs/beef")
    assert resolve_model("acme/tiny") == snapshot
    with pytest.raises(ModelNotFoundError, match="acme/tiny"):  # listed among the choices
        resolve_model("acme/other")


def _build_in(cache: str, barrier: mp.synchronize.Barrier, results: mp.Queue) -> None:
    barrier.wait()  # start both builds at once
    folder, built = ensure_built("tiny-random", Path(cache))
    results.put((str(folder), built))


def test_concurrent_builds_build_once(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")  # fork after torch/OpenMP start-up can hang
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_build_in, args=(str(tmp_path), barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    folders = {folder for folder, _ in outcomes}
    assert folders == {str(tmp_path / "models" / "tiny-random")}
    assert sorted(built for _, built in outcomes) == [False, True]
    assert tensor_digest(tmp_path / "models" / "tiny-random") == TINY_DIGEST
    assert not list((tmp_path / "models").glob(".tiny-random.tmp-*"))


def test_outdated_build_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(actors.models._BUILDERS, "tiny-random", lambda out: (out / "config.json").write_text("{}"))
    folder, built = ensure_built("tiny-random", tmp_path)
    assert built
    monkeypatch.setitem(actors.models._RECIPES, "tiny-random", 999)  # as if the recipe changed
    assert ensure_built("tiny-random", tmp_path) == (folder, True)
    assert json.loads((folder / "mcprl_build.json").read_text())["recipe"] == 999
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".tiny-random.lock", "tiny-random"]


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setitem(actors.models._BUILDERS, "tiny-random", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_built("tiny-random", tmp_path)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".tiny-random.lock"]


def test_cli(tiny_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["tiny-random", "--cache-dir", str(tiny_cache)])
    assert capsys.readouterr().out.splitlines() == [
        str(tiny_cache / "models" / "tiny-random"),
        f"{TINY_PARAMS:,} parameters",
    ]
    with pytest.raises(SystemExit) as info:
        main(["no-such-model", "--cache-dir", str(tiny_cache)])
    assert info.value.code == 2
    assert "tiny-random" in capsys.readouterr().err


# --------------------------------------------------------------------------- smollm2 (converted)


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    # The default cache on purpose: the conversion (~20-60 s) then happens once per machine.
    return resolve_model("smollm2-135m-instruct")


@pytest.mark.slow
def test_smollm2_conversion(smollm2_folder: Path) -> None:
    from gguf import GGUFReader

    config = json.loads((smollm2_folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "bfloat16"
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert count_parameters(smollm2_folder) == SMOLLM2_PARAMS

    tokenizer = load_tokenizer(ModelConfig(name="smollm2-135m-instruct"))
    gguf_template = GGUFReader(smollm2_gguf_path()).fields["tokenizer.chat_template"].contents()
    assert tokenizer.chat_template == gguf_template
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|im_end|>")


@pytest.mark.slow
def test_smollm2_answers_sensibly(smollm2_folder: Path) -> None:
    # float32 (the bf16 weights upcast exactly): its greedy choice does not hinge on bf16 rounding.
    cfg = ModelConfig(name="smollm2-135m-instruct", dtype="float32")
    tokenizer, model = load_tokenizer(cfg), load_causal_lm(cfg)
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**enc, max_new_tokens=24, do_sample=False)
    reply = tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in reply, reply

    # A robust check too: after "The capital of France is", " Paris" is by far the likeliest token.
    prefix = tokenizer("The capital of France is", add_special_tokens=False, return_tensors="pt")
    ids = torch.cat([enc["input_ids"], prefix["input_ids"]], dim=1)
    with torch.no_grad():
        probs = model(ids).logits[0, -1].softmax(-1)
    assert tokenizer.decode(probs.argmax()) == " Paris"
    assert probs.max() > 0.5
