"""A real S3 API on loopback (moto's server) for the storage tests: `s3_env()` starts one and yields the
environment that points boto-style clients and pyarrow at it, with a bucket `BUCKET` made."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cluster.ports import free_port

BUCKET = "mcprl-test"


@contextmanager
def s3_env() -> Iterator[dict[str, str]]:
    port = free_port()
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or "moto_server"
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",  # never ask an instance-metadata address for credentials
    }
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start on 127.0.0.1:{port}") from None
                time.sleep(0.1)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            import pyarrow.fs as pafs

            pafs.S3FileSystem(
                endpoint_override=env["AWS_ENDPOINT_URL"],
                access_key="test",
                secret_key="test",
                region="us-east-1",
                allow_bucket_creation=True,
            ).create_dir(BUCKET)
            yield env
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    finally:
        proc.terminate()
        proc.wait(timeout=10)
