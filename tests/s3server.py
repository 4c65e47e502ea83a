"""A real S3 API server for the tests: moto's standalone server (`moto[server]`, the dev extra)
on a free loopback port, started and stopped by fixtures in conftest.py."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from rlboost.services import free_port

# Dummy credentials: moto accepts any. Set in the environment (never passed in code), and
# always, so the S3 client never looks for an instance role on a metadata address.
S3_ENV = {"AWS_ACCESS_KEY_ID": "rlboost-test", "AWS_SECRET_ACCESS_KEY": "rlboost-test-secret",
          "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"}


class MotoS3:
    """`python -m moto.server` on 127.0.0.1. Its state is in memory: a restarted server is empty."""

    def __init__(self, log: Path, port: int = 0, env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.env = env or {}  # e.g. INITIAL_NO_AUTH_ACTION_COUNT=0: moto checks credentials
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> MotoS3:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.env})
        deadline = time.monotonic() + timeout_s
        while True:  # until it answers an S3 request (ListBuckets)
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/", timeout=1.0) as r:
                    if r.status == 200:
                        return self
            except urllib.error.HTTPError:  # it answered (a 403 where it checks credentials)
                return self
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"moto server did not answer on {self.url} in {timeout_s:g} s")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a crashed server or a lost instance: no goodbye on open connections."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def client(self):
        """A boto3 client (what an operator's tooling would use) for buckets and tampering."""
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"])

    def new_bucket(self) -> str:
        name = f"rbw-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def drop_bucket(self, name: str) -> None:
        with contextlib.suppress(Exception):
            c = self.client()
            for page in c.get_paginator("list_objects_v2").paginate(Bucket=name):
                for o in page.get("Contents", []):
                    c.delete_object(Bucket=name, Key=o["Key"])
            c.delete_bucket(Bucket=name)
