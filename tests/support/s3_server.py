"""An S3-compatible server on 127.0.0.1 (moto's server mode: a real HTTP endpoint that boto3 and s3fs talk to).

    with S3Server() as s3:                        # a free port; s3.env: the AWS_* variables that point at it
        s3.upload(data_dir, "bucket", "prefix")   # a prepared folder, file by file
        monkeypatch.setenv(...) for s3.env        # then data.path = "s3://bucket/prefix"

The keys are made up for the test; they let a test check that no message shows them.
"""

from __future__ import annotations

from pathlib import Path


class S3Server:
    KEY_ID = "AKIATESTKEY0123456789"
    SECRET = "test-secret-key-never-in-logs-0123456789"

    def __init__(self):
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.endpoint = ""

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.KEY_ID,
                "AWS_SECRET_ACCESS_KEY": self.SECRET, "AWS_DEFAULT_REGION": "us-east-1"}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.KEY_ID,
                            aws_secret_access_key=self.SECRET, region_name="us-east-1")

    def upload(self, folder: Path, bucket: str, prefix: str) -> None:
        client = self.client()
        client.create_bucket(Bucket=bucket)
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")

    def start(self) -> "S3Server":
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
