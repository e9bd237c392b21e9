"""Secure aggregation in the server (`--secure-aggregation`), one package as Flower keeps its SecAgg+ workflow; the
protocol itself (messages, sessions, masking) is `edgepfl.secagg`'s.

- `mode.py`: the round mode (`SecureMode`, a synchronous mode whose devices take the steps instead of uploading),
  registered in `server/modes/` with the others;
- `rounds.py`: each secure round's protocol session, durable, stepped by the engine's tick;
- `store.py`: what the database keeps of them (tables `secure_rounds`, `secure_messages`);
- `steps.py`: the devices' calls (`SecureSteps`, `steps_of(engine)`), checked through the core's `DeviceCalls`;
- `routes.py`: those calls over HTTP (`/v1/rounds/{r}/secagg/...`), a router the app includes;
- `strategy.py`: the wrapper that aggregates the round's unmasked sum around the inner strategy.

Nothing outside this package imports its modules but the registry (`SecureMode`) and the drivers (`steps.py`).
"""

# the registry first: it imports `mode.py`, whose round-mode base is the registry's package, so that importing any
# module of this package first (`mode.py` included) finds the registry whole
import edgepfl.server.modes  # noqa: F401
