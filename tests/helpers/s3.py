"""A client's side of S3 for the tests: moto on 127.0.0.1, files uploaded to it, and the Dataset
of a local one's fields read back from URLs (the server side of SeaweedFS is s3server.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import stoker


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (any credentials accepted): its URL; stopped after."""
    from moto.server import ThreadedMotoServer  # heavy: imported by the tests that serve S3

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def s3_options(endpoint: str) -> dict[str, Any]:
    """moto's: any credentials. Nothing here turns s3fs's or botocore's retries off: stoker does."""
    return {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": endpoint,
        "use_listings_cache": False,
        "client_kwargs": {"region_name": "us-east-1"},
    }


_buckets = iter(range(1_000_000))


def upload(moto: str, local: Path) -> str:
    """Every file under ``local`` into a new bucket (straight to moto); returns ``s3://bucket``."""
    import boto3

    bucket = f"stoker-moto-{next(_buckets)}"
    client = boto3.client(
        "s3", endpoint_url=moto, aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    )
    client.create_bucket(Bucket=bucket)
    for p in sorted(local.iterdir()):
        client.put_object(Bucket=bucket, Key=f"data/{p.name}", Body=p.read_bytes())
    return f"s3://{bucket}"


def remote_dataset(local_ds: stoker.Dataset, base: str, options: Mapping[str, Any]) -> stoker.Dataset:
    """The same fields as ``local_ds``, their files named by URLs under ``base``."""
    fields = {}
    for name, f in local_ds.fields.items():
        pattern = f.files if isinstance(f.files, str) else f.files[0]
        url = base + "/data/" + Path(pattern).name
        fields[name] = stoker.Field(
            url, f.dtype, f.shape, header_bytes=f.header_bytes, footer_bytes=f.footer_bytes,
            compression=f.compression, byte_order=f.byte_order, storage_options=options,
        )  # fmt: skip
    return stoker.Dataset(fields)
