"""The tests' spoofing helpers live in the package, for ``intml-testbed audit`` too."""

from intml.testbed.spoof import raw_socket, send_spoofed, udp_packet  # noqa: F401
