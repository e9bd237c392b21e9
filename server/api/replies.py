"""What the HTTP API's routers share: the round id parameter, the JSON body cap and the OpenAPI entries of the JSON
`{error, detail, fix}` refusals."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path

MAX_JSON_BYTES = 64 * 1024
MAX_ROUND_ID = 2**31 - 1
SAFETENSORS = "application/octet-stream"

RoundId = Annotated[int, Path(ge=1, le=MAX_ROUND_ID, description="round id")]

ERROR_SCHEMA = {
    "type": "object",
    "properties": {"error": {"type": "string"}, "detail": {"type": "string"}, "fix": {"type": "string"}},
    "required": ["error", "detail", "fix"],
}


def error_replies(descriptions: dict[int, str]) -> dict[int, dict[str, Any]]:
    """OpenAPI response entries, by status code, for JSON `{error, detail, fix}` refusals."""
    return {
        code: {"description": text, "content": {"application/json": {"schema": ERROR_SCHEMA}}}
        for code, text in descriptions.items()
    }


ERRORS = error_replies(
    {
        400: "malformed safetensors",
        401: "missing or invalid token",
        403: "not sampled",
        404: "no such round",
        408: "the body arrived slower than the server's --min-upload-rate allows",
        409: "round closed, deadline passed, duplicate or layout mismatch",
        410: "the round's tensors were released by --history retention",
        413: "body too large",
        422: "invalid round id, metadata, tensors or metrics",
        503: "the server's disk refused the write (read-only, I/O error); Retry-After says when to retry",
        507: "the server's disk is full; Retry-After says when to retry",
    }
)
