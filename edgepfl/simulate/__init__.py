"""`edgepfl simulate`, `edgepfl demo` and `edgepfl plot`: federated experiments on one machine.

The simulator drives the device runtime's client algorithms and the server's strategies in one
process (no second implementation of either); see `edgepfl.simulate.loop`.
"""
