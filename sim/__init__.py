"""intml-sim: a discrete-event network simulator that drives intml's sans-I/O cores on virtual time, with the
baselines (Gloo's ring, a sharded parameter server, SwitchML int32) and analytic models beside it."""
