"""A moto S3 server on loopback that a test can stop and restart on the same port (moto keeps its objects
in this process, so a restarted server still has them)."""

from __future__ import annotations


def keys(s3, bucket: str, prefix: str) -> list[str]:
    """Every object key under ``prefix`` (all pages), with a boto3 client ``s3``."""
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


class RestartableS3:
    def __init__(self):
        from clarifier.runtime.services import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = None
        self.start()

    def env(self, **extra: str) -> dict[str, str]:
        """The AWS variables that point clients (and Ray workers started after them) at this server."""
        return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": self.url, "AWS_ENDPOINT_URL_S3": self.url, **extra}

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
