"""The switch program: the P4_16 pipeline (v1model) of the aggregator's data path, its layout and table entries
in Python, and the P4-structured pipeline model that executes them (``intml.p4.model``)."""
