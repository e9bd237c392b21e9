"""History retention: which closed rounds' global models the server keeps (`--history N`), for PersFL's new
participants (`GET /v1/history`), and the release of older rounds' tensors."""

from __future__ import annotations

import logging
from typing import Any

from edgepfl.protocol import API_PREFIX
from edgepfl.server.errors import Refused
from edgepfl.server.records import RoundRecord
from edgepfl.server.store import Store

log = logging.getLogger("edgepfl.server")


class History:
    """The retention of one state folder: the last `keep` closed rounds (0 keeps every round)."""

    def __init__(self, store: Store, keep: int):
        self.store = store
        self.keep = keep

    def apply(self) -> None:
        """Release the tensors of rounds older than the last `keep` closed rounds.

        The release is committed first and only then are blobs no kept row names deleted, so a retained blob is
        never lost; a crash in between leaves unreferenced blobs, which the next start removes.
        """
        if self.keep == 0:
            return
        closed = [record.round_id for record in self.store.rounds() if record.state == "closed"]
        if len(closed) <= self.keep:
            return
        through = closed[-self.keep] - 1
        if through <= self.store.released_through():
            return
        released = self.store.release_rounds(through)
        removed = self.store.blobs.delete(released - self.store.referenced_blobs())
        if removed:
            log.info("history: released the tensors of rounds up to %d (%d blob file(s))", through, removed)

    def check_retained(self, record: RoundRecord) -> None:
        """Refuse (410 released) a round whose tensors were released."""
        if record.round_id <= self.store.released_through():
            raise Refused(
                "released",
                f"round {record.round_id}'s tensors were released (the server keeps the last {self.keep} rounds' "
                "global models)",
                "choose a round listed by GET /v1/history, or restart the server with a larger --history",
            )

    def listing(self) -> dict[str, Any]:
        """JSON: the closed rounds whose global model can still be fetched, oldest first, and the retention."""
        return {
            "retention": self.keep,
            "released_through": self.store.released_through(),
            "rounds": [
                {
                    "round": record.round_id,
                    "sha256": record.result_sha,
                    "closed": record.closed,
                    "url": f"{API_PREFIX}/rounds/{record.round_id}/result",
                }
                for record in self.store.rounds()
                if record.state == "closed" and record.result_sha is not None
            ],
        }
