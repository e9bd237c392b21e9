"""The HTTP API as a client sees it stays put: the OpenAPI spec (paths, operation ids, schemas, replies) and the route
table (every path, its methods and name, in matching order) of a secure server with the device page, compared with
tests/openapi_snapshot.json. A change to the API is deliberate: regenerate the snapshot with
`python tests/test_server_openapi.py` and review its diff."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from server_helpers import app_routes, enroll
from test_secagg_rounds import secure_config

from edgepfl.server.app import create_app
from edgepfl.server.engine import create_engine

SNAPSHOT = Path(__file__).with_name("openapi_snapshot.json")


def api_of(tmp_path: Path) -> dict[str, Any]:
    """The spec (less the package's version) and the route table of a secure server's app."""
    config = secure_config(tmp_path, enroll_secret="a-secret-for-the-openapi-snapshot")
    enroll(config.state, "phone")
    engine = create_engine(config)
    try:
        app = create_app(engine)
        spec = app.openapi()
        spec["info"].pop("version")
        routes = [[route.path, sorted(route.methods or ()), route.name] for route in app_routes(app)]
        return {"openapi": spec, "routes": routes}
    finally:
        engine.close()


def test_the_api_matches_its_snapshot(tmp_path: Path) -> None:
    api = api_of(tmp_path)
    snapshot = json.loads(SNAPSHOT.read_text(encoding="utf-8"))
    operations = [
        entry["operationId"] for entries in snapshot["openapi"]["paths"].values() for entry in entries.values()
    ]
    assert len(operations) > 15, "the snapshot holds the API's operations (each with its id)"
    assert api["routes"] == snapshot["routes"], "a route moved, was renamed or lost: see the module docstring"
    assert api["openapi"] == snapshot["openapi"], "the OpenAPI spec changed: see the module docstring"


if __name__ == "__main__":  # regenerate the snapshot (a deliberate API change)
    with tempfile.TemporaryDirectory() as folder:
        text = json.dumps(api_of(Path(folder)), indent=1, sort_keys=True) + "\n"
    SNAPSHOT.write_text(text, encoding="utf-8")
    sys.stdout.write(f"wrote {SNAPSHOT}\n")
