"""Entrypoint of the MLflow server image (mlflow.Dockerfile).

Makes sure the S3 bucket of ``--artifacts-destination s3://BUCKET/...`` (or
``--default-artifact-root``) exists, waiting up to ``MLFLOW_BUCKET_WAIT_S`` seconds (default
60) for the S3 endpoint (``MLFLOW_S3_ENDPOINT_URL``, e.g. MinIO) to answer, then replaces
itself with ``mlflow server ARGS``. Credentials come from the environment that boto3 reads
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``) and libpq reads (``PGPASSWORD``): nothing
here prints them, and the backend-store URI needs no password in it.
"""

from __future__ import annotations

import os
import sys
import time
from urllib.parse import urlparse

URI_OPTIONS = ("--artifacts-destination", "--default-artifact-root")


def artifact_bucket(argv: list[str]) -> str | None:
    """The S3 bucket the server's artifacts go to, or None when they do not go to S3."""
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if name not in URI_OPTIONS:
            continue
        if not value and i + 1 < len(argv):
            value = argv[i + 1]
        parsed = urlparse(value)
        if parsed.scheme == "s3" and parsed.netloc:
            return parsed.netloc
    return None


def ensure_bucket(bucket: str, endpoint: str | None, wait_s: float) -> None:
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    client = boto3.client("s3", endpoint_url=endpoint or None)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            client.head_bucket(Bucket=bucket)
            return
        except ClientError as err:
            code = str(err.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchBucket", "NotFound"):
                client.create_bucket(Bucket=bucket)
                print(f"created the artifact bucket s3://{bucket}", file=sys.stderr)
                return
            problem = f"S3 answered {code or err}"
        except BotoCoreError as err:
            problem = f"{type(err).__name__}: {err}"
        if time.monotonic() > deadline:
            sys.exit(f"error: bucket s3://{bucket} at {endpoint or 'AWS'} not usable: {problem}")
        time.sleep(2)


def main(argv: list[str]) -> None:
    bucket = artifact_bucket(argv)
    if bucket:
        wait_s = float(os.environ.get("MLFLOW_BUCKET_WAIT_S", "60"))
        ensure_bucket(bucket, os.environ.get("MLFLOW_S3_ENDPOINT_URL"), wait_s)
    os.execvp("mlflow", ["mlflow", "server", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
