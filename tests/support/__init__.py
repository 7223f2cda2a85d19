"""Helpers the tests share: the in-process harness, live aggregator and rank processes, faulty sockets."""
