"""The one table from the engine's refusal codes to HTTP status codes."""

from __future__ import annotations

from edgepfl.server.errors import ApiError, Refused

STATUS: dict[str, int] = {
    # 400: the body is not what the protocol says
    "malformed": 400,
    # 401: who are you
    "unauthorized": 401,
    # 403: you may not
    "enrollment_closed": 403,
    "not_sampled": 403,
    "wrong_device": 403,
    # 404 / 410: it is not (or no longer) here
    "no_such_round": 404,
    "not_secure": 404,
    "released": 410,
    "join_link_expired": 410,
    "join_link_used_up": 410,
    "join_link_revoked": 410,
    # 409: it conflicts with the state of the server
    "already_enrolled": 409,
    "cannot_join": 409,
    "deadline_passed": 409,
    "round_closed": 409,
    "too_stale": 409,
    "duplicate_update": 409,
    "duplicate_metrics": 409,
    "layout_mismatch": 409,
    "no_result": 409,
    "secure_round": 409,
    "too_early": 409,
    # 422: well-formed but refused
    "invalid_device_name": 422,
    "invalid_enroll_key": 422,
    "bad_metadata": 422,
    "bad_tensors": 422,
    "bad_metrics": 422,
    "personal_tensors": 422,
    "buffers_not_shared": 422,
    "wrong_encoding": 422,
    "over_clip_norm": 422,
    "bad_secagg": 422,
    # 429 / 503: not now
    "too_many_attempts": 429,
    "upload_in_progress": 429,
    "round_not_opened": 503,
    # 503 / 507: the server's disk refused a write (server/store.StorageError)
    "storage_failed": 503,
    "insufficient_storage": 507,
}


def status_of(refusal: Refused) -> int:
    """The HTTP status of a refusal: the HTTP layer's own, else the table's (500 for a code missing there)."""
    if isinstance(refusal, ApiError):
        return refusal.status
    return STATUS.get(refusal.error, 500)
