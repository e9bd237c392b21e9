"""Secure rounds through edgepfl's Flower ServerApp and ClientApp (issue 34), on an in-process Grid: the train replies
carry key adverts, query messages carry the steps, and a node that vanishes after advertising is dropped."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402
from test_flower import (  # noqa: E402, F401 - fixtures
    NODES,
    LocalGrid,
    flower_run_config,
    node_handler,
    reference,
    task_identity,
)
from test_simulate import tiny_npz  # noqa: E402, F401 - the fixture

from edgepfl.flower.client_app import make_client_app  # noqa: E402
from edgepfl.flower.messages import SECAGG_QUERY  # noqa: E402
from edgepfl.flower.server_app import make_server_app  # noqa: E402
from edgepfl.server.store import Store  # noqa: E402
from edgepfl.simulate.rounds import SERVER_DIR, final_global_base  # noqa: E402

SECURE = {"secure-aggregation": True, "secagg-clip": 5.0, "secagg-max-weight": 200, "min-clients": 3, "rounds": 2}


def run(reference, tmp_path, silent_after_advert: int | None = None) -> Store:  # noqa: F811
    config, root = reference
    run_config = {
        **flower_run_config(config, root),
        "out": str(tmp_path),
        "state-root": str(tmp_path / "devices"),
        **SECURE,
    }
    client_app = make_client_app(run_config)
    handlers = {node: node_handler(client_app, node, node - 11) for node in NODES}
    if silent_after_advert is not None:  # this node trains and advertises keys, then never answers again
        answer = handlers[silent_after_advert]
        handlers[silent_after_advert] = lambda m: None if m.metadata.message_type == SECAGG_QUERY else answer(m)
    make_server_app(run_config)(LocalGrid(handlers), Context(1, 1, {}, RecordDict(), {}))
    assert final_global_base(tmp_path)
    return Store(tmp_path / SERVER_DIR)


@pytest.mark.slow
def test_flower_nodes_aggregate_two_rounds_securely(reference, tmp_path, task_identity):  # noqa: F811
    store = run(reference, tmp_path)
    try:
        assert [record.state for record in store.rounds()] == ["closed", "closed"]
        for round_id in (1, 2):
            assert store.updates(round_id) == []  # no update reached the server
        rows = store.read("SELECT round_id, summary FROM secure_rounds")
        summaries = {row["round_id"]: row["summary"] for row in rows}
        assert all('"masked": 3' in summary and '"dropped": 0' in summary for summary in summaries.values())
        assert len(summaries) == 2
    finally:
        store.close()
    for node in NODES.values():  # the nodes delivered their rounds and hold no secure session
        assert not list((tmp_path / "devices" / node).glob("secagg-r*.json"))


def test_a_node_silent_after_its_advert_is_dropped_and_the_round_closes(reference, tmp_path, task_identity):  # noqa: F811
    store = run(reference, tmp_path, silent_after_advert=13)
    try:
        assert [record.state for record in store.rounds()] == ["closed", "closed"]
        summary = store.read("SELECT summary FROM secure_rounds WHERE round_id = 1")[0]["summary"]
        assert '"masked": 2' in summary and '"dropped": 1' in summary and '"recovered": 0' in summary
    finally:
        store.close()


def test_the_secure_run_config_is_checked_in_one_line(reference, tmp_path, task_identity, caplog):  # noqa: F811
    config, root = reference
    run_config = {**flower_run_config(config, root), "out": str(tmp_path), **SECURE, "strategy": "median"}
    with caplog.at_level("ERROR", logger="flwr"):
        make_server_app(run_config)(LocalGrid({}), Context(1, 1, {}, RecordDict(), {}))
    errors = [record.getMessage() for record in caplog.records if record.levelname == "ERROR"]
    assert errors == [errors[0]] and "secure aggregation cannot run with --strategy median" in errors[0]
