"""edgepfl in Flower's runtime: a Flower strategy over edgepfl's round engine, and the edgepfl device as a ClientApp.

`pip install 'edgepfl[flower]'`. The Flower `Grid` is one more way of reaching devices: rounds are planned,
checked and aggregated by `edgepfl serve`'s own `RoundEngine` (strategy.py); each node runs the device
runtime's round (client_app.py). Nothing here is imported by `edgepfl` or `edgepfl.cli`.
"""

import importlib.util

from edgepfl.errors import UsageError

if importlib.util.find_spec("flwr") is None:
    raise UsageError("edgepfl.flower needs Flower (flwr)", "pip install 'edgepfl[flower]' (on Python 3.11 or later)")
