"""Objects in and out of an S3-compatible store, with integrity checks at every step.

``put_blob`` sends an object whole (``Content-MD5``) or, above the part size, as a multipart
upload whose every part carries its own ``Content-MD5`` (the store refuses a part that arrived
damaged); an upload that fails is aborted, so no parts linger. ``get_verified`` reads an
object back and checks its size and SHA-256 against what the manifest recorded.
``put_if`` is the one conditional write (``If-None-Match: *`` or ``If-Match: ETAG``) the
commit protocol and the epoch counter rest on.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

UPLOAD_THREADS = 4
PRECONDITION = ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")


class Blob:
    """Bytes made of segments (memoryviews of tensors), sliced without joining them all."""

    def __init__(self, segments: Sequence[bytes | memoryview]) -> None:
        self.segments = [memoryview(s).cast("B") for s in segments if len(s)]
        self.size = sum(len(s) for s in self.segments)

    def sha256(self) -> str:
        h = hashlib.sha256()
        for s in self.segments:
            h.update(s)
        return h.hexdigest()

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``: one part's copy, never the whole object's."""
        out, pos = bytearray(), 0
        for s in self.segments:
            lo, hi = max(start - pos, 0), min(end - pos, len(s))
            if lo < hi:
                out += s[lo:hi]
            pos += len(s)
            if pos >= end:
                break
        return bytes(out)


class FileBlob:
    """A file's bytes as a ``Blob``: parts read with ``pread``, nothing mapped or held whole."""

    def __init__(self, path) -> None:
        self.path = path
        self.size = os.path.getsize(path)

    def sha256(self) -> str:
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            for chunk in iter(lambda: f.read(4 << 20), b""):
                h.update(chunk)
        return h.hexdigest()

    def read(self, start: int, end: int) -> bytes:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            return os.pread(fd, end - start, start)
        finally:
            os.close(fd)


def md5_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def error_code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return code or status


def precondition_failed(exc: Exception) -> bool:
    response = getattr(exc, "response", None) or {}
    status = str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return error_code(exc) in PRECONDITION or status in ("412", "409")


def unreachable(exc: Exception) -> bool:
    """Whether ``exc`` says the store did not answer (no connection, a connection dropped or
    timed out, a 5xx or "slow down" reply) rather than that it refused the request."""
    from botocore.exceptions import ConnectionError, HTTPClientError

    if isinstance(exc, ConnectionError | HTTPClientError):
        return True
    status = str(
        (getattr(exc, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode", "")
    )
    return status.startswith("5") or error_code(exc) in ("SlowDown", "ServiceUnavailable")


def not_found(exc: Exception) -> bool:
    return error_code(exc) in ("NoSuchKey", "404", "NotFound")


def put_blob(client, bucket: str, key: str, blob: Blob, part_bytes: int) -> None:
    if blob.size <= part_bytes:
        body = blob.read(0, blob.size)
        client.put_object(Bucket=bucket, Key=key, Body=body, ContentMD5=md5_b64(body))
        return
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    try:
        ranges = [(s, min(s + part_bytes, blob.size)) for s in range(0, blob.size, part_bytes)]

        def send(i: int) -> dict:
            body = blob.read(*ranges[i])
            done = client.upload_part(
                Bucket=bucket,
                Key=key,
                UploadId=upload,
                PartNumber=i + 1,
                Body=body,
                ContentMD5=md5_b64(body),
            )
            return {"PartNumber": i + 1, "ETag": done["ETag"]}

        with ThreadPoolExecutor(UPLOAD_THREADS, thread_name_prefix="s3-part") as pool:
            parts = list(pool.map(send, range(len(ranges))))
        client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
        )
    except BaseException:
        # The first error is the one to report (a lifecycle rule mends a failed abort).
        with contextlib.suppress(Exception):
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
        raise


def get_verified(client, bucket: str, key: str, sha256: str, size: int) -> bytes:
    """The object's bytes; ``ValueError`` unless they are ``size`` long and hash to
    ``sha256``."""
    data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    if len(data) != size:
        raise ValueError(f"{key}: {len(data)} bytes, the manifest says {size}")
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(f"{key} does not match the SHA-256 in its manifest")
    return data


def get_with_etag(client, bucket: str, key: str) -> tuple[bytes, str] | None:
    """An object's bytes and ETag, or None if there is no such object."""
    try:
        reply = client.get_object(Bucket=bucket, Key=key)
    except Exception as exc:
        if not_found(exc):
            return None
        raise
    return reply["Body"].read(), reply["ETag"]


def put_if(client, bucket: str, key: str, body: bytes, etag: str | None) -> bool:
    """Write ``key`` only if it does not exist (``etag=None``) or still has ``etag``; False
    if another writer got there first (412)."""
    condition = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}
    try:
        client.put_object(Bucket=bucket, Key=key, Body=body, ContentMD5=md5_b64(body), **condition)
    except Exception as exc:
        if precondition_failed(exc):
            return False
        raise
    return True


def list_keys(client, bucket: str, prefix: str) -> list[str]:
    """Every key under ``prefix``, with the prefix taken off."""
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [o["Key"][len(prefix) :] for o in page.get("Contents", [])]
    return keys


def delete_keys(client, bucket: str, keys: list[str]) -> None:
    for i in range(0, len(keys), 1000):
        batch = [{"Key": k} for k in keys[i : i + 1000]]
        client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})


def download_verified(client, bucket: str, key: str, sha256: str, size: int, dest) -> None:
    """Stream an object to the file ``dest``, hashing as it comes; ``ValueError`` (and no
    ``dest``) unless it is ``size`` bytes long and hashes to ``sha256``."""
    h, got = hashlib.sha256(), 0
    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
        with open(dest, "wb") as f:
            for chunk in iter(lambda: body.read(4 << 20), b""):
                h.update(chunk)
                got += len(chunk)
                f.write(chunk)
        if got != size:
            raise ValueError(f"{key}: {got} bytes, the manifest says {size}")
        if h.hexdigest() != sha256:
            raise ValueError(f"{key} does not match the SHA-256 in its manifest")
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(dest)
        raise
